"""REST: emulation runs. POST one configuration, or {"configs": [...]}, to queue runs on the
agents' `emulate` queue; GET lists and reads them (result = `dynaplane emulate --json`).
POST /api/emulations/search queues a search run (kind "search") for one setting."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from agents import protocol
from controlplane.common import inputs
from controlplane.emulation import services
from controlplane.emulation.models import EmulationRun


class EmulationRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = EmulationRun
        fields = ["id", "kind", "model", "layout", "gpus", "gpu_type", "global_batch", "micro_batch", "seq_len",
                  "recompute", "top", "state", "message", "result", "error", "created_at", "finished_at",
                  "wall_seconds"]


class EmulationConfigSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=200, help_text="a catalog name or a stored model config")
    layout = serializers.CharField(max_length=500)
    gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS)
    gpu_type = serializers.ChoiceField(choices=protocol.EMULATOR_DEVICES, default="h100")
    global_batch = serializers.IntegerField(min_value=1, max_value=inputs.INT32_MAX)
    micro_batch = serializers.IntegerField(min_value=1, max_value=inputs.INT32_MAX, default=1)
    seq_len = serializers.IntegerField(min_value=1, max_value=inputs.MAX_SEQ_LEN)
    recompute = serializers.ChoiceField(choices=protocol.RECOMPUTE_MODES, default="none")


class SearchRequestSerializer(EmulationConfigSerializer):
    layout = None  # a search finds the layouts
    top = serializers.IntegerField(min_value=1, max_value=protocol.SEARCH_TOP_MAX, default=3)


class EmulationRequestSerializer(serializers.Serializer):
    configs = EmulationConfigSerializer(many=True, allow_empty=False, max_length=32)


class EmulationRunsSerializer(serializers.Serializer):
    runs = EmulationRunSerializer(many=True)


class EmulationRunViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    queryset = EmulationRun.objects.all()
    serializer_class = EmulationRunSerializer

    @extend_schema(request=EmulationRequestSerializer, responses={201: EmulationRunsSerializer})
    def create(self, request, *args, **kwargs):
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"non_field_errors": ["the body must be a JSON object: one "
                                                                    "configuration or {\"configs\": [...]}"]})
        body = request.data if "configs" in request.data else {"configs": [request.data]}
        incoming = EmulationRequestSerializer(data=body)
        incoming.is_valid(raise_exception=True)
        runs = services.emulation_create(configs=incoming.validated_data["configs"], created_by=request.user)
        return Response({"runs": EmulationRunSerializer(runs, many=True).data}, status=status.HTTP_201_CREATED)

    @extend_schema(request=SearchRequestSerializer, responses={201: EmulationRunSerializer})
    @action(detail=False, methods=["post"])
    def search(self, request):
        """Queue a search: an agent ranks the layouts worth emulating for the setting; the
        run's result ({top, candidates, layouts, dropped}) arrives over /ws/emulations/."""
        incoming = SearchRequestSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        config = dict(incoming.validated_data)
        top = config.pop("top")
        run = services.emulation_search_create(config=config, top=top, created_by=request.user)
        return Response(EmulationRunSerializer(run).data, status=status.HTTP_201_CREATED)
