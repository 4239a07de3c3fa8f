"""Loading a Hugging Face checkpoint against the disk it lies on. A Llama of TinyLlama-1.1B's
shape (hidden 2048, 22 layers, 32 heads, 4 kv heads, intermediate 5632, vocab 32000, untied:
1,100,048,384 parameters, 2.2 GB of bf16 safetensors in 3 shards) is written here with seeded
random values (safetensors.torch.save_file, no transformers, no download) and cached under
--work-dir; the loader's own checks accept it before anything is timed. In the same process:
the disk's cold sequential read bandwidth (every shard file in 16 MiB reads, the page cache
emptied first) and a warm read; then 4 rank processes (run_ranks, gloo) call
`hf_initial_shards` at tp=2,dp=2,zero=1 together, each reading only its boxes:

- cold: fresh rank processes, the checkpoint evicted (the issue's measure);
- warm: fresh rank processes, the checkpoint in the page cache;
- pre-faulted: cold, but each rank first allocated and freed its boxes, so the load writes
  into memory its process already touched (the read and the conversions, without the
  first-touch page faults of fresh memory);
- floor: fresh rank processes only allocating the same boxes zero-filled, reading nothing.

Each is given as the slowest rank's seconds and as (checkpoint bytes / those seconds) / the
cold disk bandwidth, with every rank's CPU (user, system) and page faults. --evict auto
empties the page cache with /proc/sys/vm/drop_caches when permitted (root: the whole
machine's cache), else with posix_fadvise(DONTNEED) on the files; mincore says what is left.

    .venv/bin/python -m benchmarks.hf_load [--work-dir DIR] [--model tinyllama-1.1b|tiny] [--layers N]

Needs, for the 1.1B model: 2.3 GB of free disk under --work-dir (default a temporary
directory, removed after; give a directory to keep the checkpoint between runs) and about
19 GiB of available memory (4 ranks x 4.4 GB of bf16 params, fp32 master chunks and Adam
moments); it refuses to start with less, saying so.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import hashlib
import json
import io as io_module
import math
import os
import pstats
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass

GiB = 2**30
TARGET = 0.5
LAYOUT = "tp=2,dp=2,zero=1"
# TinyLlama-1.1B's shape (its published config.json), untied, bf16.
MODELS: dict[str, dict] = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    # 656,000 parameters: the test's scale
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256),
}
SHARD_BYTES = {"tinyllama-1.1b": GiB, "tiny": 1 << 20}
COMPLETE = ".complete"  # written last: a directory without it is a build that did not finish


def config_json(dims: dict) -> dict:
    """A Llama config.json as transformers writes one (the keys the loader reads, plus the usual ones)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2, "initializer_range": 0.02, "use_cache": True}


