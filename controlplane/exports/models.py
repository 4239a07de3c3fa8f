"""Exports of a job's checkpoints as Hugging Face directories (docs/hf-weights.md, "In jobs"):
one row per request, written by the control worker's export task (the `exports` queue) under the
exports root (settings.DYNAPLANE_EXPORTS_ROOT)."""
from __future__ import annotations

import os
import re

from django.conf import settings
from django.db import models

# An export's directory name under the exports root: as a dataset's name (letters, digits, '.', '_'
# and '-', starting with a letter or digit), at most 100 characters.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 100 characters"
MAX_PATH = 1000


class Export(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"  # queued on the `exports` queue
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    job = models.ForeignKey("jobs.Job", on_delete=models.SET_NULL, null=True, blank=True, related_name="exports",
                            help_text="null once the job is deleted (the exported directory stays)")
    job_name = models.CharField(max_length=63)
    checkpoint_step = models.PositiveIntegerField(help_text="the step of the checkpoint exported")
    checkpoint_path = models.CharField(max_length=1000, help_text="the checkpoint folder (under the checkpoint root)")
    model = models.CharField(max_length=200, help_text="the job's model (a catalog name or a stored model)")
    source = models.CharField(max_length=1000, blank=True,
                              help_text="the job's init_from (relative to the weights root): the export keeps its "
                                        "file split, names and dtypes and copies its config and tokenizer files")
    path = models.CharField(max_length=MAX_PATH, help_text="the exported directory, relative to the exports root")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    files_written = models.PositiveIntegerField(default=0, help_text="weight files written")
    files_total = models.PositiveIntegerField(null=True, blank=True, help_text="weight files to write (once planned)")
    bytes = models.PositiveBigIntegerField(default=0, help_text="bytes of the weight files written")
    seconds = models.FloatField(null=True, blank=True, help_text="how long the export ran")
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, help_text="the last change: a file written, the end")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # Two exports that are not failed never write the same directory.
            models.UniqueConstraint(fields=["path"], name="unique_export_path",
                                    condition=~models.Q(state="failed")),
        ]

    def __str__(self) -> str:
        return f"{self.job_name} step {self.checkpoint_step} -> {self.path} ({self.state})"

    @property
    def directory(self) -> str:
        """The absolute path of the exported directory."""
        return os.path.join(settings.DYNAPLANE_EXPORTS_ROOT, self.path)
