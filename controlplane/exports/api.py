"""REST: export a job's checkpoint as a Hugging Face directory (POST /api/jobs/{id}/export), a
job's exports (GET /api/jobs/{id}/exports) and every export (GET /api/exports, /api/exports/{id}).
The web process only checks and queues: the control worker writes the files (`exports` queue)."""
from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common import inputs
from controlplane.exports import services
from controlplane.exports.models import NAME_RULE, Export
from controlplane.exports.selectors import export_list
from controlplane.jobs.models import Job


class ExportSerializer(serializers.ModelSerializer):
    job = serializers.PrimaryKeyRelatedField(read_only=True, allow_null=True,
                                             help_text="the job (null once it is deleted; the directory stays)")
    path = serializers.CharField(read_only=True, help_text="the exported directory, relative to the exports root "
                                                           "(DYNAPLANE_EXPORTS_ROOT); whole once state is done")
    files_total = serializers.IntegerField(read_only=True, allow_null=True,
                                           help_text="weight files (safetensors) to write; null until planned")
    seconds = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Export
        fields = ["id", "job", "job_name", "checkpoint_step", "state", "path", "files_written", "files_total",
                  "bytes", "seconds", "error", "created_at", "started_at", "finished_at"]
        read_only_fields = fields


class ExportRequestSerializer(serializers.Serializer):
    """Input of POST /api/jobs/{id}/export."""

    checkpoint_step = serializers.IntegerField(
        min_value=0, max_value=inputs.INT32_MAX, required=False, allow_null=True, default=None,
        help_text="the step of one of the job's complete checkpoints (the last three are kept); default: the latest")
    name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="",
                                 help_text=f"the directory's name under the exports root ({NAME_RULE}); default "
                                           f"<job name>-step-<N>")


class JobExportView(APIView):
    @extend_schema(request=ExportRequestSerializer, responses={202: ExportSerializer}, operation_id="jobs_export")
    def post(self, request, job_id: int):
        """Export one of the job's complete checkpoints (default: the latest) as a Hugging Face
        directory (safetensors + config.json) under the exports root: 202 with the pending
        export; the control worker writes it and its progress arrives on /ws/jobs/{id}/ (`export`
        events) and in GET /api/exports/{id}. With the job's `init_from` the export keeps that
        directory's file split and dtypes and copies its config and tokenizer files; else bf16 and
        a config.json generated from the model. 409 when the job has no checkpoint yet or another
        export is under way; 400 naming `checkpoint_step` (no complete checkpoint of that step) or
        `name` (not a name, or taken)."""
        job = get_object_or_404(Job, pk=job_id)
        incoming = ExportRequestSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        row = services.export_request(job_id=job.pk, checkpoint_step=incoming.validated_data["checkpoint_step"],
                                      name=incoming.validated_data["name"].strip(), created_by=request.user)
        return Response(ExportSerializer(row).data, status=status.HTTP_202_ACCEPTED)


class JobExportsView(generics.ListAPIView):
    """The job's exports, newest first."""

    serializer_class = ExportSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["job_id"])
        return export_list(job_id=job.pk)


class ExportViewSet(viewsets.ReadOnlyModelViewSet):
    """Every export of a job's checkpoint, newest first (POST /api/jobs/{id}/export asks for one)."""

    serializer_class = ExportSerializer

    def get_queryset(self):
        return export_list()
