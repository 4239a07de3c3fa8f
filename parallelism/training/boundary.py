"""The boundary communicator: carries out an activation's BoundaryPlan (parallelism/planner/activations.py)
with torch.distributed point-to-point, as an autograd Function.

Forward turns the sender layout's local box (e.g. the encoder's image tokens of its dp
slice) into the receiver layout's box (the LLM first stage's dp slice, replicated over its
tp); backward returns the gradient of the receiver's box to the sender's box through the
reverse plan. Every piece for one peer travels packed in one message, in the plan's order,
which both ends compute alike. A rank with no box on one side passes / gets an empty
[0, 0, hidden] tensor, so every rank can call the same code.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallelism.planner.activations import BoundaryPlan, Box, RankExchange


def _slice(box: Box, piece: Box) -> tuple[slice, slice]:
    """The piece's (batch, token) slices in the local coordinates of `box`."""
    return slice(piece[0] - box[0], piece[1] - box[0]), slice(piece[2] - box[2], piece[3] - box[2])


def _box_shape(box: Box | None, hidden: int) -> tuple[int, int, int]:
    return (0, 0, hidden) if box is None else (box[1] - box[0], box[3] - box[2], hidden)


def run_exchange(view: RankExchange, x: Tensor, hidden: int, group=None) -> Tensor:
    """This rank's side of one exchange: `x` is its sender box ([0, 0, hidden] when it has
    none); returns its receiver box. Ranks are global ranks of `group`'s world."""
    expected = _box_shape(view.send_box, hidden)
    if tuple(x.shape) != expected:
        raise ValueError(f"rank {view.rank}: boundary input of shape {tuple(x.shape)}, the plan's box is {expected}")
    out = torch.empty(_box_shape(view.recv_box, hidden), dtype=x.dtype, device=x.device)
    ops, inbox = [], []
    for peer, pieces in view.sends:
        assert view.send_box is not None
        buf = torch.cat([x[_slice(view.send_box, p)].reshape(-1) for p in pieces])
        ops.append(dist.P2POp(dist.isend, buf, peer, group))
    for peer, pieces in view.recvs:
        size = sum((p[1] - p[0]) * (p[3] - p[2]) * hidden for p in pieces)
        buf = torch.empty(size, dtype=x.dtype, device=x.device)
        inbox.append((buf, pieces))
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
    requests = dist.batch_isend_irecv(ops) if ops else []
    for p in view.local:  # overlaps the transfers in flight
        assert view.send_box is not None and view.recv_box is not None
        out[_slice(view.recv_box, p)] = x[_slice(view.send_box, p)]
    for request in requests:
        request.wait()
    for buf, pieces in inbox:
        assert view.recv_box is not None
        offset = 0
        for p in pieces:
            rows, cols = _slice(view.recv_box, p)
            n = (p[1] - p[0]) * (p[3] - p[2]) * hidden
            out[rows, cols] = buf[offset:offset + n].view(p[1] - p[0], p[3] - p[2], hidden)
            offset += n
    return out


class Boundary:
    """One rank's boundary communicator for `plan`; `apply(x)` is differentiable."""

    def __init__(self, plan: BoundaryPlan, rank: int, group=None) -> None:
        self.plan, self.rank, self.group = plan, rank, group
        self.forward_view = plan.forward.rank_view(rank)
        self.backward_view = plan.backward.rank_view(rank)
        self.hidden = plan.shape.hidden

    @property
    def send_box(self) -> Box | None:
        return self.forward_view.send_box

    @property
    def recv_box(self) -> Box | None:
        return self.forward_view.recv_box

    def agree(self, group=None) -> None:
        """Compare plan fingerprints over `group` (default: the world) before the first
        exchange: ranks that planned differently fail here instead of hanging in it."""
        fingerprints: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(fingerprints, self.plan.fingerprint(), group=group)
        if len(set(fingerprints)) != 1:
            raise RuntimeError(f"rank {self.rank}: boundary plans differ across ranks: {sorted(set(fingerprints))}")

    def empty_input(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """The placeholder a rank without a sender box passes (requires grad so that the
        backward exchange, where it may still receive or send, runs through autograd)."""
        return torch.zeros((0, 0, self.hidden), dtype=dtype, device=device, requires_grad=True)

    def apply(self, x: Tensor) -> Tensor:
        return _BoundaryFunction.apply(x, self)


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, boundary: Boundary) -> Tensor:  # type: ignore[override]
        ctx.boundary = boundary
        return run_exchange(boundary.forward_view, x.detach(), boundary.hidden, boundary.group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        b: Boundary = ctx.boundary
        return run_exchange(b.backward_view, grad.contiguous(), b.hidden, b.group), None

