"""REST: jobs (create, list, read, delete) and transitions, the layout history (read)."""
from __future__ import annotations

from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from controlplane.jobs import services
from controlplane.jobs.models import Job, Transition


class JobSerializer(serializers.ModelSerializer):
    gpus = serializers.SlugRelatedField(slug_field="id", many=True, read_only=True)

    class Meta:
        model = Job
        fields = ["id", "name", "model", "layout", "world_size", "state", "global_batch", "micro_batch", "seq_len",
                  "error", "gpus", "created_at", "updated_at"]
        read_only_fields = ["world_size", "state", "error", "gpus", "created_at", "updated_at"]


class JobCreateSerializer(serializers.Serializer):
    """Input of POST /api/jobs; field rules here, layout rules in the service."""

    name = serializers.SlugField(max_length=63)
    model = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._/\-]{0,199}$", max_length=200)
    layout = serializers.CharField(max_length=500)
    global_batch = serializers.IntegerField(min_value=1, default=8)
    micro_batch = serializers.IntegerField(min_value=1, default=1)
    seq_len = serializers.IntegerField(min_value=1, max_value=1_048_576, default=128)


class JobViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 mixins.DestroyModelMixin, viewsets.GenericViewSet):
    queryset = Job.objects.prefetch_related("gpus")
    serializer_class = JobSerializer

    def get_serializer_class(self):
        return JobCreateSerializer if self.action == "create" else JobSerializer

    def create(self, request, *args, **kwargs):
        incoming = JobCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        job = services.job_create(**incoming.validated_data, created_by=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    def destroy(self, request, *args, **kwargs):
        services.job_delete(job_id=self.get_object().pk)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TransitionSerializer(serializers.ModelSerializer):
    job = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Transition
        fields = ["id", "job", "source_layout", "destination_layout", "state", "reason", "plan_summary",
                  "plan_fingerprint", "created_at", "started_at", "finished_at", "prepare_seconds", "pause_seconds",
                  "transfer_seconds", "verify_seconds", "network_bytes", "peak_staging_bytes", "verification"]


class TransitionViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = TransitionSerializer

    def get_queryset(self):
        queryset = Transition.objects.select_related("job")
        job = self.request.query_params.get("job")
        return queryset.filter(job__name=job) if job else queryset
