"""Per-rank action orders of the pipeline schedules.

An action is (kind, micro_batch, chunk) with kind "F" or "B"; chunk c of rank r is the
virtual stage c*pp + r.

- 1F1B (vpp = 1; PipeDream-Flush as in Megatron and torch's Schedule1F1B): rank r runs
  min(pp-r-1, m) warm-up forwards, then alternates one forward / one backward, then
  drains the remaining backwards. With m < pp this is GPipe (all forwards first), which
  is also what the training program falls back to.
- interleaved 1F1B (vpp = v > 1; Megatron's forward_backward_pipelining_with_interleaving):
  the k-th forward of a rank runs chunk (k // pp) % v on micro-batch
  (k // (pp*v)) * pp + k % pp; backwards visit chunks in reverse. Warm-up is
  (pp-r-1)*2 + (v-1)*pp forwards (all of them when m == pp), capped at m*v. Needs
  m % pp == 0, as Megatron does.
"""
from __future__ import annotations

from parallelism.emulator.errors import require

Action = tuple[str, int, int]


def one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order: list[Action] = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warmup, m)]
    return order


def interleaved(rank: int, pp: int, vpp: int, m: int) -> list[Action]:
    total = m * vpp

    def action(kind: str, k: int) -> Action:
        chunk = (k // pp) % vpp
        if kind == "B":
            chunk = vpp - 1 - chunk
        return kind, (k // (pp * vpp)) * pp + k % pp, chunk

    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    order += [action("B", k) for k in range(total - warmup, total)]
    return order


def rank_orders(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """The action order of every pipeline rank."""
    for key, value in (("pp", pp), ("vpp", vpp), ("micro_batches", m)):
        require(isinstance(value, int) and value >= 1, f"{key}={value!r} must be a positive integer")
    if vpp == 1:
        return [one_f_one_b(r, pp, m) for r in range(pp)]
    require(pp > 1, f"vpp={vpp} needs pp > 1 (pp={pp})")
    require(m % pp == 0, f"the interleaved schedule needs micro_batches={m} divisible by pp={pp}")
    return [interleaved(r, pp, vpp, m) for r in range(pp)]
