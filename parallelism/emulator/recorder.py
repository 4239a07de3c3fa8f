"""OpRecorder: a TorchDispatchMode that writes down what a (fake) training step does.

Every aten op becomes a compute record (FLOPs from torch.utils.flop_counter's formulas,
bytes = its tensors' sizes in and out) and every c10d collective a communication record
(kind, bytes, the process group's ranks). Live tensor memory is tracked exactly: each
output storage is counted when created and uncounted when Python frees it, so the
recorder's peak is the peak of live tensor bytes of the program (no allocator slack).

It runs under FakeTensorMode with torch's fake process group: nothing is computed or
sent, the shapes and the order are those of the real program.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
# CPU's attention kernels are not in flop_counter's registry; their FLOPs follow flash attention's.
CPU_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": "forward",
                 "_scaled_dot_product_flash_attention_for_cpu_backward": "backward"}
ATTENTION_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                   "window_attention")
# The trainer's windowed attention (parallelism/training/window_attention.py): where its q, k
# and v are among the arguments and where the window is. Priced as a flash kernel with a
# window (FlashAttention's window_size) that skips the blocks outside it: FLOPs by the share of
# the score matrix the window keeps (window_fraction), the kernel's inner loop as long as the
# window (shape's s_kv).
WINDOW_ATTENTION = {"window_attention": ("forward", 0, 3), "window_attention_backward": ("backward", 1, 6)}

COLLECTIVES = {  # op name (functional or c10d) -> kind
    "all_reduce": "all_reduce", "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast", "send": "send", "recv_": "recv",
}
IGNORED = {"wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd"}
# Ops that only describe a tensor differently: no kernel, no memory traffic.
VIEW_LIKE = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "as_strided", "slice",
             "select", "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
             "_reshape_alias", "view_as", "lift_fresh", "chunk"}
# Ops that allocate without touching the memory: new storage (tracked as live bytes), no
# traffic. FSDP2's backward makes its reduce-scatter and all-gather buffers this way; priced
# by their size they came to 69 ms of a 1.3 s dp=2 ZeRO-3 step that spent 1.5 ms on them
# (benchmarks.emulator_op_prices, session 25).
ALLOCATE_ONLY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


@dataclass
class ComputeRecord:
    name: str
    kind: str  # matmul | attention | memory | host
    flops: float
    bytes: float
    shape: tuple[int, ...]  # matmul (m, n, k) or (batch, m, n, k); attention (b, heads, s_q, s_kv, d)
    phase: str
    dtype: str = "bf16"
    form: str = ""  # matmul operand layout, see matmul_form
    role: str = ""  # what the program does with it, where the tracer knows (trace.ComputeOp.role)
    source: str = ""  # a memory-bound op's input dtype where it differs from `dtype` (trace.ComputeOp.source)


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _matmul_shape(name: str, args) -> tuple[int, ...]:
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if a.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return (a.shape[0], b.shape[1], a.shape[1])


def _operand_letter(t: torch.Tensor) -> str:
    """'n' when the matrix (the last two dims) is stored row by row, 't' when column by
    column (a transposed view), 'g' for any other stride pattern. A broadcast (stride 0)
    matrix counts as 'n': the kernel reads it as a dense copy."""
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride, col_stride = t.stride()[-2], t.stride()[-1]
    if row_stride == 0 or col_stride == 0:
        return "n"
    if col_stride == 1 or cols == 1:
        if row_stride >= cols or rows == 1:
            return "n"
    if row_stride == 1 or rows == 1:
        if col_stride >= rows or cols == 1:
            return "t"
    return "g"


def matmul_form(name: str, args) -> str:
    """The operand layout of a GEMM, BLAS-style in row-major terms: 'nt' is x @ W^T (a
    linear layer's forward), 'nn' is g @ W (its input gradient), 'tn' is g^T @ x (its
    weight gradient). Same FLOPs, but a CPU runs them at rates up to 9x apart (docs/
    benchmarks-history.md, session 5), so the cost model looks up the op's own form."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    return _operand_letter(a) + _operand_letter(b)


def _attention_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3])


