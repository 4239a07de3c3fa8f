"""REST: jobs (create and schedule, start, stop, resize, live state, list, read, delete)
and transitions, the layout history (read)."""
from __future__ import annotations

from django.db.models import Q
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from agents.protocol import LOG_TAIL_LINES
from controlplane.cluster.models import Gpu
from controlplane.common import inputs
from controlplane.jobs import elastic_settings, resize, resize_preview, scheduling, services
from controlplane.jobs.models import Job, Preflight, Transition
from controlplane.jobs.selectors import job_data_progress, job_live_snapshot, job_log_view


class RankPlacementSerializer(serializers.Serializer):
    rank = serializers.IntegerField(min_value=0)
    node = serializers.CharField()
    gpu = serializers.IntegerField(min_value=0, help_text="device index on the node")


class DatasetRefSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="GET /api/datasets/{id}")
    name = serializers.CharField()


class DataProgressSerializer(serializers.Serializer):
    """How far the job has read its data: the trainer's one data scalar is the samples consumed
    (step x global batch, in every layout)."""

    samples = serializers.IntegerField(help_text="samples consumed: step x global_batch")
    tokens = serializers.IntegerField(help_text="tokens consumed: samples x seq_len")
    epoch = serializers.FloatField(allow_null=True, help_text="samples / samples_per_epoch (null: synthetic data)")
    samples_per_epoch = serializers.IntegerField(allow_null=True, help_text="of the dataset's train split at the "
                                                                            "job's seq_len (null: synthetic data)")


class JobListSerializer(serializers.ListSerializer):
    """Jobs in a list: their GPUs' ids read for all of them in one query (prefetching the GPU
    rows built 1,600 objects and 200 querysets for 200 jobs: benchmarks/cluster_scale.py)."""

    def to_representation(self, data):
        jobs = list(data.all() if hasattr(data, "all") else data)
        gpu_ids: dict[int, list[int]] = {job.pk: [] for job in jobs}
        for job_id, gpu_id in Gpu.objects.filter(job_id__in=list(gpu_ids)).order_by(
                *Gpu._meta.ordering).values_list("job_id", "id"):
            gpu_ids[job_id].append(gpu_id)
        self.context["gpu_ids"] = gpu_ids
        return super().to_representation(jobs)


class JobSerializer(serializers.ModelSerializer):
    gpus = serializers.SerializerMethodField(help_text="ids of the GPUs the job holds (by node name, index)")
    placement = RankPlacementSerializer(many=True, read_only=True)
    dataset = DatasetRefSerializer(read_only=True, allow_null=True,
                                   help_text="what the job trains on; null: synthetic tokens")
    data_progress = serializers.SerializerMethodField()

    @extend_schema_field(DataProgressSerializer)
    def get_data_progress(self, job: Job) -> dict:
        return job_data_progress(job)

    @extend_schema_field(serializers.ListField(child=serializers.IntegerField()))
    def get_gpus(self, job: Job) -> list[int]:
        listed = self.context.get("gpu_ids")
        if listed is not None and job.pk in listed:
            return listed[job.pk]
        return list(job.gpus.order_by(*Gpu._meta.ordering).values_list("id", flat=True))

    class Meta:
        model = Job
        list_serializer_class = JobListSerializer
        fields = ["id", "name", "model", "layout", "world_size", "state", "global_batch", "micro_batch", "seq_len",
                  "max_steps", "error", "gpus", "placement", "rendezvous", "created_at", "updated_at",
                  "step", "checkpoint_interval", "checkpoint_dir", "checkpoint_step", "checkpoint_path",
                  "checkpoint_seconds", "checkpoint_at", "elastic", "min_gpus", "max_gpus", "priority", "queued",
                  "started_at", "resize_failures", "resize_failed_at", "dataset", "data_progress", "eval_every",
                  "eval_batches", "init_from"]
        read_only_fields = ["world_size", "state", "error", "gpus", "placement", "rendezvous", "created_at",
                            "updated_at", "step", "checkpoint_step", "checkpoint_path", "checkpoint_seconds",
                            "checkpoint_at", "queued", "started_at", "resize_failures", "resize_failed_at"]


class PreflightCheckSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="storage, data, port, rendezvous, all-reduce or shared storage")
    ok = serializers.BooleanField()
    detail = serializers.CharField()


