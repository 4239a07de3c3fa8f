"""Calibrate the ops of a trace: the GEMMs and fused attentions it holds, timed at their own
shapes and operand layouts, and the memory-bound ops by size (into op_tables.py's tables).

`op_shapes` reads the distinct shapes out of traces (`shapes_by_residency`: cold or hot,
by the trace's working set) and `collective_sizes` their collectives' sizes (made in the
parent process, before the ranks start); the `measure_*` functions run on every rank at
once, as a training step's ranks share the machine, and return rows for the profile's
tables. Every `measure_*` function takes a `device` (default the CPU): on a GPU the
tensors live there and each run is timed by the device (Clock).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from parallelism.emulator.op_tables import gemm_key
from parallelism.emulator.recorder import causal_fraction
from parallelism.emulator.trace import CommOp, ComputeOp, Trace

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def op_shapes(traces: list[Trace]) -> tuple[list, list]:
    """(gemms, attentions) in the traces, each distinct once, sorted:
    gemms (dtype, form, batch, m, n, k); attentions (direction, dtype, batch, heads, seq_q,
    seq_kv, head_dim)."""
    gemms, attentions = set(), set()
    for trace in traces:
        for stage in trace.stages:
            for op in (*stage.forward, *stage.backward, *stage.optimizer):
                if not isinstance(op, ComputeOp):
                    continue
                if op.kind == "matmul" and len(op.shape) in (3, 4) and min(op.shape) > 0:
                    gemms.add((op.dtype, op.form or "nn", *gemm_key(op.shape)))
                elif op.kind == "attention" and len(op.shape) == 5 and min(op.shape) > 0:
                    attentions.add(("backward" if "backward" in op.name else "forward", op.dtype, *op.shape))
    return sorted(gemms), sorted(attentions)


def shapes_by_residency(traces: list[Trace], cache_bytes: int) -> dict[str, tuple[list, list]]:
    """{"cold": op_shapes, "hot": op_shapes}: a trace whose stages hold more static state
    (parameters, gradients, optimizer state) than the last-level cache meets its GEMMs and
    attentions with operands from memory, so they are timed after a CacheFlush; a smaller
    one (calibrate's tiny program model, whose whole state stays cached) hot. A shape of
    both kinds is timed cold: the table holds one rate per shape."""
    def held(trace: Trace) -> int:
        return max(s.memory.static for s in trace.stages)

    big = [t for t in traces if held(t) > cache_bytes]
    small = [t for t in traces if held(t) <= cache_bytes]
    cold = op_shapes(big)
    timed_cold = [set(shapes) for shapes in cold]
    hot = tuple([x for x in shapes if x not in seen] for shapes, seen in zip(op_shapes(small), timed_cold))
    return {"cold": cold, "hot": hot}


def merge_tables(a: dict, b: dict) -> dict:
    """Two {key: {key: [rows]}} tables (measure_gemms / measure_attentions) as one."""
    out = {k: {kk: list(rows) for kk, rows in v.items()} for k, v in a.items()}
    for k, v in b.items():
        for kk, rows in v.items():
            out.setdefault(k, {}).setdefault(kk, []).extend(rows)
    return out


TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def collective_sizes(traces: list[Trace], world: int, tolerance: float = 0.02) -> dict[str, list[float]]:
    """{kind: [bytes, ...]} of the traces' all-reduces, all-gathers and reduce-scatters over
    `world` ranks inside one node: the collectives calibrate can time on this machine's
    ranks at their own sizes. Sizes within `tolerance` of a smaller one are that one (a
    table point stands for its neighbours), ascending.

    Why at their own sizes: a measured ladder extrapolated past its largest point misses
    what only large buffers do on a CPU (a 250 MB gloo all-gather took 0.4-1.5 s here, three
    to ten times the ladder's extrapolation, docs/benchmarks-history.md session 7)."""
    found: dict[str, set[float]] = {}
    for trace in traces:
        for stage in trace.stages:
            for op in (*stage.forward, *stage.backward, *stage.optimizer, *stage.grad_sync, *stage.param_sync):
                if (isinstance(op, CommOp) and op.kind in TABLE_KINDS and op.group_size == world
                        and op.nodes == 1 and op.bytes > 0):
                    found.setdefault(op.kind, set()).add(float(op.bytes))
    out = {}
    for kind, sizes in found.items():
        kept: list[float] = []
        for size in sorted(sizes):
            if not kept or size > kept[-1] * (1 + tolerance):
                kept.append(size)
        out[kind] = kept
    return out


class Clock:
    """Seconds of one call's work on `device`. On a CPU eager ops run inside the call: the
    wall clock around it. On a GPU the call only enqueues kernels: CUDA events recorded on
    the stream before and after it, waited for (what `torch.cuda.Event(enable_timing=True)`
    and triton.testing.do_bench use; a wall clock there times the launches, not the
    kernels). Work enqueued before `time` (a cache flush) runs before the start event."""

    def __init__(self, device=None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.cuda = self.device.type == "cuda"

    def time(self, fn) -> float:
        if not self.cuda:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def typical_seconds(fn, repeats: int, before=None, device=None) -> float:
    """The median of `repeats` runs after one warm-up. `before`, if given, runs untimed
    ahead of every run (e.g. a CacheFlush).

    The median, not the fastest: the emulator sums these times over a step's thousands of
    ops, and a step cannot pick its moments as a best-of-N timing does. On a shared host
    an op's fastest run is one the other guests left the memory bus alone for (DRAM rate
    45-56 GB/s within 20 s here); the sum of per-op minima under-predicted even the
    fastest real step of every layout of the CPU validation, by 6-17% (docs/benchmarks-history.md,
    session 9). The median rather than the mean: one preempted run of five would move a
    mean by its whole stall. `device`: where fn's work runs (Clock)."""
    clock = Clock(device)
    fn()
    clock.synchronize()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        samples.append(clock.time(fn))
    return statistics.median(samples)


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache of this machine (sysfs), `default` where it cannot be read."""
    from pathlib import Path

    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


class CacheFlush:
    """Writes a buffer twice the size of the last-level cache, so that the op timed next
    reads its operands from memory, as a training step does: each weight is used once per
    pass and the step's working set (weights, saved activations, optimizer state) is many
    times the cache. Timed hot, the GEMMs of a 124M-parameter step ran 15-50% faster than
    inside the step (docs/benchmarks-history.md, session 8). triton.testing.do_bench clears the
    GPU's L2 before each run for the same reason. On a GPU, `cache_bytes` is its L2
    (calibrate_device.device_facts) and the buffer lives on `device`."""

    def __init__(self, cache_bytes: int | None = None, device=None) -> None:
        self.buffer = torch.empty(2 * (cache_bytes or last_level_cache_bytes()) // 4, dtype=torch.float32,
                                  device=device)

    def __call__(self) -> None:
        self.buffer.fill_(1.0)


def _operand(rows: int, cols: int, letter: str, batch: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A (batch x) rows x cols matrix stored row by row ('n') or column by column ('t')."""
    lead = (batch,) if batch > 1 else ()
    if letter == "t":
        return torch.randn(*lead, cols, rows, dtype=dtype, device=device).transpose(-2, -1)
    return torch.randn(*lead, rows, cols, dtype=dtype, device=device)


def _no_sync() -> None:
    return None


class ColdOperands:
    """Copies of one operand, together at least `cold_bytes` (and at least two), handed out
    in turn: timed with the next copy each run, an op reads that operand from memory while
    the other one stays where the previous run left it."""

    def __init__(self, make, operand_bytes: int, cold_bytes: int) -> None:
        self.copies = [make() for _ in range(max(2, -(-cold_bytes // max(operand_bytes, 1)) + 1))]
        self.index = 0

    def current(self) -> torch.Tensor:
        return self.copies[self.index]

    def advance(self) -> None:
        self.index = (self.index + 1) % len(self.copies)


def measure_gemms(gemms: list, repeats: int = 3, sync=_no_sync, cold_bytes: int = 0, device=None) -> dict:
    """{dtype: {form: [[batch, m, n, k, flop_per_second], ...]}} for each GEMM. With
    `cold_bytes` (twice the last-level cache) the right operand is cold in every run and
    the left one hot (ColdOperands), as in a step: a linear layer's forward x @ W^T and
    input gradient g @ W read the weight from memory (each is used once per pass, and the
    step's state is many times the cache) and the activation or gradient the op before just
    wrote; its weight gradient g^T @ x reads the activation saved in the forward. Flushing
    every operand (session 8) read the layer GEMMs up to 24% slower than this (a 768x768
    weight's forward 1.04 against 0.84 ms), and their sum 17-21% above the real step's
    matmul kernels (docs/benchmarks-history.md, session 9); 0 times them hot. `sync` (the
    ranks' barrier) runs before each shape, so that every rank times the same GEMM at the
    same moment, as a training step's ranks run theirs: a rank timing alone while its peer
    waits has the shared cache and memory bandwidth to itself (on this 2-core machine the
    same GEMM's rate moved by 25% between unsynchronized calibrations). With `cold_bytes`
    the output is cold too: a step's GEMM writes a new tensor on memory the allocator took
    back from tensors freed long before, while `torch.matmul` in a loop writes the lines its
    previous call just wrote. A weight gradient's output is the weight's size: timed into a
    hot output, 768x2048x32 `tn` ran 0.48 ms here, into a cold one 0.84 ms, inside the step
    1.0-1.3 ms (benchmarks.emulator_op_prices, session 25); outputs as small as an
    activation's (the forward and input gradient, 32 rows) did not move. On a GPU,
    `cold_bytes` is twice its L2."""
    table: dict = {}
    for dtype, form, batch, m, n, k in gemms:
        sync()
        a = _operand(m, k, form[0], batch, TORCH_DTYPES[dtype], device)
        if cold_bytes:
            size = TORCH_DTYPES[dtype].itemsize
            lead = (batch,) if batch > 1 else ()
            pool = ColdOperands(lambda: _operand(k, n, form[1], batch, TORCH_DTYPES[dtype], device),
                                batch * k * n * size, cold_bytes)
            # zeros, not empty: each output's pages are touched once here, as the step's reused heap is
            outs = ColdOperands(lambda: torch.zeros(*lead, m, n, dtype=TORCH_DTYPES[dtype], device=device),
                                batch * m * n * size, cold_bytes)

            def advance() -> None:
                pool.advance()
                outs.advance()

            seconds = typical_seconds(lambda: torch.matmul(a, pool.current(), out=outs.current()), repeats, advance,
                                      device)
            del pool, outs
        else:
            b = _operand(k, n, form[1], batch, TORCH_DTYPES[dtype], device)
            seconds = typical_seconds(lambda: torch.matmul(a, b), repeats, device=device)
        table.setdefault(dtype, {}).setdefault(form, []).append(
            [batch, m, n, k, 2.0 * batch * m * n * k / max(seconds, 1e-9)])
    return table


def measure_attentions(attentions: list, repeats: int = 3, sync=_no_sync, cold_bytes: int = 0, device=None) -> dict:
    """{direction: {dtype: [[batch, heads, seq_q, seq_kv, head_dim, flop_per_second], ...]}},
    causal (the program's decoders are; an encoder's full attention runs at a similar rate
    per FLOP), FLOPs counted as the recorder counts them. The backward is its kernel alone:
    `torch.autograd.grad` through a forward kept for it (retain_graph), as the trace prices
    the one backward op. With `cold_bytes` (twice the last-level cache, or a GPU's L2) every
    run takes the next of a pool of operand sets (ColdOperands, together at least
    `cold_bytes`), so it reads q, k, v and the saved output from memory, as a step's
    backward reads what its forward saved long before, while the kernel's code and the page
    tables stay warm as in a step. Until session 25 a CacheFlush before every run made those
    cold too, and the backward was timed as forward + backward minus the forward: llama-124m's
    seq-32 attention backward measured 1.70 ms that way, 0.84 hot, and ran 1.0-1.1 ms inside
    the step (benchmarks.emulator_op_prices). On a GPU torch picks the SDPA backend (flash
    or memory-efficient) as in training."""
    table: dict = {}
    for direction, dtype, batch, heads, seq_q, seq_kv, head_dim in attentions:
        sync()
        causal = seq_q == seq_kv
        dt = TORCH_DTYPES[dtype]

        def operands() -> tuple:
            q = torch.randn(batch, heads, seq_q, head_dim, dtype=dt, device=device, requires_grad=True)
            k = torch.randn(batch, heads, seq_kv, head_dim, dtype=dt, device=device, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            grad = torch.randn(batch, heads, seq_q, head_dim, dtype=dt, device=device)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal) if direction == "backward" else None
            return q, k, v, grad, out

        one_set = (2 * heads * seq_q + 2 * heads * seq_kv) * batch * head_dim * dt.itemsize
        pool = ColdOperands(operands, one_set, cold_bytes)
        advance = pool.advance if cold_bytes else None
        share = causal_fraction(seq_q, seq_kv) if causal else 1.0
        if direction == "forward":
            def forward() -> None:
                q, k, v, _, _ = pool.current()
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            flops = sdpa_flop_count((batch, heads, seq_q, head_dim), (batch, heads, seq_kv, head_dim),
                                    (batch, heads, seq_kv, head_dim)) * share
            seconds = typical_seconds(forward, repeats, advance, device)
        else:
            def backward() -> None:
                q, k, v, grad, out = pool.current()
                torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

            shape_q, shape_kv = (batch, heads, seq_q, head_dim), (batch, heads, seq_kv, head_dim)
            flops = sdpa_backward_flop_count(shape_q, shape_q, shape_kv, shape_kv) * share
            seconds = typical_seconds(backward, repeats, advance, device)
        del pool
        table.setdefault(direction, {}).setdefault(dtype, []).append(
            [batch, heads, seq_q, seq_kv, head_dim, flops / max(seconds, 1e-9)])
    return table


def matmul_rates(m: int, n: int, k: int, dtype: torch.dtype, repeats: int = 3, device=None) -> tuple[float, float]:
    """(rate of a linear layer's three GEMMs, rate of its forward GEMM alone) in FLOP/s.

    A linear layer's step runs one GEMM of each operand layout, with equal FLOPs: forward
    x @ W^T, input gradient g @ W, weight gradient g^T @ x. Their speeds differ a lot
    where the CPU has no native bf16 (measured on an AVX2 machine: 7-9 GFLOP/s for the
    first and third, 1 GFLOP/s for g @ W), so the rate the trace's matmuls run at is the
    three together, not one of them."""
    x, w, g = (torch.randn(*shape, dtype=dtype, device=device) for shape in ((m, k), (n, k), (m, n)))
    flops = 2.0 * m * n * k
    forward = typical_seconds(lambda: x @ w.t(), repeats, device=device)
    backward = (typical_seconds(lambda: g @ w, repeats, device=device)
                + typical_seconds(lambda: g.t() @ x, repeats, device=device))
    return 3 * flops / (forward + backward), flops / forward


def attention_rate(repeats: int = 3, shape: tuple = (1, 12, 256, 64), device=None) -> float:
    """FLOP/s of causal bf16 SDPA forward on q = k = v of `shape` (batch, heads, seq, head_dim)."""
    batch, heads, seq, head_dim = shape
    q = torch.randn(*shape, dtype=torch.bfloat16, device=device)
    flops = 4.0 * batch * heads * seq * seq * head_dim * causal_fraction(seq, seq)  # counted as the recorder counts it
    return flops / typical_seconds(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), repeats,
                                   device=device)


def op_cases(elements: int, tensors: int, device=None) -> dict:
    """{op: (work, bytes per call as the recorder counts them, calls per work)} for the
    memory-bound ops a training step runs, on `tensors` fresh fp32 tensors of `elements`
    each, as the optimizer and gradient code meet them (the _foreach_ ops take the whole
    list in one call, the others run once per tensor), on `device`."""
    # Values like an Adam second moment: small, positive. (Exact zeros or denormals, as in
    # the never-updated rows of an embedding, make sqrt 4-30x slower on x86; a fake trace
    # cannot know where they are, so the typical dense case is measured.)
    xs = [(torch.randn(elements, device=device) * 1e-3) ** 2 * 1e-3 + 1e-12 for _ in range(tensors)]
    ys = [torch.rand(elements, device=device) + 0.5 for _ in range(tensors)]
    zs = [x.clone() for x in xs]  # written in place (by factors near 1: the values stay normal)
    halves = [y.to(torch.bfloat16) for y in ys]  # a micro-batch's bf16 gradients
    outs = [torch.empty_like(h) for h in halves]  # bf16 parameters, written from fp32 masters
    moments, second = [y.clone() for y in ys], [x.clone() for x in xs]  # Adam's, for the fused step
    steps = [torch.tensor(1.0, device=device) for _ in range(tensors)]
    n = elements * 4.0  # bytes of one fp32 tensor

    def each(fn):
        def run() -> None:
            out = [fn(a, b) for a, b in zip(xs, ys)]
            del out
        return run

    whole = tensors * n
    return {
        "mul": (lambda: torch._foreach_mul(xs, 0.9), 2 * whole, 1),
        "add": (lambda: torch._foreach_add(xs, ys), 3 * whole, 1),
        "sqrt": (lambda: torch._foreach_sqrt(xs), 2 * whole, 1),
        "div": (lambda: torch._foreach_div(xs, ys), 3 * whole, 1),
        "addcdiv": (lambda: torch._foreach_addcdiv(xs, ys, xs), 4 * whole, 1),
        "addcmul": (lambda: torch._foreach_addcmul(xs, ys, xs), 4 * whole, 1),
        "lerp": (lambda: torch._foreach_lerp(xs, ys, 0.1), 3 * whole, 1),
        # In place, as the optimizer's moments and parameters are updated: the same bytes
        # counted (recorder._written), but on a CPU each output line is one the op just read,
        # while an out-of-place op first fetches its output's lines (write-allocate) and may
        # fault fresh pages in: measured 1.5-4x faster per byte here (docs/benchmarks-history.md, session 22).
        "mul_": (lambda: torch._foreach_mul_(zs, 1.0001), 2 * whole, 1),
        "add_": (lambda: torch._foreach_add_(zs, ys, alpha=1e-9), 3 * whole, 1),
        "div_": (lambda: torch._foreach_div_(zs, ys), 3 * whole, 1),
        # with operands as AdamW passes them: the update p += -lr * m / denom reads three
        # lists, v += (1 - b2) * g * g two (g twice, counted twice as the recorder counts it)
        "addcdiv_": (lambda: torch._foreach_addcdiv_(zs, xs, ys, value=1e-9), 4 * whole, 1),
        "addcmul_": (lambda: torch._foreach_addcmul_(zs, ys, ys, value=1e-9), 4 * whole, 1),
        "lerp_": (lambda: torch._foreach_lerp_(zs, ys, 1e-9), 3 * whole, 1),
        # torch's fused AdamW, the ZeRO path's update (parallelism/training/zero.py): one kernel
        # reads the parameter, gradient and both moments and writes three back. Its schema
        # marks the gradients written too (for an in-place unscale), so the recorder counts
        # 8 lists and the step counters; priced per those bytes, the rate absorbs it.
        "_fused_adamw_": (lambda: torch._fused_adamw_(
            zs, ys, moments, second, [], steps, lr=1e-9, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8,
            amsgrad=False, maximize=False), 8 * whole + 4 * tensors, 1),
        "copy": (each(lambda a, h: torch.empty_like(a, dtype=torch.bfloat16).copy_(a)), 1.5 * n, tensors),
        "_to_copy": (each(lambda a, h: a.to(torch.bfloat16)), 1.5 * n, tensors),
        # Casts by direction (ComputeOp.source > dtype), as the program runs them: the bf16
        # gradient into a new fp32 buffer and added into one (ShardedAdamW.accumulate), the
        # fp32 master into its bf16 parameter. Calibrated on two ranks (session 22): the
        # mixed add at 13 GB/s against 23 for fp32 += fp32; the copy into an existing bf16
        # tensor at 16 against 11 into a new one; the widening cast alone like the narrowing one.
        "_to_copy:bf16>fp32": (lambda: [h.to(torch.float32, copy=True) for h in halves], 1.5 * n, tensors),
        "add_:bf16>fp32": (lambda: [z.add_(h) for z, h in zip(zs, halves)], 2.5 * n, tensors),
        # The same two as the program's gradient accumulation runs them (ComputeOp.role), timed
        # cold (COLD_CASES): into fp32 buffers the step last touched a whole backward before.
        "grad_accumulate:_to_copy:bf16>fp32": (lambda: [h.to(torch.float32, copy=True) for h in halves], 1.5 * n,
                                               tensors),
        "grad_accumulate:add_:bf16>fp32": (lambda: [z.add_(h) for z, h in zip(zs, halves)], 2.5 * n, tensors),
        "copy_:fp32>bf16": (lambda: [o.copy_(z) for o, z in zip(outs, zs)], 2 * n, tensors),
        # Into an existing tensor of its own dtype (a memcpy): ZeRO's all-gathered parameters
        # copied back into the model. Priced by `copy` (a cast into a new tensor) until session
        # 26: a 147 MB bf16 copy_ at 10.6 GB/s, 13.9 ms, which ran in 7.5-8 inside the step. (The
        # recorder counts the destination read and written: 3 tensors' bytes.)
        "copy_": (lambda: [z.copy_(x) for z, x in zip(zs, xs)], 3 * n, tensors),
        "cat": (lambda: torch.cat(xs), 2 * whole, 1),
        "clone": (each(lambda a, h: a.clone()), 2 * n, tensors),
        "fill": (each(lambda a, h: torch.empty_like(a).fill_(1.0)), n, tensors),
        "zero": (each(lambda a, h: torch.empty_like(a).zero_()), n, tensors),
        "silu": (each(lambda a, h: torch.nn.functional.silu(a)), 2 * n, tensors),
        "rsqrt": (each(lambda a, h: a.rsqrt()), 2 * n, tensors),
        "pow": (each(lambda a, h: a.pow(2)), 2 * n, tensors),
        "mean": (each(lambda a, h: a.mean()), n, tensors),
        "sum": (each(lambda a, h: a.sum()), n, tensors),
        "neg": (each(lambda a, h: a.neg()), 2 * n, tensors),
        "exp": (each(lambda a, h: a.exp()), 2 * n, tensors),
    }


def collective_call(kind: str, nbytes: float, world: int, device=None, group=None):
    """A callable issuing one collective whose CommOp.bytes would be `nbytes`, into one output
    buffer every call. FSDP2's and the ZeRO path's outputs are new tensors each step, but
    the ranks' allocator settings (launch.RANK_MALLOC_ENV) hand back the same memory
    without page faults in steady state; a fresh 243 MB all-gather output per call here
    took 0.28-1.04 s, a reused one 0.30-0.36 s (docs/benchmarks-history.md, session 9)."""
    n = max(int(nbytes) // 4 // world * world, world)
    if kind == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_gather":  # bytes = the gathered output
        part, out = torch.ones(n // world, device=device), torch.empty(n, device=device)
        return lambda: dist.all_gather_single(out, part, group=group)
    inp, out = torch.ones(n, device=device), torch.empty(n // world, device=device)  # reduce_scatter: bytes = the input
    return lambda: dist.reduce_scatter_single(out, inp, group=group)


# Elements per tensor of the size ladder: 16 KiB (in the L1/L2 caches) to 16 MiB (DRAM).
SIZE_LADDER = (1 << 12, 1 << 16, 1 << 20, 1 << 22)

# The op_cases timed after a cache flush: the program's gradient accumulation (the ops its
# tracer tags role "grad_accumulate"), whose fp32 buffers a step last touched one whole
# backward before (and a new buffer, for the first micro-batch's cast, lands on memory
# freed long before). Timed in a loop, their 16 tensors stayed in the cache at the
# ladder's middle sizes: `fp32 += bf16` of a 768x768 weight priced at 18 GB/s ran at
# 10-13 inside the step (benchmarks.emulator_op_prices, session 25). The same casts
# elsewhere stay warm: FSDP2's cast of a layer's gradient for its reduce-scatter writes a
# buffer the layer before just freed. So do the forward's and backward's elementwise ops
# (they read what the op before wrote) and the optimizer's (its lists exceed the cache anyway).
COLD_CASES = frozenset({"grad_accumulate:add_:bf16>fp32", "grad_accumulate:_to_copy:bf16>fp32"})


def measure_op_bandwidths(cases_at, tensors: int = 16, repeats: int = 3, ladder=SIZE_LADDER, sync=_no_sync,
                          device=None, flush=None) -> dict:
    """{op: [[bytes, bytes_per_second], ...]} with bytes per op call as the recorder counts
    them (inputs + outputs), from `cases_at(elements, tensors) -> {op: (work, bytes per
    call, calls per work)}`. Each rate is net of the per-call host cost, measured on
    one-element tensors, which the cost model charges separately (launch_seconds).
    `sync` runs before each op at each size, as in measure_gemms: two ranks share the
    memory bus, and a step's ranks run their optimizers at the same time (unsynchronized,
    two calibrations minutes apart read the DRAM-sized ops at 26-29 and 16-19 GB/s).
    `device`: where cases_at's tensors live (it makes them there). `flush` (a CacheFlush)
    runs before each timed run of the COLD_CASES."""
    tiny = {name: typical_seconds(work, repeats, device=device) / calls
            for name, (work, _, calls) in cases_at(1, tensors).items()}
    table: dict = {}
    for elements in ladder:
        for name, (work, nbytes, calls) in cases_at(elements, tensors).items():
            sync()
            before = flush if name in COLD_CASES else None
            seconds = typical_seconds(work, repeats, before, device) / calls - tiny[name]
            rate = nbytes / max(seconds, nbytes / 1e12)
            table.setdefault(name, []).append([float(nbytes), rate])
    return table