def llama_tensors(dims: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor LlamaForCausalLM.save_pretrained writes, in its order."""
    hidden, ffn, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    head_dim = hidden // dims["num_attention_heads"]
    q, kv = dims["num_attention_heads"] * head_dim, dims["num_key_value_heads"] * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (q, hidden)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, q)), (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def param_count(dims: dict) -> int:
    return sum(math.prod(shape) for _, shape in llama_tensors(dims))


def shard_plan(dims: dict, max_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors cut, in order, into files of at most `max_bytes` of bf16 (save_pretrained's rule)."""
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in llama_tensors(dims):
        nbytes = 2 * math.prod(shape)
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    return files


def model_dims(model: str, layers: int | None = None) -> dict:
    """The config.json dimensions of `model`, with `layers` decoder layers if given."""
    return MODELS[model] | ({} if layers is None else {"num_hidden_layers": layers})


def checkpoint_dir(work_dir: str, model: str, dims: dict, seed: int = 0) -> str:
    key = json.dumps([dims, SHARD_BYTES[model], seed], sort_keys=True)
    return os.path.join(work_dir, f"{model}-{dims['num_hidden_layers']}l-{hashlib.sha1(key.encode()).hexdigest()[:10]}")


def build_checkpoint(work_dir: str, model: str = "tinyllama-1.1b", dims: dict | None = None,
                     seed: int = 0) -> tuple[str, bool]:
    """(the HF directory, whether it was built now): config.json, bf16 shards and
    model.safetensors.index.json; reused when an earlier run completed it. Weights
    N(0, 0.02^2) from a generator seeded per tensor, norm weights 1."""
    import torch
    from safetensors.torch import save_file

    dims = dims or MODELS[model]
    path = checkpoint_dir(work_dir, model, dims, seed)
    if os.path.exists(os.path.join(path, COMPLETE)):
        return path, False
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json(dims), f, indent=2)
    plan = shard_plan(dims, SHARD_BYTES[model])
    weight_map, total, index = {}, 0, 0
    for number, tensors in enumerate(plan, 1):
        file = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        out = {}
        for name, shape in tensors:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            index += 1
            if len(shape) == 1:
                out[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                out[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
            total += out[name].numel() * 2
        save_file(out, os.path.join(path, file), metadata={"format": "pt"})
        del out
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, COMPLETE), "w") as f:
        f.write(f"{param_count(dims)} parameters\n")
    return path, True


def shard_files(hf_dir: str) -> list[str]:
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        return [os.path.join(hf_dir, name) for name in sorted(set(json.load(f)["weight_map"].values()))]


def check_loadable(hf_dir: str, layout: str = LAYOUT) -> None:
    """The loader's own checks (config.json, every header against the map, the placement's
    model), reading no tensor data: the checkpoint is one it accepts before anything is timed."""
    from parallelism.hf_weights import hf_model_config, open_hf_source
    from parallelism.layout.catalog import get_model, model_from_config
    from parallelism.layout.placement import place

    model = model_from_config(hf_model_config(hf_dir))
    open_hf_source(hf_dir, place(get_model(hf_dir), layout).model)
    with open(os.path.join(hf_dir, "config.json")) as f:
        expected = param_count(json.load(f))
    if model.param_count != expected:
        raise SystemExit(f"{hf_dir}: the loader's model has {model.param_count:,} parameters, the files {expected:,}")


# --- resources -------------------------------------------------------------------------

