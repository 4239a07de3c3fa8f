"""Registered datasets: a dataset directory (parallelism/datasets/manifest.py, `dynaplane data
prepare` writes one) under the data root (settings.DYNAPLANE_DATA_ROOT, shared storage every node
mounts at the same path), with what the dataset library's describe() found in it when it was
registered. Jobs name one (jobs.Job.dataset); the ranks read it from `directory`."""
from __future__ import annotations

import os
import re

from django.conf import settings
from django.db import models

# Letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63 characters, and
# not digits alone (a job's `dataset` is a name or an id: a name never reads as an id).
NAME_RE = re.compile(r"^(?![0-9]+$)[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NAME_RULE = ("letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63 characters, "
             "not digits alone")
MAX_PATH = 1000


class Dataset(models.Model):
    name = models.CharField(max_length=63, unique=True, help_text=f"what a job's `dataset` names: {NAME_RULE}")
    path = models.CharField(max_length=MAX_PATH, unique=True,
                            help_text="the dataset directory, relative to the data root (DYNAPLANE_DATA_ROOT)")
    format = models.CharField(max_length=16, help_text="megatron (.bin + .idx), tokens (a raw token file) or blend")
    vocab_size = models.PositiveIntegerField(help_text="token ids run below it; a job's model must have as many rows")
    eos_token = models.PositiveIntegerField(null=True, blank=True, help_text="the token ending each document")
    tokenizer = models.CharField(max_length=32, help_text="its tokenizer's kind: bytes, hf, ...")
    tokenizer_fingerprint = models.CharField(max_length=100, blank=True)
    fingerprint = models.CharField(max_length=100, help_text="of the data files: the sample order is keyed by it")
    documents = models.PositiveBigIntegerField()
    tokens = models.PositiveBigIntegerField()
    train_tokens = models.PositiveBigIntegerField()
    validation_tokens = models.PositiveBigIntegerField()
    validation_documents = models.PositiveBigIntegerField(default=0)
    validation_fraction = models.FloatField(help_text="share of the documents held out for validation")
    parts = models.JSONField(default=list, blank=True, help_text="a blend's parts: [{name, weight, tokens}]")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.path})"

    @property
    def directory(self) -> str:
        """The absolute path every rank reads the dataset from."""
        return os.path.join(settings.DYNAPLANE_DATA_ROOT, self.path)