class PreflightNodeSerializer(serializers.Serializer):
    node = serializers.CharField()
    host = serializers.CharField(help_text="the address the node's agent advertises")
    checks = PreflightCheckSerializer(many=True, allow_null=True,
                                      help_text="in the order they ran; null: no report (yet)")
    seconds = serializers.FloatField(allow_null=True)


class PreflightSerializer(serializers.ModelSerializer):
    """A pre-flight before a start or a grow across hosts (docs/hosts.md, "Pre-flight")."""

    nodes = serializers.SerializerMethodField()

    @extend_schema_field(PreflightNodeSerializer(many=True))
    def get_nodes(self, row: Preflight) -> list[dict]:
        return [{"node": entry["node"], "host": entry.get("host", ""),
                 "checks": (row.results.get(entry["node"]) or {}).get("checks"),
                 "seconds": (row.results.get(entry["node"]) or {}).get("seconds")} for entry in row.nodes]

    class Meta:
        model = Preflight
        fields = ["id", "transition", "state", "error", "rendezvous", "nodes", "created_at", "finished_at"]


class JobCreateSerializer(serializers.Serializer):
    """Input of POST /api/jobs; field rules here, layout rules in the service."""

    name = serializers.SlugField(max_length=63)
    model = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,99}$", max_length=100, required=False,
                                   allow_null=True,
                                   help_text="a catalog name (`dynaplane models`) or a stored model "
                                             "config (models/<name>/config.json under the var dir); never a path. "
                                             "Omitted (or null) with `init_from`: the model its config.json describes")
    layout = serializers.CharField(max_length=500, required=False,
                                   help_text="the layout (docs/contracts.md section 1); or give `gpus`")
    gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False,
                                    help_text="GPUs to use; the control plane picks the layout (docs/elastic.md)")
    global_batch = serializers.IntegerField(min_value=1, max_value=inputs.INT32_MAX, default=8)
    micro_batch = serializers.IntegerField(min_value=1, max_value=inputs.INT32_MAX, default=1)
    seq_len = serializers.IntegerField(min_value=1, max_value=inputs.MAX_SEQ_LEN, default=128)
    max_steps = serializers.IntegerField(min_value=1, max_value=inputs.INT32_MAX, required=False, allow_null=True,
                                         default=None, help_text="stop after this many steps; omitted: train until "
                                                                 "stopped")
    start = serializers.BooleanField(default=True, help_text="schedule onto free GPUs now (else it stays pending)")
    queue = serializers.BooleanField(
        default=False, help_text="leave it pending and let the elastic scheduler start it as soon as its priority "
                                 "lets it: at once when its GPUs are free, else once elastic jobs of lower priority "
                                 "have shrunk for it or other jobs have ended (docs/elastic.md, part 3)")
    checkpoint_interval = serializers.IntegerField(min_value=0, max_value=inputs.INT32_MAX, required=False,
                                                   help_text="steps between periodic checkpoints (default 100; 0: off)")
    checkpoint_dir = serializers.CharField(max_length=1000, required=False, default="",
                                           help_text="a folder under the checkpoint root (DYNAPLANE_CHECKPOINT_ROOT, "
                                                     "shared storage every node sees): relative to it, or absolute "
                                                     "inside it; default <root>/<name>-<id>")
    resume_from = serializers.CharField(max_length=1000, required=False, default="",
                                        help_text="a complete checkpoint folder under the checkpoint root the job "
                                                  "starts from instead of a fresh model, in its own layout (DCP "
                                                  "reshards)")

    elastic = serializers.BooleanField(default=False, help_text="let the elastic scheduler resize the job within "
                                                               "[min_gpus, max_gpus] (docs/elastic.md)")
    min_gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False, allow_null=True,
                                        default=None, help_text="the fewest GPUs (default: the job's GPU count); "
                                                                "at most its GPU count")
    max_gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False, allow_null=True,
                                        default=None, help_text="the most GPUs (default: the job's GPU count); "
                                                                "at least its GPU count and min_gpus, at most the "
                                                                "cluster's GPUs")
    priority = serializers.IntegerField(min_value=-inputs.INT32_MAX, max_value=inputs.INT32_MAX, default=0,
                                        help_text="a higher priority gets GPUs first, from elastic jobs of lower ones")
    dataset = serializers.CharField(max_length=63, required=False, allow_null=True, allow_blank=True, default=None,
                                    help_text="a registered dataset (GET /api/datasets) by its name or id; its vocab "
                                              "must fit the model's and it must hold a sample of seq_len + 1 tokens; "
                                              "omitted, null or empty: synthetic tokens")
    eval_every = serializers.IntegerField(
        min_value=0, max_value=inputs.INT32_MAX, default=0,
        help_text="the validation loss over eval_batches global batches of the dataset's validation split after "
                  "every eval_every steps (0: never); needs a dataset with a validation split that holds them")
    eval_batches = serializers.IntegerField(min_value=1, max_value=1000, default=4,
                                            help_text="global batches each evaluation reads (the same ones every "
                                                      "time, so the curve is comparable across steps and layouts)")
    init_from = serializers.CharField(
        max_length=1000, required=False, allow_null=True, allow_blank=True, default=None,
        help_text="a Hugging Face model directory (config.json + safetensors) under the weights root "
                  "(DYNAPLANE_WEIGHTS_ROOT), relative to it: the job's first start loads its weights, each rank "
                  "its own part; with `model` it must hold that model, without one the job trains the model its "
                  "config.json describes")

    def validate(self, attrs: dict) -> dict:
        if ("layout" in attrs) == ("gpus" in attrs):
            raise serializers.ValidationError({"layout": ["give either `layout` or `gpus`, not both or neither"]})
        if attrs.get("queue") and self.initial_data.get("start") is False:
            raise serializers.ValidationError({"queue": ["a queued job is started by the elastic scheduler; "
                                                         "start=false keeps a job pending until POST start: "
                                                         "give one of them"]})
        return attrs


