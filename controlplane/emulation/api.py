"""REST: emulation runs (read; running them arrives with the emulator)."""
from __future__ import annotations

from rest_framework import serializers, viewsets

from controlplane.emulation.models import EmulationRun


class EmulationRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = EmulationRun
        fields = ["id", "model", "layout", "gpus", "gpu_type", "global_batch", "micro_batch", "seq_len", "recompute",
                  "state", "result", "error", "created_at", "finished_at", "wall_seconds"]


class EmulationRunViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = EmulationRun.objects.all()
    serializer_class = EmulationRunSerializer