def causal_fraction(s_q: int, s_kv: int) -> float:
    """Share of the s_q x s_kv score matrix a causal (top-left aligned, as torch's is_causal)
    attention computes: query i sees keys 0..i. Flash kernels, on GPUs and torch's CPU
    kernel alike, skip the blocks above the diagonal, so their FLOPs scale by this."""
    if s_q <= 0 or s_kv <= 0:
        return 1.0
    below = min(s_q, s_kv)  # rows 0..below-1 see i+1 keys, the rest see all s_kv
    return (below * (below + 1) // 2 + (s_q - below) * s_kv) / (s_q * s_kv)


def window_fraction(s_q: int, s_kv: int, window: int) -> float:
    """Share of the s_q x s_kv score matrix a causal attention within `window` keys computes:
    query i sees keys max(0, i - window + 1)..i (window 0: causal_fraction)."""
    if not window or s_q <= 0 or s_kv <= 0:
        return causal_fraction(s_q, s_kv)
    cap = min(window, s_kv)
    ramp = min(s_q, cap)  # queries 0..ramp-1 see i + 1 keys, the rest see `cap`
    return (ramp * (ramp + 1) // 2 + (s_q - ramp) * cap) / (s_q * s_kv)


def _argument(func, args, kwargs, name: str):
    """An op's argument by its schema name, positional or keyword (None if it has none)."""
    if name in kwargs:
        return kwargs[name]
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else argument.default_value
    return None


@dataclass
class CommRecord:
    name: str
    kind: str
    bytes: float
    ranks: tuple[int, ...]
    phase: str
    group: str = ""  # the process group's name: groups of the same ranks (dp and cp when dp=1) differ by it


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def converted_from(ins: list[torch.Tensor], dtype: str) -> str:
    """The dtype of an op's floating inputs that differs from its output's `dtype` (the
    first such), "" when there is none."""
    for t in ins:
        name = _DTYPES.get(t.dtype, "")
        if name and name != dtype:
            return name
    return ""


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments). An in-place
    _foreach_ op returns nothing, so without these its writes went uncounted: the
    optimizer's `_foreach_addcdiv_` moved 3 lists' bytes where its out-of-place twin (the
    one calibrate times) moves 4."""
    written: list[torch.Tensor] = []
    for i, name in _mutable_arguments(func):
        written += _tensors(args[i] if i < len(args) else kwargs.get(name))
    return written


@functools.cache
def _mutable_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of an overload's schema arguments it writes in place. Fixed per
    overload; cached because the recorder asks on every traced op (its hot path)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _group_ranks(args, kwargs) -> tuple[int, ...]:
    """The ranks of the process group a c10d op runs on (functional ops name the group;
    c10d ops pass the ProcessGroup object)."""
    for a in [*args, *kwargs.values()]:
        if isinstance(a, str):
            try:
                pg = dist.distributed_c10d._resolve_process_group(a)
            except (RuntimeError, ValueError, KeyError):
                continue
            return tuple(dist.get_process_group_ranks(pg))
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
            return tuple(dist.get_process_group_ranks(pg))
    return ()


def _group_name(args, kwargs) -> str:
    """The name of the process group a c10d op runs on ("" if none is found)."""
    for a in [*args, *kwargs.values()]:
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a).group_name
            except (RuntimeError, ValueError, KeyError):
                continue
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except (RuntimeError, TypeError):
                continue
    return ""


def lower_right_causal_fraction(s_q: int, s_kv: int) -> float:
    """Share of the s_q x s_kv score matrix a bottom-right aligned causal attention computes
    (query i sees keys 0..s_kv-s_q+i): a context-parallel chunk's queries over the keys up to
    its end (parallelism/training/context_parallel.py, torch's CausalBias lower_right)."""
    if s_q <= 0 or s_kv < s_q:
        return 1.0
    return (s_q * (s_kv - s_q) + s_q * (s_q + 1) // 2) / (s_q * s_kv)


def _collective_bytes(kind: str, namespace: str, args, out, group_size: int) -> int:
    """CommOp.bytes of a collective: the gathered output of an all-gather, the full input of
    a reduce-scatter, else the (first) tensor argument. c10d ops take their output first
    (`_reduce_scatter_base_(output, input)`, `_allgather_base_(output, input)`), functional
    ones their input first and return the output."""
    first = sum(_nbytes(t) for t in _tensors(args[0] if args else ()))
    if kind == "all_gather":  # the gathered output is what moves
        return sum(_nbytes(t) for t in _tensors(out)) or first * group_size
    if kind == "reduce_scatter":
        if namespace == "c10d":
            return sum(_nbytes(t) for t in _tensors(args[1] if len(args) > 1 else ())) or first * group_size
        return first
    return first


@dataclass
class OpRecorder(TorchDispatchMode):
    """Records ops into `records` tagged with the current `phase`; tracks live bytes."""

    phase: str = "forward"
    suspended: int = 0  # > 0 while DTensor propagates shapes (see ignoring_sharding_propagation)
    records: list = field(default_factory=list)
    live: int = 0
    peak: int = 0
    phase_peak: dict = field(default_factory=dict)
    role: str = ""  # tags the compute ops recorded while it is set (the tracer sets it around a call)

    def __post_init__(self) -> None:
        super().__init__()
        self._seen: set[int] = set()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def reset_peak(self) -> None:
        self.peak = self.live

    def track(self, t: torch.Tensor) -> None:
        """Count a tensor's storage as live until Python frees it (idempotent)."""
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        n = storage.nbytes()
        self._seen.add(key)
        self.live += n

        def release(key=key, n=n, recorder=weakref.ref(self)) -> None:
            me = recorder()
            if me is not None:
                me.live -= n
                me._seen.discard(key)

        weakref.finalize(storage, release)
        self._bump()

    def _bump(self) -> None:
        self.peak = max(self.peak, self.live)
        self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if DTensor in types:
            # A mode sees DTensor ops first, with global shapes. NotImplemented hands them to
            # DTensor with this mode still active: the local ops and collectives it runs (what a
            # rank really does) come back here as plain tensors and are recorded. The DTensor op
            # itself is recorded as host work: its sharding dispatch, which costs time of its own.
            if not self.suspended:
                self.records.append(ComputeRecord(f"dtensor.{func.__name__.split('.')[0]}", "host", 0.0, 0.0, (),
                                                  self.phase, "fp32"))
            return NotImplemented
        out = func(*args, **kwargs)
        if self.suspended:
            return out  # DTensor working out an output's shape on global fake tensors: not a kernel
        name = func.__name__.split(".")[0]
        namespace = func.namespace
        if namespace in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
            if name in COLLECTIVES:
                size = _collective_bytes(COLLECTIVES[name], namespace, args, out, len(_group_ranks(args, kwargs) or (1,)))
                self.records.append(CommRecord(name, COLLECTIVES[name], float(size), _group_ranks(args, kwargs),
                                               self.phase, _group_name(args, kwargs)))
            elif name not in IGNORED:
                raise NotImplementedError(f"recorder: unknown collective {namespace}.{name}")
            for t in _tensors(out):
                self.track(t)
            return out
        if name in VIEW_LIKE or namespace == "prim":  # metadata only (prim.device, views): no kernel
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        # written in place: priced as output bytes, but not new storage (not tracked below)
        written = _written(func, args, kwargs)
        if written:  # an in-place op that also returns its input counts it once
            returned = {id(t) for t in outs}
            written = [t for t in written if id(t) not in returned]
        moved = 0.0 if name in ALLOCATE_ONLY else float(sum(_nbytes(t) for t in ins) +
                                                         sum(_nbytes(t) for t in outs + written))
        packet = func._overloadpacket
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif name in CPU_ATTENTION:
            q, k, v = args[0:3] if CPU_ATTENTION[name] == "forward" else args[1:4]
            flops = float(sdpa_flop_count(q.shape, k.shape, v.shape) if CPU_ATTENTION[name] == "forward"
                          else sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape))
        elif name in WINDOW_ATTENTION and namespace == "dynaplane":
            direction, first, at = WINDOW_ATTENTION[name]
            q, k = args[first], args[first + 1]
            b, h, s_q, d = q.shape
            s_kv, window = k.shape[2], int(args[at])
            # two GEMMs forward, five backward (the scores recomputed), over the window's share
            flops = 2 * 2 * b * h * s_q * s_kv * d * (1 if direction == "forward" else 2.5) \
                * window_fraction(s_q, s_kv, window)
        kind = ("matmul" if packet in MATMUL else
                "attention" if any(a in name for a in ATTENTION_NAMES) else "memory")
        shape: tuple[int, ...] = ()
        form = ""
        if kind == "matmul":
            shape = _matmul_shape(name, args)
            form = matmul_form(name, args) if name != "_scaled_mm" else ""
        elif kind == "attention":
            q, k = (args[0], args[1]) if "backward" not in name else (args[1], args[2])
            if name in WINDOW_ATTENTION:  # FLOPs scaled above; the inner loop runs over the window
                window = int(args[WINDOW_ATTENTION[name][2]])
                shape = (q.shape[0], q.shape[1], q.shape[2], min(k.shape[2], window or k.shape[2]), q.shape[3])
            elif q.dim() == 4 and k.dim() == 4:
                shape = _attention_shape(q, k)
                if _argument(func, args, kwargs, "is_causal"):
                    flops *= causal_fraction(q.shape[2], k.shape[2])
                elif _argument(func, args, kwargs, "attn_mask") is not None and k.shape[2] > q.shape[2]:
                    # The trainer's one masked attention: a context-parallel chunk's causal mask
                    # aligned bottom right, which GPU flash kernels run skipping masked blocks.
                    flops *= lower_right_causal_fraction(q.shape[2], k.shape[2])
        dtype = _DTYPES.get(outs[0].dtype, "fp32") if outs and outs[0].is_floating_point() else "fp32"
        source = converted_from(ins, dtype) if kind == "memory" else ""
        self.records.append(ComputeRecord(name, kind, flops, moved, tuple(int(d) for d in shape), self.phase,
                                          dtype, form, self.role, source))
        for t in outs:
            self.track(t)
        return out


@contextmanager
def ignoring_sharding_propagation(recorder: OpRecorder):
    """DTensor infers an op's output shape by running it on global-shape fake tensors in the
    active FakeTensorMode (ShardingPropagator._propagate_tensor_meta_non_cached, once per
    signature). On real hardware that is metadata work; here it would look like a full,
    unsharded kernel. Suspend recording while it runs. (A private torch method: if it is
    renamed, the tracer fails loudly rather than miscounting.)"""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name)

    def wrapped(self, *args, **kwargs):
        recorder.suspended += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.suspended -= 1

    setattr(ShardingPropagator, name, wrapped)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)