class JobElasticSerializer(serializers.Serializer):
    """Input of PATCH /api/jobs/{id}/elastic: any of the job's elastic settings."""

    elastic = serializers.BooleanField(required=False, help_text="the policy switch: on, the elastic scheduler may "
                                                                 "resize the job; off, it never does")
    min_gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False, allow_null=True,
                                        help_text="the fewest GPUs (null: the job's world_size); at most world_size")
    max_gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False, allow_null=True,
                                        help_text="the most GPUs (null: the job's world_size); at least world_size "
                                                  "and min_gpus, at most the cluster's GPUs")
    priority = serializers.IntegerField(min_value=-inputs.INT32_MAX, max_value=inputs.INT32_MAX, required=False)

    def validate(self, attrs: dict) -> dict:
        if not attrs:
            raise serializers.ValidationError({"elastic": ["give at least one of elastic, min_gpus, max_gpus, "
                                                           "priority"]})
        return attrs


class JobCheckSerializer(serializers.Serializer):
    """POST /api/jobs/validate: what POST /api/jobs would create from the same body."""

    name = serializers.CharField()
    model = serializers.CharField(help_text="the model it would train (with `init_from` and no `model`: the stored "
                                            "model its config.json becomes)")
    layout = serializers.CharField(help_text="the layout the job would run (picked from `gpus` when given)")
    world_size = serializers.IntegerField(help_text="GPUs the layout spans")
    global_batch = serializers.IntegerField()
    micro_batch = serializers.IntegerField()
    seq_len = serializers.IntegerField()
    max_steps = serializers.IntegerField(allow_null=True)
    checkpoint_interval = serializers.IntegerField()
    elastic = serializers.BooleanField()
    min_gpus = serializers.IntegerField(allow_null=True)
    max_gpus = serializers.IntegerField(allow_null=True)
    priority = serializers.IntegerField()
    dataset = serializers.CharField(source="dataset.name", read_only=True, allow_null=True,
                                    help_text="the dataset it would train on (null: synthetic tokens)")
    samples_per_epoch = serializers.IntegerField(source="dataset_samples_per_epoch", allow_null=True,
                                                 help_text="samples of seq_len + 1 tokens per epoch of the dataset's "
                                                           "train split (null: synthetic tokens)")
    eval_every = serializers.IntegerField()
    eval_batches = serializers.IntegerField()
    validation_samples = serializers.IntegerField(allow_null=True, help_text="samples of seq_len + 1 tokens in the "
                                                                             "dataset's validation split (null: "
                                                                             "eval_every is 0)")
    init_from = serializers.CharField(allow_blank=True, help_text="the model directory, relative to the weights root "
                                                                  "(empty: the seeded initialisation)")


