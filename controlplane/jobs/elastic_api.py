"""REST: GET /api/elastic, the elastic scheduler's current plan (read-only; elastic_state.py)."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.jobs.elastic_state import elastic_overview


class ElasticSettingsSerializer(serializers.Serializer):
    min_interval_seconds = serializers.FloatField(help_text="no job is resized twice within it (a start counts)")
    backoff_seconds = serializers.FloatField(help_text="wait after a failed resize, doubled per failure in a row")
    backoff_max_seconds = serializers.FloatField()
    grow_horizon_seconds = serializers.FloatField(help_text="a grow must pay for its pause within this much training")
    sweep_seconds = serializers.FloatField(help_text="the beat's period")
    debounce_seconds = serializers.FloatField(help_text="delay of the sweep queued after a change")


class ElasticNodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    gpus = serializers.IntegerField(help_text="GPUs not lost")
    free = serializers.IntegerField()
    joined_at = serializers.DateTimeField(allow_null=True)


class ElasticOptionSerializer(serializers.Serializer):
    gpus = serializers.IntegerField()
    layout = serializers.CharField(help_text="the resize proposals' best layout for this count")
    step_seconds = serializers.FloatField(allow_null=True, help_text="predicted; null before a measured step")


class ElasticJobSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.CharField()
    elastic = serializers.BooleanField(help_text="the policy switch: off, the scheduler never resizes the job")
    min_gpus = serializers.IntegerField(help_text="the range as the scheduler reads it (a rigid job's is its size)")
    max_gpus = serializers.IntegerField()
    priority = serializers.IntegerField()
    gpus = serializers.IntegerField(help_text="GPUs it holds now (0: a queued arrival)")
    queued = serializers.BooleanField(help_text="a pending job the scheduler starts")
    busy = serializers.BooleanField(help_text="starting, switching, restoring or stopping: left alone")
    frozen = serializers.CharField(allow_null=True, help_text="why it keeps its size whatever happens, if it does")
    step_seconds = serializers.FloatField(allow_null=True, help_text="measured: the median of its last steps")
    remaining_steps = serializers.IntegerField(allow_null=True)
    last_resize_at = serializers.DateTimeField(allow_null=True, help_text="its last start or resize")
    resize_failures = serializers.IntegerField(help_text="failed resizes in a row")
    backoff_until = serializers.DateTimeField(allow_null=True)
    options = ElasticOptionSerializer(many=True)


class ElasticDecisionSerializer(serializers.Serializer):
    job_id = serializers.IntegerField()
    job = serializers.CharField()
    kind = serializers.ChoiceField(choices=["start", "grow", "shrink"])
    gpus_from = serializers.IntegerField()
    gpus_to = serializers.IntegerField()
    layout = serializers.CharField()
    reason = serializers.CharField(help_text="what the layout history will say")
    step_seconds = serializers.FloatField(allow_null=True, help_text="predicted on the new size")
    pause_seconds = serializers.FloatField(help_text="predicted pause of the switch")
    gain_seconds = serializers.FloatField(help_text="a grow: training time it saves within the horizon")


class ElasticWaitingSerializer(serializers.Serializer):
    job_id = serializers.IntegerField()
    job = serializers.CharField()
    reason = serializers.CharField()


class ElasticOutcomeSerializer(serializers.Serializer):
    job_id = serializers.IntegerField()
    job = serializers.CharField()
    kind = serializers.CharField()
    gpus_from = serializers.IntegerField()
    gpus_to = serializers.IntegerField()
    layout = serializers.CharField()
    reason = serializers.CharField()
    outcome = serializers.ChoiceField(choices=["applied", "waits", "skipped", "refused"])
    detail = serializers.CharField(allow_blank=True)


class ElasticSweepSerializer(serializers.Serializer):
    ran_at = serializers.DateTimeField()
    outcomes = ElasticOutcomeSerializer(many=True)


class ElasticPlanSerializer(serializers.Serializer):
    """GET /api/elastic."""

    enabled = serializers.BooleanField(help_text="DYNAPLANE_ELASTIC: off, the scheduler never acts")
    problem = serializers.CharField(allow_null=True, help_text="why it cannot decide now (null: it can)")
    settings = ElasticSettingsSerializer()
    gpus = serializers.IntegerField(help_text="GPUs of healthy nodes, not lost")
    free = serializers.IntegerField()
    nodes = ElasticNodeSerializer(many=True)
    jobs = ElasticJobSerializer(many=True, help_text="the jobs it sees: live ones holding GPUs, queued pending ones")
    decisions = ElasticDecisionSerializer(many=True, help_text="the changes it would make now")
    waiting = ElasticWaitingSerializer(many=True, help_text="queued jobs it does not start now, with why")
    last_sweep = ElasticSweepSerializer(allow_null=True, help_text="what the last sweep did with each change")


class ElasticPlanView(APIView):
    @extend_schema(responses={200: ElasticPlanSerializer})
    def get(self, request):
        """The elastic scheduler's current plan: per job its range, priority, policy switch and
        whether it may be resized now; the changes it would make now (reason, predicted step
        time, pause and gain); the queued jobs left waiting and why; the last sweep's outcomes."""
        return Response(ElasticPlanSerializer(elastic_overview()).data)
