"""Event stream counters: each live event gets the next sequence number of its stream,
allocated in the same transaction as the change it reports."""
from __future__ import annotations

from django.db import models


class EventStream(models.Model):
    name = models.CharField(max_length=100, primary_key=True)
    seq = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}@{self.seq}"