class JobResizeSerializer(serializers.Serializer):
    """Input of POST /api/jobs/{id}/resize: exactly one of `gpus` and `layout`."""

    gpus = serializers.IntegerField(min_value=1, max_value=inputs.MAX_GPUS, required=False,
                                    help_text="GPUs to use; the control plane picks the layout (docs/elastic.md)")
    layout = serializers.CharField(max_length=500, required=False, help_text="the layout to switch to")

    def validate(self, attrs: dict) -> dict:
        if ("layout" in attrs) == ("gpus" in attrs):
            raise serializers.ValidationError({"layout": ["give either `layout` or `gpus`, not both or neither"]})
        return attrs


class TransitionSerializer(serializers.ModelSerializer):
    job = serializers.SlugRelatedField(slug_field="name", read_only=True)
    job_id = serializers.IntegerField(read_only=True)
    source_placement = RankPlacementSerializer(many=True, read_only=True)
    destination_placement = RankPlacementSerializer(many=True, read_only=True)
    process_of = serializers.ListField(
        child=serializers.IntegerField(min_value=0), read_only=True, allow_null=True,
        help_text="the device map: the union-world process of each destination rank (process p below "
                  "source_world ran source rank p); null: destination rank d on process d")

    class Meta:
        model = Transition
        fields = ["id", "job", "job_id", "kind", "source_layout", "destination_layout", "source_world",
                  "destination_world", "state", "reason", "plan_summary", "plan_fingerprint", "source_placement", "destination_placement",
                  "process_of", "rendezvous", "gpus_per_node", "staging_bytes", "created_at", "started_at", "finished_at", "step",
                  "prepare_seconds", "pause_seconds", "transfer_seconds", "verify_seconds", "network_bytes", "rounds",
                  "peak_bytes", "predicted_peak_bytes", "peak_staging_bytes", "verification", "history"]


class JobLiveSerializer(serializers.Serializer):
    """GET /api/jobs/{id}/live: the job's training metrics and transitions at `seq` of
    /ws/jobs/{id}/."""

    seq = serializers.IntegerField()
    metrics = serializers.DictField(help_text="name -> {x: steps, y: values}")
    transitions = serializers.ListField(child=serializers.DictField(), required=False,
                                        help_text="the job's transitions, oldest first (as in `transition` events)")


class JobLogSerializer(serializers.Serializer):
    """GET /api/jobs/{id}/log: rank 0's recent log lines (also the `log` event of
    /ws/jobs/{id}/). Bounded: at most LOG_TAIL_LINES lines of LOG_LINE_CHARS characters,
    LOG_TAIL_BYTES in all; the node's folders appear as <run>, <src>, <python>, ~."""

    job = serializers.IntegerField()
    node = serializers.CharField(allow_null=True, help_text="the node rank 0 ran on; null: no lines yet")
    rank = serializers.IntegerField()
    lines = serializers.ListField(child=serializers.CharField(), help_text="oldest first")
    truncated = serializers.BooleanField(help_text="earlier lines of the log are not shown")
    finished = serializers.BooleanField(help_text="rank 0 had exited: these are its last lines")
    sent_at = serializers.DateTimeField(allow_null=True, help_text="when the agent read them")


class ProposalEmulationSerializer(serializers.Serializer):
    run = serializers.IntegerField(help_text="the emulation run (GET /api/emulations/{id})")
    gpu_type = serializers.CharField()
    step_seconds = serializers.FloatField()
    tokens_per_second = serializers.FloatField(allow_null=True)
    peak_bytes = serializers.IntegerField(help_text="emulated peak per GPU, activations included")
    fits = serializers.BooleanField(help_text="peak_bytes <= the smallest GPU's memory")


class ProposalSerializer(serializers.Serializer):
    layout = serializers.CharField()
    world = serializers.IntegerField()
    tp = serializers.IntegerField()
    pp = serializers.IntegerField()
    dp = serializers.IntegerField()
    state_bytes_per_gpu = serializers.IntegerField(help_text="model state per GPU (params + optimizer), no activations")
    fits = serializers.BooleanField(help_text="state_bytes_per_gpu <= the smallest GPU's memory")
    step_seconds = serializers.FloatField(allow_null=True, help_text="the measured step scaled to this layout "
                                                                     "(proposals.py); null before a measured step")
    tokens_per_second = serializers.FloatField(allow_null=True)
    emulated = ProposalEmulationSerializer(allow_null=True, help_text="the newest finished emulation of this layout "
                                                                      "and the job's setting; null: none")
    predicted_step_seconds = serializers.FloatField(allow_null=True, help_text="the one prediction the page shows: "
                                                                               "step_seconds, else the emulated one")
    predicted_from = serializers.ChoiceField(choices=["measured", "emulated"], allow_null=True)
    measured_over_emulated = serializers.FloatField(allow_null=True, help_text="step_seconds / emulated step_seconds")


