"""Which optimizer step a run takes, applied to a traced step (pure: no torch).

The traced program steps with ShardedAdamW: its gradients concatenated for the
data-parallel all-reduce and cloned into the masters' chunks, torch's fused AdamW on the
fp32 masters (one kernel: 32 bytes a parameter as the recorder counts its schema, 28 moved),
and the cast back to bf16 (the tracer records each kernel). Until session 23 it was torch's
foreach AdamW, a kernel per pass over the parameters (about 108 bytes a parameter).

Megatron-LM's mixed-precision optimizer as Narayanan et al. 2021 and Korthikanti et al. 2022
ran it (megatron/optimizer/optimizer.py, Float16OptimizerWithFloat16Params.step, and
clip_grads.py) runs apex's multi-tensor kernels, one pass each:
- the half-precision gradients copied into fp32 main gradients (multi_tensor_scale: 2 + 4
  bytes per parameter); where the gradients were accumulated in fp32 already (`main_grad`,
  which its gradient accumulation fusion needs) there is no copy, and the buffer is zeroed
  for the next step instead (4);
- unscale and check for inf/nan (torch._amp_foreach_non_finite_check_and_unscale_: 4 + 4);
- the gradient norm (multi_tensor_l2norm: 4). The clip's rescale (8 more) runs only in a
  step whose norm exceeds the clip; it is not counted;
- apex FusedAdam (multi_tensor_adam: reads the parameter, gradient and both moments, writes
  the parameter and moments: 16 + 12);
- the fp32 main parameters copied into the half model parameters (multi_tensor_scale: 4 + 2).
That is 52 bytes per parameter with half gradients and 50 with fp32 ones. Each kernel is a
memory-bound op here; the step's collectives (the inf flag's and the norm's all-reduce) stay
as traced. Memory is unchanged: the program's step temporaries are an upper bound on
Megatron's, which allocates none of that size.

- "program": as traced.
- "megatron": the stage's optimizer kernels replaced by Megatron's, sized by the parameters the
  rank steps (its fp32 master and two moments: 12 bytes each) and the gradients it holds.
"""
from __future__ import annotations

from parallelism.emulator.errors import require
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, with_ops

OPTIMIZERS = ("program", "megatron")
_STATE_BYTES = 12  # fp32 master, exp_avg and exp_avg_sq per stepped parameter
_GRAD_BYTES = 4    # the traced program's fp32 gradient buffer per held parameter


def megatron_step(stepped: int, grads: int, fp32_grads: bool) -> tuple[ComputeOp, ...]:
    """Megatron's optimizer kernels for `stepped` parameters and `grads` held gradients."""
    require(stepped >= 0 and grads >= 0, f"parameter counts must be >= 0, got {stepped} and {grads}")
    first = (ComputeOp("zero_main_grad_buffer", "memory", 0.0, 4.0 * grads, (), "fp32") if fp32_grads
             else ComputeOp("copy_model_grads_to_main_grads", "memory", 0.0, 6.0 * grads, (), "fp32"))
    return (first,
            ComputeOp("non_finite_check_and_unscale", "memory", 2.0 * stepped, 8.0 * stepped, (), "fp32"),
            ComputeOp("multi_tensor_l2norm", "memory", 2.0 * stepped, 4.0 * stepped, (), "fp32"),
            ComputeOp("fused_adam", "memory", 16.0 * stepped, 28.0 * stepped, (), "fp32"),
            ComputeOp("copy_main_params_to_model_params", "memory", 0.0, 6.0 * stepped, (), "fp32"))


def with_optimizer(trace: Trace, mode: str, fp32_grads: bool = False) -> Trace:
    """The trace stepping as `mode`; `fp32_grads`: the run accumulated its gradients in fp32
    main_grad buffers (Megatron's gradient accumulation fusion)."""
    require(mode in OPTIMIZERS, f"optimizer={mode!r} not in {OPTIMIZERS}")
    if mode == "program":
        return trace
    return each_stage(trace, lambda stage: _megatron(stage, fp32_grads))


def _megatron(stage: StageTrace, fp32_grads: bool) -> StageTrace:
    kernels = megatron_step(stage.memory.optimizer // _STATE_BYTES, stage.memory.grads // _GRAD_BYTES, fp32_grads)
    collectives = tuple(op for op in stage.optimizer if not isinstance(op, ComputeOp))
    return with_ops(stage, optimizer=kernels + collectives)
