"""REST: datasets (list, register, read, delete). The API never uploads data: `dynaplane data
prepare --out <data root>/<name>` writes a dataset directory, and POST /api/datasets registers it."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from controlplane.datasets import services
from controlplane.datasets.models import MAX_PATH, NAME_RULE, Dataset
from controlplane.datasets.selectors import dataset_list


class JobRefSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()


class BlendPartSerializer(serializers.Serializer):
    name = serializers.CharField()
    weight = serializers.FloatField()
    tokens = serializers.IntegerField()


class DatasetSerializer(serializers.ModelSerializer):
    parts = BlendPartSerializer(many=True, read_only=True, help_text="a blend's parts (empty for other formats)")
    jobs = serializers.SerializerMethodField(help_text="the jobs that name it, by name (while any does, it cannot "
                                                       "be deleted)")

    @extend_schema_field(JobRefSerializer(many=True))
    def get_jobs(self, dataset: Dataset) -> list[dict]:
        return sorted(({"id": job.pk, "name": job.name} for job in dataset.jobs.all()), key=lambda j: j["name"])

    class Meta:
        model = Dataset
        fields = ["id", "name", "path", "format", "vocab_size", "eos_token", "tokenizer", "tokenizer_fingerprint",
                  "fingerprint", "documents", "tokens", "train_tokens", "validation_tokens", "validation_documents",
                  "validation_fraction", "parts", "jobs", "created_at"]
        read_only_fields = fields


class DatasetRegisterSerializer(serializers.Serializer):
    """Input of POST /api/datasets: a dataset directory already under the data root."""

    path = serializers.CharField(max_length=MAX_PATH, trim_whitespace=False,
                                 help_text="the dataset directory (holding dataset.json), relative to the data root "
                                           "(DYNAPLANE_DATA_ROOT) or absolute inside it; e.g. python-stdlib")
    name = serializers.CharField(max_length=63, required=False, allow_blank=True, default="",
                                 help_text=f"the dataset's name ({NAME_RULE}); default: the manifest's name, else "
                                           f"the directory's")


class DatasetViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Registered datasets, by name; a job names one in its `dataset` (docs/datasets.md)."""

    serializer_class = DatasetSerializer

    def get_queryset(self):
        return dataset_list().prefetch_related("jobs")

    @extend_schema(request=DatasetRegisterSerializer, responses={201: DatasetSerializer})
    def create(self, request, *args, **kwargs):
        """Register a dataset directory under the data root: its manifest and index are read and
        checked (the tokens are not scanned) and what they hold is stored. 400 naming `path`
        (outside the data root, no directory, no or a broken dataset.json, a truncated .bin, a
        corrupt .idx: the dataset library's words, paths relative to the data root) or `name`
        (not a name, or taken)."""
        incoming = DatasetRegisterSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        dataset = services.dataset_register(**incoming.validated_data, created_by=request.user)
        return Response(DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)

    def destroy(self, request, *args, **kwargs):
        """Forget a dataset (its directory stays); 409 while a job names it."""
        services.dataset_delete(dataset_id=self.get_object().pk)
        return Response(status=status.HTTP_204_NO_CONTENT)
