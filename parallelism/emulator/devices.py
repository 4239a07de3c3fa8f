"""Device profiles: peak rates from vendor spec sheets plus a small efficiency model.

Compute: an op takes max(flops / (peak * efficiency), bytes / (HBM bandwidth * memory
fraction)) + a launch gap (a roofline with an efficiency on the compute roof).
- matmul efficiency = max_fraction * wave quantization * tile quantization * k/(k + k_half):
  output tiles (tile_m x tile_n) are spread over the SMs in waves, a last partial wave
  and partially filled edge tiles waste work (NVIDIA, "Matrix Multiplication Background
  User's Guide", sections on tile and wave quantization); a short k loop cannot hide its
  prologue/epilogue. max_fraction is the best a large cuBLAS GEMM reaches.
- attention efficiency = attention_fraction * wave quantization of the
  (batch * heads * ceil(seq_q / 128)) blocks * seq_kv / (seq_kv + seq_half).
- memory-bound ops: HBM bandwidth * memory_fraction; their compute roof is the fp32
  (CUDA core) rate.
Network: per-GPU one-direction bandwidth within a node (NVLink) and across nodes (one
NIC per GPU), each times an achievable fraction, plus a per-hop latency (network.py).

The fractions are first-principles/microbenchmark figures, not fitted to any training
run; `dynaplane calibrate` measures the local device and writes a profile JSON that
`load_profile` reads. Sources are in docs/emulator.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from parallelism.emulator.attention_kernels import SCORE_KERNELS
from parallelism.emulator.errors import EmulatorError, require
from parallelism.emulator.op_tables import attention_rate, bandwidth_at, check_tables, matmul_rate

GiB = 1024**3
MiB = 1024**2


# Ops priced at another measured op's rate, where that op is what their time goes on.
# embedding_dense_backward zero-fills a vocabulary-sized gradient and adds a micro-batch's
# rows into it: 49 MB in 5.9 ms inside the step here, the `zero` case's 8.3 GB/s
# (benchmarks.emulator_op_prices, session 25); priced at the generic rate it took 3.5 ms.
RATE_OF = {"embedding_dense_backward": "zero"}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: dict[str, float]       # dense FLOP/s by dtype; "fp32" is the CUDA-core (non-tensor) rate
    hbm_bytes: int                      # memory the framework can allocate (nvidia-smi total)
    hbm_bandwidth: float                # bytes/s, spec
    sm_count: int                       # 0: no wave/tile quantization (CPU)
    matmul_max_fraction: float
    attention_fraction: float
    memory_fraction: float
    launch_seconds: float               # device-side gap between back-to-back kernels
    intra_node_bandwidth: float         # bytes/s per GPU, one direction (NVLink)
    intra_node_efficiency: float
    intra_node_latency: float           # seconds per ring/tree hop
    inter_node_bandwidth: float         # bytes/s per GPU, one direction (its NIC)
    inter_node_efficiency: float
    inter_node_latency: float
    tile_m: int = 128
    tile_n: int = 128
    matmul_k_half: float = 64.0
    attention_seq_half: float = 128.0
    attention_block: int = 128
    gpus_per_node: int = 8
    notes: str = ""
    # Measured bytes/s of particular ops by name (no "_foreach_" prefix, no trailing "_"), the
    # memory roof of those ops (a GEMM's too): on a CPU, sqrt or a dtype cast is not
    # bandwidth-bound like an add; `dynaplane calibrate` fills it. The A100 profile has the
    # unfused attention's kernels (below); the other GPU profiles have none.
    op_bandwidth: dict = field(default_factory=dict)
    # Measured seconds of collectives inside one node, as a table for `dynaplane calibrate`'s
    # group size: {kind: {"<group size>": [[bytes, seconds], ...]}} (sizes ascending). Where a
    # collective's kind and group size are in it, network.py interpolates the table instead
    # of using the alpha-beta model (a CPU's small collectives cost what the scheduler's
    # wake-ups cost, which no wire model predicts). Empty for the GPU profiles.
    collective_table: dict = field(default_factory=dict)
    # Host seconds of one DTensor op's sharding dispatch on top of the local ops it runs.
    # 0 for the GPU profiles: there the host runs ahead of the kernels and this overlaps them.
    dispatch_seconds: float = 0.0
    # Host seconds the program spends on the compute thread around each data-parallel
    # collective it issues on the side (FSDP2's unshard/reshard hooks and stream waits
    # around its all-gathers and reduce-scatters, a bucket's hook). 0 for the GPU profiles:
    # there the host runs ahead of the kernels. `dynaplane calibrate` solves it from a
    # ZeRO-3 step of the real program.
    collective_host_seconds: float = 0.0
    # Host seconds on the compute thread per pipeline send or recv (the pipelining schedule's
    # Python around each p2p op). 0 for the GPU profiles; calibrate solves it from a pp=2 step.
    p2p_host_seconds: float = 0.0
    # Seconds each blocking collective inside the layers (tensor, context and expert
    # parallelism's: the ranks meet at every one) costs in a step beyond its measured time
    # alone: in a step the ranks arrive apart (noise on the cores they share adds up between
    # two meetings) and the waiting thread wakes late. 0 for the GPU profiles (the host runs
    # ahead; a kernel waits on the device); calibrate solves it from a tp=2 step.
    rendezvous_seconds: float = 0.0
    # Fraction of a collective's time that runs hidden while the rank computes. 1 on GPUs
    # (copy engines and NICs move the bytes); on a CPU whose cores all compute, the
    # collective's copies need the same cores, and `dynaplane calibrate` measures it.
    comm_overlap: float = 1.0
    # Whether the program's data-parallel collectives run on a stream of their own beside the
    # compute (NCCL on GPUs). On a CPU there are no device streams: FSDP2 issues its
    # all-gathers and reduce-scatters with async_op=False, so they run on the calling thread
    # and block it, and ZeRO's gradient all-reduce is a blocking call before the optimizer.
    # False: every data-parallel collective is in series with the compute where the program
    # issues it (comm_overlap is then unused).
    comm_streams: bool = True
    # Rates measured by `dynaplane calibrate` at the shapes of a trace (op_tables.py): GEMMs
    # by dtype and operand layout, fused attention by direction, memory-bound ops by size.
    # Empty for the built-in profiles, which use the efficiency model above.
    matmul_table: dict = field(default_factory=dict)
    attention_table: dict = field(default_factory=dict)
    op_bandwidth_table: dict = field(default_factory=dict)
    # The best fraction of peak a large GEMM reaches in another dtype than bf16 (matmul_max_fraction's),
    # where it was measured apart: {"fp8": ...}.
    matmul_fraction_of: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and self.name, f"profile name={self.name!r} must be a non-empty string")
        require(isinstance(self.peak_flops, dict) and "bf16" in self.peak_flops and "fp32" in self.peak_flops,
                f"profile {self.name}: peak_flops={self.peak_flops!r} needs at least bf16 and fp32")
        for dtype, value in self.peak_flops.items():
            _positive(value, f"profile {self.name}: peak_flops[{dtype!r}]")
        for key in ("hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                    "tile_m", "tile_n", "matmul_k_half", "attention_seq_half", "attention_block", "gpus_per_node"):
            _positive(getattr(self, key), f"profile {self.name}: {key}")
        for key in ("matmul_max_fraction", "attention_fraction", "memory_fraction",
                    "intra_node_efficiency", "inter_node_efficiency"):
            value = getattr(self, key)
            require(isinstance(value, (int, float)) and 0 < value <= 1,
                    f"profile {self.name}: {key}={value!r} must be in (0, 1]")
        _check_collective_table(self.name, self.collective_table)
        check_tables(self.name, self.matmul_table, self.attention_table, self.op_bandwidth_table)
        require(isinstance(self.matmul_fraction_of, dict), f"profile {self.name}: matmul_fraction_of must be an object")
        for dtype, value in self.matmul_fraction_of.items():
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
                    f"profile {self.name}: matmul_fraction_of[{dtype!r}]={value!r} must be in (0, 1]")
        require(isinstance(self.comm_overlap, (int, float)) and 0 <= self.comm_overlap <= 1,
                f"profile {self.name}: comm_overlap={self.comm_overlap!r} must be in [0, 1]")
        require(isinstance(self.comm_streams, bool),
                f"profile {self.name}: comm_streams={self.comm_streams!r} must be true or false")
        for key in ("sm_count", "launch_seconds", "intra_node_latency", "inter_node_latency", "dispatch_seconds",
                    "collective_host_seconds", "p2p_host_seconds", "rendezvous_seconds"):
            value = getattr(self, key)
            require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                    f"profile {self.name}: {key}={value!r} must be >= 0")

    # --- compute ----------------------------------------------------------------
    def peak(self, dtype: str) -> float:
        if dtype == "fp16" and "fp16" not in self.peak_flops:
            dtype = "bf16"
        if dtype not in self.peak_flops:
            raise EmulatorError(f"profile {self.name}: no peak for dtype {dtype!r} (has {sorted(self.peak_flops)})")
        return self.peak_flops[dtype]

    def _waves(self, tiles: int) -> float:
        """Fraction of SM slots doing work when `tiles` blocks run in whole waves."""
        if not self.sm_count or tiles <= 0:
            return 1.0
        waves = math.ceil(tiles / self.sm_count)
        return tiles / (waves * self.sm_count)

    def matmul_efficiency(self, shape: tuple[int, ...] = (), dtype: str = "bf16") -> float:
        """Achieved fraction of peak for a GEMM of shape (m, n, k) or (batch, m, n, k)."""
        best = self.matmul_fraction_of.get(dtype, self.matmul_max_fraction)
        if len(shape) == 3:
            batch, (m, n, k) = 1, shape
        elif len(shape) == 4:
            batch, m, n, k = shape
        else:
            return best
        if min(batch, m, n, k) <= 0:
            return best
        eff = best * k / (k + self.matmul_k_half)
        if self.sm_count:
            tm, tn = math.ceil(m / self.tile_m), math.ceil(n / self.tile_n)
            eff *= (m * n) / (tm * self.tile_m * tn * self.tile_n)     # tile quantization
            eff *= self._waves(batch * tm * tn)                        # wave quantization
        return eff

    def attention_efficiency(self, shape: tuple[int, ...] = ()) -> float:
        """Achieved fraction of peak for fused attention of shape (batch, heads, seq_q, seq_kv, head_dim)."""
        if len(shape) != 5 or min(shape) <= 0:
            return self.attention_fraction
        batch, heads, seq_q, seq_kv, _ = shape
        blocks = batch * heads * math.ceil(seq_q / self.attention_block)
        return self.attention_fraction * self._waves(blocks) * seq_kv / (seq_kv + self.attention_seq_half)

    def matmul_rate(self, dtype: str, shape: tuple[int, ...] = (), form: str = "") -> float:
        """Achieved FLOP/s of a GEMM: measured at (or near) its shape and form when the
        profile has a table for its dtype, else peak x matmul_efficiency."""
        measured = matmul_rate(self.matmul_table, dtype, form, shape)
        return measured if measured is not None else self.peak(dtype) * self.matmul_efficiency(shape, dtype)

    def attention_rate(self, name: str, dtype: str, shape: tuple[int, ...] = ()) -> float:
        """Achieved FLOP/s of a fused attention op (measured, else the efficiency model)."""
        measured = attention_rate(self.attention_table, name, dtype, shape)
        return measured if measured is not None else self.peak(dtype) * self.attention_efficiency(shape)

    def op_memory_bandwidth(self, name: str, nbytes: float | None = None, source: str = "",
                            dtype: str = "", role: str = "") -> float:
        """Achievable bytes/s of one memory-bound op moving `nbytes` (its measured rate
        by size, else its measured large-tensor rate, else the HBM figure). The table's
        most specific entry wins: the op in its role (`grad_accumulate:add_:bf16>fp32`, timed
        as the program runs it: calibrate_ops.COLD_CASES), then the op converting `source` to
        `dtype` (`_to_copy:bf16>fp32`, where the op has a source: ComputeOp.source), then the op
        in place (`mul_`), then its out-of-place twin (`mul`): on a CPU these differ by up to
        2x (calibrate_ops.op_cases)."""
        exact = RATE_OF.get(name, name.removeprefix("_foreach_"))
        base = exact.rstrip("_")
        if nbytes is not None:
            keys = (f"{exact}:{source}>{dtype}", f"{base}:{source}>{dtype}") if source else ()
            roles = tuple(f"{role}:{key}" for key in (*keys, exact)) if role else ()
            for key in (*roles, *keys, exact, base):
                if key in self.op_bandwidth_table:
                    return bandwidth_at(self.op_bandwidth_table[key], nbytes)
        return self.op_bandwidth.get(base, self.memory_bandwidth)

    @property
    def memory_bandwidth(self) -> float:
        """Achievable HBM bytes/s of memory-bound kernels."""
        return self.hbm_bandwidth * self.memory_fraction

    # --- network ----------------------------------------------------------------
    @property
    def intra_bw(self) -> float:
        """Achievable bytes/s per GPU, one direction, inside a node."""
        return self.intra_node_bandwidth * self.intra_node_efficiency

    @property
    def inter_bw(self) -> float:
        """Achievable bytes/s per GPU, one direction, through its NIC."""
        return self.inter_node_bandwidth * self.inter_node_efficiency

    # --- JSON -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        require(isinstance(data, dict), f"profile must be a JSON object, got {type(data).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        require(not unknown, f"profile {data.get('name')!r}: unknown keys {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise EmulatorError(f"profile {data.get('name')!r}: {exc}") from exc


def _check_collective_table(name: str, table) -> None:
    require(isinstance(table, dict), f"profile {name}: collective_table must be an object")
    for kind, by_size in table.items():
        require(isinstance(by_size, dict), f"profile {name}: collective_table[{kind!r}] must be an object")
        for group, points in by_size.items():
            where = f"profile {name}: collective_table[{kind!r}][{group!r}]"
            require(str(group).isdigit() and int(group) >= 2, f"{where}: the key must be a group size >= 2")
            require(isinstance(points, list) and len(points) >= 2 and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in p) for p in points),
                    f"{where} must be a list of at least two [bytes, seconds] pairs of positive numbers")
            require(all(a[0] < b[0] for a, b in zip(points, points[1:])), f"{where}: sizes must ascend")


def _positive(value, what: str) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            f"{what}={value!r} must be a positive number")


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")


def load_profile(path: str | Path) -> DeviceProfile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise EmulatorError(f"cannot read profile {str(path)!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise EmulatorError(f"profile {str(path)!r} is not JSON: {exc}") from exc
    return DeviceProfile.from_dict(data)


def get_profile(name: str) -> DeviceProfile:
    """A built-in profile by name (a100, h100, h200, b200, cpu)."""
    if name not in PROFILES:
        raise EmulatorError(f"unknown device {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]


# matmul_max_fraction, the best a large GEMM reaches, is the maximum achievable matmul FLOPS
# (bf16, the best shape of a sweep) measured with mamf-finder.py: S. Bekman, Machine Learning
# Engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
# table": A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%), both CUDA 12.1.
# H200 has H100's compute ("H100/H200 SXM" reads 794.5 in the same book). The tile, wave and k
# terms only lower it, so no shape is predicted faster than the sweep's best.
# Spec figures (dense, no sparsity): see docs/emulator.md for the sources.
#
# The unfused attention's kernels (attention_kernels.SCORE_KERNELS: each moves the s x s
# scores) reach less of the HBM bandwidth than an add. Measured: Dao et al. 2022
# (FlashAttention, arXiv 2205.14135), Figure 2 left: standard attention, forward + backward,
# moved 40.3 GB in 41.7 ms on an A100-SXM4-40GB (1.555 TB/s): 62% of it. The A100 profile
# runs those kernels at that fraction of its own HBM bandwidth (docs/emulator.md, "Device
# numbers"). No such measurement is known for H100, whose runs here use flash attention.
#
# FP8 (E4M3) GEMMs on H100 SXM, per-tensor scaled, through cuBLASLt (the path Transformer
# Engine's GEMMs take): 8192 x 8192 x 8192 in TN layout, bf16 out, fp32 accumulate, 500
# iterations, 16 GPUs of two nodes one at a time: mean 1608.6 and 1613.7 TFLOP/s (spread
# 1.0-1.7%), 81% of the 1978.9 dense peak (docs/emulator.md, "Device numbers"). The same
# report's torch._scaled_mm path reached 1170-1180, which stacks calling it through other
# layouts may see. B200's FP8 has no such measurement here: its bf16 fraction is used.
FP8_CUBLASLT_H100 = {"tflops": 1611.2, "m": 8192, "n": 8192, "k": 8192, "layout": "TN"}
FLASH_PAPER_STANDARD_ATTENTION = {"hbm_bytes": 40.3e9, "seconds": 41.7e-3, "device_hbm_bandwidth": 1.555e12}
SCORE_KERNEL_FRACTION_A100 = (FLASH_PAPER_STANDARD_ATTENTION["hbm_bytes"] / FLASH_PAPER_STANDARD_ATTENTION["seconds"]
                              / FLASH_PAPER_STANDARD_ATTENTION["device_hbm_bandwidth"])
_A100 = DeviceProfile(
    name="a100",
    peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    hbm_bytes=81920 * MiB, hbm_bandwidth=2.039e12, sm_count=108,
    matmul_max_fraction=0.859, attention_fraction=0.60, memory_fraction=0.80, launch_seconds=2e-6,
    intra_node_bandwidth=300e9, intra_node_efficiency=0.78, intra_node_latency=1e-6,   # NVLink3: 12 x 25 GB/s per direction
    inter_node_bandwidth=25e9, inter_node_efficiency=0.90, inter_node_latency=4e-6,    # HDR InfiniBand 200 Gb/s per GPU
    notes="A100-SXM4-80GB, DGX A100 (NVSwitch, 8x HDR 200 Gb/s)",
)
_A100 = replace(_A100, op_bandwidth={name: _A100.hbm_bandwidth * SCORE_KERNEL_FRACTION_A100 for name in SCORE_KERNELS})
_H100 = DeviceProfile(
    name="h100",
    peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12, "fp8": 1978.9e12},
    matmul_fraction_of={"fp8": FP8_CUBLASLT_H100["tflops"] / 1978.9},
    hbm_bytes=81559 * MiB, hbm_bandwidth=3.35e12, sm_count=132,
    matmul_max_fraction=0.801, attention_fraction=0.40, memory_fraction=0.80, launch_seconds=2e-6,
    intra_node_bandwidth=450e9, intra_node_efficiency=0.80, intra_node_latency=1e-6,   # NVLink4: 18 x 25 GB/s per direction
    inter_node_bandwidth=50e9, inter_node_efficiency=0.90, inter_node_latency=4e-6,    # NDR InfiniBand 400 Gb/s per GPU
    notes="H100-SXM5-80GB, DGX H100 (NVSwitch, 8x NDR 400 Gb/s)",
)
_H200 = replace(
    _H100, name="h200", hbm_bytes=143771 * MiB, hbm_bandwidth=4.8e12,
    notes="H200-SXM-141GB (H100 compute, HBM3e), HGX H200 (NVSwitch, 8x 400 Gb/s)",
)
_B200 = DeviceProfile(
    name="b200",
    peak_flops={"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12, "fp8": 4500e12},
    hbm_bytes=183359 * MiB, hbm_bandwidth=8.0e12, sm_count=148,
    matmul_max_fraction=0.70, attention_fraction=0.50, memory_fraction=0.80, launch_seconds=2e-6,
    intra_node_bandwidth=900e9, intra_node_efficiency=0.80, intra_node_latency=1e-6,   # NVLink5: 18 x 50 GB/s per direction
    inter_node_bandwidth=50e9, inter_node_efficiency=0.90, inter_node_latency=4e-6,    # ConnectX-7 400 Gb/s per GPU
    notes="B200 (HGX, 1000 W), DGX B200 (NVSwitch, 8x ConnectX-7 400 Gb/s); efficiencies are assumptions",
)
_CPU = DeviceProfile(
    name="cpu",
    peak_flops={"bf16": 50e9, "fp32": 100e9},
    hbm_bytes=16 * GiB, hbm_bandwidth=20e9, sm_count=0,
    matmul_max_fraction=0.70, attention_fraction=0.30, memory_fraction=0.60, launch_seconds=10e-6,
    intra_node_bandwidth=2e9, intra_node_efficiency=1.0, intra_node_latency=50e-6,     # gloo over loopback TCP
    inter_node_bandwidth=1.25e9, inter_node_efficiency=0.9, inter_node_latency=100e-6,  # 10 GbE
    matmul_k_half=32.0, attention_seq_half=64.0, comm_streams=False,
    notes="generic small x86 host; placeholders until `dynaplane calibrate` measures one",
)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (_A100, _H100, _H200, _B200, _CPU)}
