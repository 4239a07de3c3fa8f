"""Health: is the database reachable, the broker answering, and how many agents live.
"degraded" with 503 when the database or the broker does not answer (the control plane
cannot act); "degraded" with 200 when it works but a node is lost (`warnings` names it).
Models: the catalog and the stored config.json files (model_store.py), listed and uploaded."""
from __future__ import annotations

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.broker_urls import redacted
from parallelism.layout.hf_config import SUPPORTED_TYPES
from controlplane.cluster.selectors import inventory_counts, lost_nodes
from controlplane.common import inputs
from controlplane.common.errors import PayloadTooLarge
from controlplane.common.model_store import MAX_CONFIG_BYTES, model_list, model_store

MAX_UPLOAD_BYTES = 2 * MAX_CONFIG_BYTES  # the body: the config plus its name, however it is spaced


class HealthView(APIView):
    """Anyone may ask whether the control plane works (load balancers, the launcher); with closed
    reads (DYNAPLANE_OPEN_READS=0) only a signed-in caller is told more than that."""

    permission_classes = [AllowAny]

    @extend_schema(responses={200: dict, 503: dict})
    def get(self, request):
        body, code = self._health()
        if not settings.DYNAPLANE_OPEN_READS and not request.user.is_authenticated:
            body = {"status": body["status"]}
        return Response(body, status=code)

    def _health(self) -> tuple[dict, int]:
        database = {"ok": True, "vendor": connection.vendor}
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError as exc:
            database.update(ok=False, error=str(exc))
        broker = {"ok": True, "url": redacted(settings.REDIS_URL)}
        try:
            client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
            client.ping()
            client.close()
        except (redis.RedisError, OSError) as exc:
            broker.update(ok=False, error=str(exc))
        working = database["ok"] and broker["ok"]
        warnings = [f"{name}: {what} unreachable" for name, what in (("database", database), ("broker", broker))
                    if not what["ok"]]
        body = {"database": database, "broker": broker}
        if database["ok"]:
            body.update(inventory_counts())
            warnings += [f"node {name} lost: no heartbeat since {seen.isoformat(timespec='seconds') if seen else 'never'}"
                         for name, seen in lost_nodes()]
        else:
            body.update(agents={"healthy": 0, "lost": 0}, gpus={"total": 0})
        body.update(status="degraded" if warnings else "ok", warnings=warnings)
        return body, 200 if working else 503


class ModelSummarySerializer(serializers.Serializer):
    name = serializers.CharField(help_text="what a job's or an emulation's `model` names")
    source = serializers.ChoiceField(choices=["catalog", "stored"],
                                     help_text="catalog: built in; stored: an uploaded config.json")
    error = serializers.CharField(help_text="a stored config the reader refuses: why (its other fields are absent)")
    family = serializers.CharField(required=False)
    description = serializers.CharField(required=False)
    params = serializers.IntegerField(required=False)
    layers = serializers.DictField(child=serializers.IntegerField(), required=False, help_text="module -> layers")
    heads = serializers.IntegerField(required=False)
    kv_heads = serializers.IntegerField(required=False, help_text="tensor parallelism divides them")
    experts = serializers.IntegerField(required=False)
    hidden = serializers.IntegerField(required=False, allow_null=True)
    vocab = serializers.IntegerField(required=False, allow_null=True)
    tensors = serializers.IntegerField(required=False)
    positions = serializers.IntegerField(required=False, allow_null=True,
                                         help_text="learned positions: the longest seq_len (null: no limit)")


class ModelUploadSerializer(serializers.Serializer):
    """Input of POST /api/models: a Hugging Face config.json, stored under `name`."""

    name = serializers.CharField(max_length=100, help_text="the model's name from now on: letters, digits, '.', "
                                                           "'_' and '-'; never a path, never a catalog name")
    config = serializers.DictField(help_text=f"the config.json's object (model_type one of "
                                             f"{', '.join(SUPPORTED_TYPES)}), at most "
                                             f"{MAX_CONFIG_BYTES // 1024} KiB")


class ModelViewSet(viewsets.ViewSet):
    """The models jobs and emulations can name: the catalog and uploaded config.json files."""

    @extend_schema(responses={200: ModelSummarySerializer(many=True)})
    def list(self, request):
        """Every model: the catalog's, then the stored ones (docs/elastic.md)."""
        return Response(ModelSummarySerializer(model_list(), many=True).data)

    @extend_schema(request=ModelUploadSerializer, responses={
        201: ModelSummarySerializer,
        413: OpenApiResponse(response=OpenApiTypes.OBJECT,
                             description=f"the body is larger than {MAX_UPLOAD_BYTES // 1024} KiB: `{{\"detail\": \"...\"}}`")})
    def create(self, request):
        """Store a Hugging Face config.json as a model jobs can name (400 naming the field and
        the rule: a bad name, a name taken, a config the reader refuses or too large)."""
        length = inputs.whole_number(request.META.get("CONTENT_LENGTH") or "0")
        if length is None or length > MAX_UPLOAD_BYTES:
            raise PayloadTooLarge(f"the body is larger than {MAX_UPLOAD_BYTES // 1024} KiB; a config.json is at "
                                  f"most {MAX_CONFIG_BYTES // 1024} KiB")
        incoming = ModelUploadSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        stored = model_store(**incoming.validated_data)
        return Response(ModelSummarySerializer(stored).data, status=status.HTTP_201_CREATED)
