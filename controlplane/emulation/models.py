"""Emulation runs: one predicted configuration (model, layout, scale) and its result."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class EmulationRun(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    model = models.CharField(max_length=200)
    layout = models.CharField(max_length=500)
    gpus = models.PositiveIntegerField()
    gpu_type = models.CharField(max_length=16, default="h100")
    global_batch = models.PositiveIntegerField()
    micro_batch = models.PositiveIntegerField(default=1)
    seq_len = models.PositiveIntegerField()
    recompute = models.CharField(max_length=16, default="none")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    result = models.JSONField(default=dict, blank=True, help_text="the `dynaplane emulate --json` object")
    error = models.TextField(blank=True)
    message = models.CharField(max_length=500, blank=True, help_text="the latest progress line")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    wall_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.model} [{self.layout}] x{self.gpus} {self.gpu_type} ({self.state})"
