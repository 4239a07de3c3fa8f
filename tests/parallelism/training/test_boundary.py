"""The boundary communicator on real gloo process groups: random activations go from one
module layout to another and their gradients come back, bit for bit.

The layout pairs are drawn by hypothesis inside every rank with `derandomize=True` and no
shrinking, so all ranks draw the same cases in the same order; after each case the ranks
agree (all_reduce) on whether it passed, so a failure stops every rank together instead
of leaving some waiting in an exchange.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from parallelism.engine.launch import run_ranks
from parallelism.planner.activations import ActivationShape, plan_boundary
from parallelism.layout.spec import ModuleLayout
from parallelism.training.boundary import Boundary

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 6
EXAMPLES = 40


@st.composite
def cases(draw):
    def module(name: str) -> ModuleLayout:
        return ModuleLayout(name, tp=draw(st.integers(1, 2)), pp=draw(st.integers(1, 2)), dp=draw(st.integers(1, 3)),
                            cp=draw(st.integers(1, 2)))

    enc, llm = module("encoder"), module("llm")
    if enc.world + llm.world <= WORLD and draw(st.booleans()):  # non-colocated
        enc = ModuleLayout("encoder", enc.tp, enc.pp, 1, enc.dp, enc.cp, first_rank=0)
        llm = ModuleLayout("llm", llm.tp, llm.pp, 1, llm.dp, llm.cp, first_rank=enc.world)
    shape = ActivationShape(draw(st.integers(1, 9)), draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    return enc, llm, shape, dtype, draw(st.integers(0, 2**31 - 1))


def _region(full: torch.Tensor, box) -> torch.Tensor:
    return full[box[0]:box[1], box[2]:box[3]] if box is not None else full[:0, :0]


def _one_case(rank: int, enc: ModuleLayout, llm: ModuleLayout, shape: ActivationShape, dtype, seed: int) -> str:
    """'' when this rank's forward and backward were exact, else what went wrong."""
    if max(enc.offset + enc.world, llm.offset + llm.world) > WORLD:
        return ""  # a layout larger than the world: every rank skips it alike
    boundary = Boundary(plan_boundary(enc, llm, shape), rank)
    g = torch.Generator().manual_seed(seed)
    full = (shape.batch, shape.tokens, shape.hidden)
    x, grad_y = torch.randn(full, generator=g).to(dtype), torch.randn(full, generator=g).to(dtype)
    # Each sender holds its box of x (empty without one); the receivers' replicas all get
    # the same gradient of their box, as a replicated activation's gradient is.
    inp = _region(x, boundary.send_box).clone().requires_grad_(True)
    y = boundary.apply(inp)
    if not torch.equal(y, _region(x, boundary.recv_box)):
        return f"rank {rank}: forward differs ({enc}, {llm}, {shape})"
    torch.autograd.backward(y, _region(grad_y, boundary.recv_box).contiguous())
    if not torch.equal(inp.grad, _region(grad_y, boundary.send_box)):
        return f"rank {rank}: backward differs ({enc}, {llm}, {shape})"
    return ""


def _hypothesis_run(rank: int, world: int) -> int:
    tried = [0]

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case) -> None:
        error = _one_case(rank, *case)
        failed = torch.tensor([1 if error else 0])
        dist.all_reduce(failed)
        tried[0] += 1
        assert failed.item() == 0, error or "another rank's exchange was not exact"

    check()
    return tried[0]


def test_forward_then_backward_is_exact_for_every_pair_of_layouts_tried() -> None:
    tried = run_ranks(WORLD, _hypothesis_run, timeout_s=240)
    assert tried == [EXAMPLES] * WORLD  # every rank drew the same cases


def _worked_example(rank: int, world: int) -> tuple:
    """Encoder dp=4 into LLM tp=2,dp=2 on the same 4 ranks, batch 5: uneven on both sides."""
    case = (ModuleLayout("encoder", dp=4), ModuleLayout("llm", tp=2, dp=2), ActivationShape(5, 3, 2), torch.float32, 7)
    boundary = Boundary(plan_boundary(*case[:3]), rank)
    boundary.agree()
    return _one_case(rank, *case), boundary.send_box, boundary.recv_box


def test_uneven_colocated_example_with_a_rank_that_sends_nothing() -> None:
    results = run_ranks(4, _worked_example, timeout_s=120)
    assert [r[0] for r in results] == [""] * 4
    assert results[3][1] is None and results[3][2] == (3, 5, 0, 3)  # rank 3 holds no image, gets two
