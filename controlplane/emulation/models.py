"""Emulation runs: one predicted configuration (model, layout, scale) and its result."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class EmulationRun(models.Model):
    """One emulation (kind "emulate": the layout's predicted step, result = `dynaplane
    emulate --json`) or one search (kind "search": the layouts worth emulating for the
    setting, result = {top, candidates, layouts, dropped}; layout is empty)."""

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    class Kind(models.TextChoices):
        EMULATE = "emulate"
        SEARCH = "search"

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.EMULATE)
    top = models.PositiveIntegerField(null=True, blank=True, help_text="search: how many layouts the page keeps")

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
    updated_at = models.DateTimeField(auto_now=True, help_text="the last change: a progress report, the end")
    finished_at = models.DateTimeField(null=True, blank=True)
    wall_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.model} [{self.layout}] x{self.gpus} {self.gpu_type} ({self.state})"
