"""Reads of emulation runs: the snapshot a compare page embeds and reloads."""
from __future__ import annotations

from collections.abc import Sequence

from django.db import transaction

from controlplane.common.events import current_seq
from controlplane.emulation.events import STREAM, EmulationSnapshot
from controlplane.emulation.models import EmulationRun


def emulation_snapshot(ids: Sequence[int]) -> EmulationSnapshot:
    """The emulations `ids` (in that order; unknown ids and searches left out) with the stream's seq, read
    first: an event racing the read is at worst applied twice (it carries the whole run)."""
    from controlplane.emulation.services import emulation_view

    ids = tuple(dict.fromkeys(int(i) for i in ids))
    with transaction.atomic():
        seq = current_seq(STREAM)
        found = {run.pk: run for run in EmulationRun.objects.filter(pk__in=ids, kind=EmulationRun.Kind.EMULATE)}
    return EmulationSnapshot(seq=seq, ids=ids, runs=tuple(emulation_view(found[i]) for i in ids if i in found))


def emulation_rows(ids: Sequence[int]) -> list[dict]:
    """The runs `ids` as plain dicts with every setting and the full result (for figures
    and CSV), in the order given; unknown ids left out."""
    ids = list(dict.fromkeys(int(i) for i in ids))
    fields = ["id", "model", "layout", "gpus", "gpu_type", "global_batch", "micro_batch", "seq_len", "recompute",
              "state", "message", "result", "error", "wall_seconds"]
    found = {row["id"]: row for row in
             EmulationRun.objects.filter(pk__in=ids, kind=EmulationRun.Kind.EMULATE).values(*fields)}
    return [found[i] for i in ids if i in found]