class ProposalsSerializer(serializers.Serializer):
    """GET /api/jobs/{id}/proposals?gpus=N: the layouts for N GPUs, best first."""

    job = serializers.IntegerField()
    gpus = serializers.IntegerField()
    current_layout = serializers.CharField()
    current_world = serializers.IntegerField()
    measured_step_seconds = serializers.FloatField(allow_null=True, help_text="median of the last `recent_steps` "
                                                                              "steps on the current layout")
    recent_steps = serializers.IntegerField()
    capacity_bytes = serializers.IntegerField(allow_null=True)
    default_layout = serializers.CharField(help_text="what POST resize {gpus: N} would pick")
    predictor = serializers.CharField(help_text="'rule': ranked by `ranking`, no emulator prediction")
    ranking = serializers.CharField()
    proposals = ProposalSerializer(many=True)


class PlanPreviewSerializer(serializers.Serializer):
    """GET /api/jobs/{id}/plan?layout=L: the routing plan of the switch to L."""

    model = serializers.CharField()
    source_layout = serializers.CharField()
    destination_layout = serializers.CharField()
    world = serializers.IntegerField(help_text="ranks of the union world")
    summary = serializers.DictField(help_text="`dynaplane plan --json` (docs/contracts.md section 3)")
    matrix = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()), allow_null=True,
                                   help_text="bytes from source rank (row) to destination rank (column)")
    round_bytes = serializers.ListField(child=serializers.IntegerField(), help_text="bytes sent per round")
    round_seconds = serializers.ListField(child=serializers.FloatField(), help_text="estimated seconds per round")
    wave_after = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()),
                                       help_text="predicted state bytes per rank before round 0 and after each round")
    wave_peak = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()),
                                      help_text="predicted peak bytes per rank within each round")
    estimated_seconds = serializers.FloatField()
    staging_bytes = serializers.IntegerField()


class JobViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 mixins.DestroyModelMixin, viewsets.GenericViewSet):
    queryset = Job.objects.select_related("dataset")
    serializer_class = JobSerializer

    def get_serializer_class(self):
        return JobCreateSerializer if self.action == "create" else JobSerializer

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request, *args, **kwargs):
        """Create a job; unless `start` is false, allocate GPUs and send the nodes their
        start orders (409 when the free GPUs cannot hold the layout). With `queue` it is
        created pending and the elastic scheduler starts it (GET /api/elastic says why it waits)."""
        incoming = JobCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        job = scheduling.job_submit(**incoming.validated_data, created_by=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=JobCreateSerializer, responses={200: JobCheckSerializer})
    @action(detail=False, methods=["post"])
    def validate(self, request):
        """Check a POST /api/jobs body against every rule job creation applies, and create
        nothing: 200 with the job it would make (its layout and GPU count), or the same 400
        body (field -> messages) POST /api/jobs would answer. Whether free GPUs can hold it
        now is not checked (that is the start's 409)."""
        incoming = JobCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        fields = {k: v for k, v in incoming.validated_data.items() if k not in ("start", "queue")}
        return Response(JobCheckSerializer(services.job_check(**fields)).data)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        """Schedule a pending job: pending -> starting (409 unless pending or without GPUs)."""
        job = scheduling.job_start(job_id=self.get_object().pk)
        return Response(JobSerializer(job).data)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Stop a job: pending -> stopped at once; live -> stopping until its ranks report
        (409 when already stopped or failed)."""
        job = scheduling.job_stop(job_id=self.get_object().pk)
        return Response(JobSerializer(job).data)

    @extend_schema(request=JobResizeSerializer, responses={202: TransitionSerializer})
    @action(detail=True, methods=["post"])
    def resize(self, request, pk=None):
        """Switch a running job online to another layout (`layout`) or GPU count (`gpus`):
        202 with the planned transition; its progress arrives on /ws/jobs/{id}/ and in
        GET /api/transitions?job={id}. 409 unless running without an active transition, or
        when the joining ranks' GPUs are not free; 400 for a layout the model or batch rejects."""
        incoming = JobResizeSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        transition = resize.job_resize(job_id=self.get_object().pk, requested_by=request.user,
                                       **incoming.validated_data)
        return Response(TransitionSerializer(transition).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=JobElasticSerializer, responses={200: JobSerializer})
    @action(detail=True, methods=["patch"])
    def elastic(self, request, pk=None):
        """Change the job's elastic settings: the policy switch, its GPU range and priority (any
        state). 400 naming the field when the range would not hold the GPUs the job runs on
        (world_size), min_gpus > max_gpus, or max_gpus exceeds the cluster's GPUs."""
        incoming = JobElasticSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        job = elastic_settings.job_elastic_set(job_id=self.get_object().pk, **incoming.validated_data)
        return Response(JobSerializer(job).data)

    @extend_schema(responses={200: JobLiveSerializer})
    @action(detail=True, methods=["get"])
    def live(self, request, pk=None):
        """The job's training metrics, consistent with `seq` of /ws/jobs/{id}/."""
        return Response(job_live_snapshot(job_id=self.get_object().pk).model_dump(mode="json"))

    @extend_schema(responses={200: PreflightSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def preflights(self, request, pk=None):
        """The job's pre-flights before its starts and grows across hosts, newest first (at most
        20): each node's checks, and what failed by host and check."""
        rows = Preflight.objects.filter(job=self.get_object()).order_by("-created_at", "-id")[:20]
        return Response(PreflightSerializer(rows, many=True).data)

    @extend_schema(parameters=[OpenApiParameter("lines", int, description=f"only the last N lines (1 to "
                                                                          f"{LOG_TAIL_LINES}; default all)")],
                   responses={200: JobLogSerializer})
    @action(detail=True, methods=["get"])
    def log(self, request, pk=None):
        """Rank 0's recent log lines (stdout and stderr, its errors included), as its agent last
        sent them: at most LOG_TAIL_LINES lines. No lines before the job's first start."""
        job = self.get_object()
        text = request.query_params.get("lines")
        lines = None
        if text is not None:
            lines = inputs.whole_number(text, LOG_TAIL_LINES)
            if not lines:
                raise serializers.ValidationError({"lines": [f"lines must be an integer from 1 to {LOG_TAIL_LINES}, "
                                                             f"got {text[:40]!r}"]})
        return Response(job_log_view(job_id=job.pk, lines=lines).model_dump(mode="json"))

    @extend_schema(parameters=[OpenApiParameter("gpus", int, required=True, description="the new GPU count")],
                   responses={200: ProposalsSerializer})
    @action(detail=True, methods=["get"])
    def proposals(self, request, pk=None):
        """The feasible layouts for `gpus` GPUs, ranked (read-only; docs/elastic.md)."""
        text = request.query_params.get("gpus", "")
        gpus = inputs.whole_number(text, inputs.MAX_PLAN_WORLD)
        if not gpus:
            raise serializers.ValidationError({"gpus": [f"gpus must be an integer from 1 to {inputs.MAX_PLAN_WORLD}, "
                                                        f"got {text[:40]!r}"]})
        return Response(resize_preview.job_proposals(job=self.get_object(), gpus=gpus))

    @extend_schema(parameters=[OpenApiParameter("layout", str, required=True, description="the destination layout")],
                   responses={200: PlanPreviewSerializer})
    @action(detail=True, methods=["get"])
    def plan(self, request, pk=None):
        """The routing plan from the job's layout to `layout` (read-only; nothing is allocated)."""
        layout = request.query_params.get("layout", "").strip()
        if not layout:
            raise serializers.ValidationError({"layout": ["give the destination layout, e.g. ?layout=dp=4"]})
        return Response(resize_preview.job_plan(job=self.get_object(), layout=layout))

    def destroy(self, request, *args, **kwargs):
        services.job_delete(job_id=self.get_object().pk)
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("job", str, description="only this job's transitions: its id or name")]))
class TransitionViewSet(viewsets.ReadOnlyModelViewSet):
    """The layout history: every transition, newest first."""

    serializer_class = TransitionSerializer

    def get_queryset(self):
        queryset = Transition.objects.select_related("job")
        job = self.request.query_params.get("job")
        if not job:
            return queryset
        where = Q(job__name=job)
        if (job_id := inputs.whole_number(job)) is not None:
            where |= Q(job_id=job_id)
        return queryset.filter(where)

    @extend_schema(responses={200: PlanPreviewSerializer})
    @action(detail=True, methods=["get"])
    def plan(self, request, pk=None):
        """The routing plan this transition ran, recomputed from its recorded inputs."""
        return Response(resize_preview.transition_plan(transition=self.get_object()))