def rank_state_bytes(hf_dir: str, layout: str = LAYOUT) -> list[int]:
    """Bytes of every rank's (tensor, state) boxes: what hf_initial_shards allocates there."""
    from parallelism.engine.shards import DTYPES, box_shape, rank_boxes
    from parallelism.engine.zero_pages import untouched_zeros
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place

    placement = place(get_model(hf_dir), layout)
    out = []
    for rank in range(placement.world):
        total = 0
        for (index, state), box in rank_boxes(placement, rank).items():
            tensor = placement.model.tensors[index]
            total += math.prod(box_shape(tensor, box)) * DTYPES[state].itemsize
        out.append(total)
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def check_resources(work_dir: str, model: str, dims: dict, hf_dir: str | None) -> None:
    """SystemExit with the numbers when the disk (a checkpoint still to build) or the memory
    (every rank's boxes, the largest tensor's transient copies, ~0.25 GB a process) falls short."""
    if hf_dir is None:
        need = 2 * param_count(dims) + (64 << 20)
        free = shutil.disk_usage(work_dir).free
        if free < need:
            raise SystemExit(f"hf_load: the {model} checkpoint needs {need / GiB:.1f} GiB of disk under {work_dir}, "
                             f"{free / GiB:.1f} GiB is free; give another --work-dir or free space")
    biggest = max(math.prod(shape) for _, shape in llama_tensors(dims))
    world = 4
    if hf_dir is None:  # before the build: every rank holds 4.0 bytes a parameter at tp=2,dp=2,zero=1
        states = [int(4.0 * param_count(dims))] * world
    else:
        states = rank_state_bytes(hf_dir)
    need = sum(states) + world * (4 * biggest + (250 << 20)) + (GiB // 2)
    available = mem_available()
    if available < need:
        raise SystemExit(f"hf_load: loading {model} at {LAYOUT} needs about {need / GiB:.1f} GiB of available memory "
                         f"({world} ranks x {max(states) / GiB:.1f} GiB of boxes, plus transient copies and the "
                         f"processes), MemAvailable is {available / GiB:.1f} GiB; wait for a quieter machine")


# --- the page cache and the disk --------------------------------------------------------

def evict(paths: list[str], method: str = "auto") -> str:
    """Drop `paths` from the page cache: all of it (drop_caches, root only) or the files
    alone (posix_fadvise DONTNEED); returns the method used."""
    os.sync()
    if method in ("auto", "drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError as exc:
            if method == "drop_caches":
                raise SystemExit(f"hf_load: cannot write /proc/sys/vm/drop_caches ({exc}); use --evict fadvise")
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def resident_fraction(paths: list[str]) -> float | None:
    """The fraction of the files' pages in the page cache (mincore on a fresh mapping), None
    where that cannot be asked (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += pages - bytes(vec).count(0)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def read_files(paths: list[str], block: int = 16 << 20) -> tuple[int, float]:
    """(bytes, seconds) reading every file start to end, `block` bytes a read, into one buffer."""
    buffer = memoryview(bytearray(block))
    total, started = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - started


# --- the load ---------------------------------------------------------------------------

def _io_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (/proc/self/io read_bytes):
    page-cache hits do not count."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _zeros(placement, rank: int) -> list:
    """Every box the rank holds, zero-filled in its state's dtype, the moments' pages left
    untouched: what the load allocates."""
    import torch

    from parallelism.engine.shards import DTYPES, box_shape, rank_boxes
    from parallelism.engine.zero_pages import untouched_zeros

    return [(untouched_zeros if state in ("exp_avg", "exp_avg_sq") else torch.zeros)(
                box_shape(placement.model.tensors[i], box), dtype=DTYPES[state])
            for (i, state), box in rank_boxes(placement, rank).items()]


def _rank(rank: int, world: int, hf_dir: str, layout: str, what: str, evict_method: str | None,
          prefault: bool, profile: bool) -> dict:
    """One rank of a timed run. `what` "load": hf_initial_shards; "alloc": its boxes allocated
    zero-filled, nothing read. Before the clock: with `prefault`, the boxes allocated and freed
    (the rank's heap keeps the pages: launch.RANK_MALLOC_ENV), then, with `evict_method`, rank 0
    empties the page cache of the checkpoint between two barriers; every rank starts together."""
    import safetensors.torch  # noqa: F401  (the program's code is read before the clock starts)
    import torch.distributed as dist

    from parallelism.hf_weights import hf_initial_shards
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place

    placement = place(get_model(hf_dir), layout)
    if prefault:
        held = _zeros(placement, rank)
        del held
    dist.barrier()
    resident = None
    if evict_method is not None and rank == 0:
        files = shard_files(hf_dir)
        evict(files, evict_method)
        resident = resident_fraction(files)
    dist.barrier()
    profiler = cProfile.Profile() if profile and rank == 0 and what == "load" else None
    usage, io, start, t = resource.getrusage(resource.RUSAGE_SELF), _io_read_bytes(), time.time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    if what == "load":
        shards = hf_initial_shards(placement, rank, hf_dir)
        tensors = [s.data for s in shards.values()]
        params = sum(s.nbytes for (_, state), s in shards.items() if state == "param")
    else:
        tensors, params = _zeros(placement, rank), 0
    if profiler is not None:
        profiler.disable()
    seconds, end, io = time.perf_counter() - t, time.time(), _io_read_bytes() - io
    after = resource.getrusage(resource.RUSAGE_SELF)
    states = sum(x.numel() * x.element_size() for x in tensors)
    dist.barrier()  # no rank frees its memory (or exits) while another still loads
    del tensors
    top = ""
    if profiler is not None:
        text = io_module.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        top = text.getvalue()
    return {"rank": rank, "seconds": seconds, "start": start, "end": end, "param_bytes": params,
            "state_bytes": states, "disk_bytes": io, "resident": resident, "profile": top,
            "user_s": after.ru_utime - usage.ru_utime, "sys_s": after.ru_stime - usage.ru_stime,
            "faults": after.ru_minflt - usage.ru_minflt}


@dataclass
class Run:
    ranks: list[dict]
    run_seconds: float  # run_ranks' whole wall: process start, the steps before the clock, teardown

    @property
    def seconds(self) -> float:
        """The slowest rank's timed part."""
        return max(r["seconds"] for r in self.ranks)

    @property
    def span(self) -> float:
        """First rank's start to last rank's end."""
        return max(r["end"] for r in self.ranks) - min(r["start"] for r in self.ranks)

    @property
    def cpu(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the timed part, all ranks together."""
        return sum(r["user_s"] for r in self.ranks), sum(r["sys_s"] for r in self.ranks)

    @property
    def resident(self) -> float | None:
        """The checkpoint's fraction in the page cache when the clock started (cold runs)."""
        return self.ranks[0]["resident"]


def timed(hf_dir: str, what: str = "load", evict_method: str | None = "auto", prefault: bool = False,
          world: int = 4, layout: str = LAYOUT, profile: bool = False, timeout_s: float = 900.0) -> Run:
    """`world` fresh rank processes (run_ranks) doing `what` together (_rank); with `profile`,
    rank 0's load under cProfile (its time then includes the profiler's overhead)."""
    from parallelism.engine.launch import run_ranks

    started = time.perf_counter()
    ranks = run_ranks(world, _rank, hf_dir, layout, what, evict_method, prefault, profile, timeout_s=timeout_s)
    return Run(ranks, time.perf_counter() - started)


# --- the report -------------------------------------------------------------------------

def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _resident(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{100 * fraction:.1f}%"


RUNS = {  # name -> (what, cold, prefault, words)
    "cold": ("load", True, False, "cold load, fresh rank processes"),
    "warm": ("load", False, False, "warm load (checkpoint in the page cache), fresh rank processes"),
    "prefaulted": ("load", True, True, "cold load into pre-faulted memory (each rank allocated and freed its "
                                       "boxes first)"),
    "floor": ("alloc", False, False, "floor: the same boxes allocated zero-filled in fresh rank processes, "
                                     "nothing read"),
}


def measure(hf_dir: str, evict_method: str = "auto", world: int = 4, layout: str = LAYOUT,
            profile: bool = False) -> dict:
    """The disk's cold and warm sequential reads, then the RUNS, in that order."""
    files = shard_files(hf_dir)
    size = sum(os.path.getsize(f) for f in files)
    out: dict = {"bytes": size, "files": len(files), "layout": layout, "load_before": os.getloadavg()[0],
                 "available_before": mem_available()}
    out["method"] = evict(files, evict_method)
    out["resident_before_read"] = resident_fraction(files)
    n, out["cold_read_s"] = read_files(files)
    assert n == size, (n, size)
    _, out["warm_read_s"] = read_files(files)
    for name, (what, cold, prefault, _) in RUNS.items():
        out[name] = timed(hf_dir, what, evict_method if cold else None, prefault, world, layout, profile)
        if name == "cold":
            out["resident_after_load"] = resident_fraction(files)
    out["load_after"] = os.getloadavg()[0]
    cold_bw = size / out["cold_read_s"]
    for name in RUNS:
        out[f"{name}_ratio"] = size / out[name].seconds / cold_bw
    return out


def report(m: dict, model: str) -> None:
    size, layout = m["bytes"], m["layout"]
    cold_bw, warm_bw = size / m["cold_read_s"], size / m["warm_read_s"]
    print(f"machine: {os.cpu_count()} CPUs, load average {m['load_before']:.1f} at the start and "
          f"{m['load_after']:.1f} at the end, {m['available_before'] / GiB:.1f} GiB available at the start")
    print(f"checkpoint: {_gb(size)} in {m['files']} safetensors files; page cache emptied with {m['method']}: "
          f"{_resident(m['resident_before_read'])} of the files' pages left in it")
    print(f"disk, sequential 16 MiB reads of every file: cold {cold_bw / 1e9:.2f} GB/s ({m['cold_read_s']:.2f} s), "
          f"warm (page cache) {warm_bw / 1e9:.2f} GB/s ({m['warm_read_s']:.2f} s)")
    for name, (what, cold, _, words) in RUNS.items():
        run: Run = m[name]
        print(f"{words}, {layout}, {len(run.ranks)} ranks: slowest rank {run.seconds:.2f} s = "
              f"{m[f'{name}_ratio']:.2f} x the cold disk; first start to last end {run.span:.2f} s; run_ranks "
              f"with process start {run.run_seconds:.2f} s" +
              (f"; {_resident(run.resident)} of the checkpoint cached at the start" if cold else ""))
        for r in run.ranks:
            disk = "?" if r["disk_bytes"] < 0 else _gb(r["disk_bytes"])
            read = f"read its boxes' regions, {_gb(r['param_bytes'])} (bf16), {disk} of it from the disk; " \
                if what == "load" else ""
            print(f"  rank {r['rank']}: {r['seconds']:.2f} s; {read}{_gb(r['state_bytes'])} of state; CPU "
                  f"{r['user_s']:.2f} s user + {r['sys_s']:.2f} s system, {r['faults']:,} page faults")
        user, system = run.cpu
        print(f"  CPU of the {len(run.ranks)} ranks: {user + system:.2f} s ({system:.2f} s in the kernel), "
              f"{(user + system) / os.cpu_count():.2f} s of wall on {os.cpu_count()} idle cores")
        if run.ranks[0]["profile"]:
            print(f"  rank 0 under cProfile, by own time:\n{run.ranks[0]['profile']}")
        if name == "cold":
            print(f"  after the cold load: {_resident(m['resident_after_load'])} of the checkpoint in the page cache")
    print(f"RESULT hf_load {model} {layout}: cold load {m['cold_ratio']:.2f} x the disk's cold read bandwidth "
          f"(target >= {TARGET}: {'met' if m['cold_ratio'] >= TARGET else 'NOT met'}); into pre-faulted memory "
          f"{m['prefaulted_ratio']:.2f} x; warm {m['warm_ratio']:.2f} x; allocation floor {m['floor_ratio']:.2f} x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=None,
                        help="where the checkpoint is built and kept (default: a temporary directory, removed)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tinyllama-1.1b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--profile", action="store_true", help="rank 0's loads under cProfile")
    parser.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto",
                        help="auto: drop_caches when permitted (root), else posix_fadvise on the files")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf-load-") as tmp:
        work_dir = args.work_dir or tmp
        os.makedirs(work_dir, exist_ok=True)
        dims = model_dims(args.model, args.layers)
        cached = checkpoint_dir(work_dir, args.model, dims)
        check_resources(work_dir, args.model, dims,
                        cached if os.path.exists(os.path.join(cached, COMPLETE)) else None)
        t = time.perf_counter()
        hf_dir, built = build_checkpoint(work_dir, args.model, dims)
        print(f"model: llama {args.model} ({', '.join(f'{k}={v}' for k, v in dims.items())}), "
              f"{param_count(dims):,} parameters, bf16")
        print(f"checkpoint {hf_dir}: " + (f"built in {time.perf_counter() - t:.1f} s" if built else "cached"))
        check_loadable(hf_dir)
        check_resources(work_dir, args.model, dims, hf_dir)
        report(measure(hf_dir, args.evict, profile=args.profile), args.model)


if __name__ == "__main__":
    main()
