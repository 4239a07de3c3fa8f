"""REST: nodes and GPUs (read-only; agents write the inventory through heartbeats)."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from redis import RedisError
from rest_framework import serializers, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.cluster.events import ClusterSnapshot
from controlplane.cluster.lifecycle import GpuState
from controlplane.cluster.liveness import last_heard
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.selectors import cluster_snapshot


class GpuSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    job = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "model_name", "memory_bytes", "state", "job"]


class NodeSerializer(serializers.ModelSerializer):
    """`last_heartbeat`: the later of the row's (written when a heartbeat changed the node) and
    the agent's last post to Redis (cluster/liveness.py), given in the context as `heard`."""

    gpus = GpuSerializer(many=True, read_only=True)

    def to_representation(self, instance: Node) -> dict:
        shown = super().to_representation(instance)
        heard = self.context.get("heard", {}).get(instance.name)
        if heard is not None and (instance.last_heartbeat is None or heard > instance.last_heartbeat):
            shown["last_heartbeat"] = serializers.DateTimeField().to_representation(heard)
        return shown

    class Meta:
        model = Node
        fields = ["name", "host", "device", "state", "last_heartbeat", "agent_pid", "agent_started_at",
                  "registered_at", "gpu_count", "gpu_memory_bytes", "running_jobs", "running_emulations",
                  "cpu_percent", "cpu_count", "memory_used_bytes", "memory_total_bytes", "host_stats_at", "gpus"]


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = Node.objects.prefetch_related("gpus__job")
    serializer_class = NodeSerializer
    lookup_field = "name"

    def get_serializer(self, *args, **kwargs):
        """The rows shown, with when each was last heard (one Redis read for the page)."""
        if args and not getattr(self, "swagger_fake_view", False):
            rows = list(args[0]) if kwargs.get("many") else [args[0]]
            try:
                heard = last_heard([row.name for row in rows])
            except (RedisError, OSError):  # (the broker away: the rows' own times)
                heard = {}
            kwargs["context"] = {**self.get_serializer_context(), "heard": heard}
        return super().get_serializer(*args, **kwargs)


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("node", str, description="only this node's GPUs"),
    OpenApiParameter("state", str, enum=[s.value for s in GpuState]),
]))
class GpuViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = GpuSerializer

    def get_queryset(self):
        queryset = Gpu.objects.select_related("node", "job")
        params = self.request.query_params
        if "node" in params:
            queryset = queryset.filter(node__name=params["node"])
        if "state" in params:
            state = params["state"]
            if state not in GpuState.__members__.values():
                from rest_framework.exceptions import ValidationError

                raise ValidationError({"state": [f"{state!r} is not one of {[s.value for s in GpuState]}"]})
            queryset = queryset.filter(state=state)
        return queryset


class ClusterSnapshotView(APIView):
    """The cluster page's data at one seq; pages reload it when they see a seq gap."""

    @extend_schema(responses={200: dict})
    def get(self, request):
        snapshot: ClusterSnapshot = cluster_snapshot()
        return Response(snapshot.model_dump(mode="json"))
