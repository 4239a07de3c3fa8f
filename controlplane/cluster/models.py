"""GPU inventory: nodes (one per agent) and their GPUs."""
from __future__ import annotations

from django.db import models

from controlplane.cluster.lifecycle import GpuState, NodeState


class Node(models.Model):
    name = models.CharField(max_length=63, unique=True)
    host = models.CharField(max_length=255)
    device = models.CharField(max_length=8, choices=[("cpu", "virtual (CPU)"), ("cuda", "CUDA")])
    state = models.CharField(max_length=16, choices=[(s.value, s.value) for s in NodeState], default=NodeState.HEALTHY)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    agent_pid = models.PositiveIntegerField(null=True, blank=True)
    agent_started_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    joined_at = models.DateTimeField(null=True, blank=True,
                                     help_text="when it last became healthy: registered, or back after being lost")
    # Capacity as last reported.
    gpu_count = models.PositiveIntegerField(default=0)
    gpu_memory_bytes = models.BigIntegerField(default=0, help_text="sum over the node's GPUs")
    # What the node runs, as its last heartbeat said (the observed state).
    running_jobs = models.JSONField(default=dict, blank=True,
                                    help_text="job id -> the ranks whose processes are alive on the node")
    running_emulations = models.JSONField(default=list, blank=True, help_text="emulation run ids the agent works on")
    # The host as shown (cluster/host_stats.py: changed with an event, not every beat); null: never reported.
    cpu_percent = models.FloatField(null=True, blank=True, help_text="CPU utilisation of all cores, 0-100")
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True, help_text="host memory in use (total - available)")
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    host_stats_at = models.DateTimeField(null=True, blank=True, help_text="when the shown host stats were reported")
    key_id = models.CharField(max_length=16, blank=True,
                              help_text="the agent key its heartbeats are sealed with: its orders are sealed with it")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=128, blank=True)
    model_name = models.CharField(max_length=128)
    memory_bytes = models.BigIntegerField()
    state = models.CharField(max_length=16, choices=[(s.value, s.value) for s in GpuState], default=GpuState.FREE)
    job = models.ForeignKey("jobs.Job", on_delete=models.SET_NULL, null=True, blank=True, related_name="gpus")

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="unique_gpu_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}/{self.index}"


class AgentToken(models.Model):
    """One agent's credential (issue 44): its token is shown once when issued; the control plane
    keeps only the key derived from it (agents/seal.py), which checks the seals on what the agent
    says and seals the orders it is given. Revoked: its messages are refused from then on."""

    key_id = models.CharField(max_length=16, unique=True, help_text="public part of the token (in every seal)")
    node = models.CharField(max_length=63, db_index=True, help_text="the node this token speaks for")
    secret = models.CharField(max_length=64, help_text="the HMAC key derived from the token, hex")
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=150, blank=True, help_text="who issued it (user or command)")
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_joined_at = models.DateTimeField(null=True, blank=True, help_text="when an agent last joined with it")

    class Meta:
        ordering = ["node", "-created_at"]

    def __str__(self) -> str:
        return f"{self.node}/{self.key_id}{' (revoked)' if self.revoked_at else ''}"
