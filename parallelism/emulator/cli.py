"""`dynaplane emulate`: one configuration's predicted step time, throughput and memory."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError

GiB = 2**30


def _overlap_words(profile) -> str:
    if not profile.comm_streams:
        return "data-parallel collectives in series with compute (no comm streams)"
    return f"{profile.comm_overlap:.0%} of communication hidden behind compute"


def _run(command: str, args, work):
    """work(progress) -> result, or (None, exit code) after printing an EmulatorError; with
    --json the result is printed and the command is done (returns (None, 0))."""
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        result = work(progress)
    except EmulatorError as exc:
        print(f"dynaplane {command}: {exc}", file=sys.stderr)
        return None, 2
    if args.json:
        print(json.dumps(result, indent=2))
        return None, 0
    return result, None


def emulate_main(args) -> int:
    def work(progress):
        request = EmulateRequest(model=args.model, layout=args.layout, gpus=args.gpus, gpu=args.gpu,
                                 global_batch=args.global_batch, micro_batch=args.micro_batch, seq=args.seq,
                                 recompute=args.recompute, gpus_per_node=args.gpus_per_node, profile=args.profile,
                                 sequence_parallel=args.sequence_parallel, attention=args.attention,
                                 attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                                 grad_sync=args.grad_sync,
                                 grad_accumulation=args.grad_accumulation, pipeline_p2p=args.pipeline_p2p,
                                 optimizer=args.optimizer, precision=args.precision,
                                 fp8_scaling=args.fp8_scaling, fp8_casts=args.fp8_casts, elementwise=args.elementwise,
                                 memory_model=args.memory_model, param_gather=args.param_gather, stack=args.stack)
        return emulate(request, use_cache=not args.no_cache, progress=progress)

    result, code = _run("emulate", args, work)
    if result is None:
        return code
    r, m, b = result, result["memory"], result["breakdown"]
    print(f"{r['model']} {r['layout']} on {r['gpus']} x {r['gpu']}, global batch {r['global_batch']} "
          f"({r['micro_batches']} micro-batches of {r['micro_batch']}) x seq {r['seq']}, recompute {r['recompute']}"
          + (", sequence parallel" if r["sequence_parallel"] else "")
          + (f", unfused attention (dropout {r['attention_dropout']:g})" if "attention" in r else "")
          + (f", hidden dropout {r['hidden_dropout']:g}" if "hidden_dropout" in r else "")
          + (f", gradients reduced {r['grad_sync']}" if "grad_sync" in r else "")
          + (", gradient accumulation fused" if "grad_accumulation" in r else "")
          + (", Megatron's pipeline exchange" if "pipeline_p2p" in r else "")
          + (", Megatron's optimizer" if "optimizer" in r else "")
          + (f", {r['precision'].upper()} GEMMs ({r['fp8_scaling']} scaling, {r['fp8_casts']} casts)"
             if "precision" in r else "")
          + (", fused element-wise kernels" if "elementwise" in r else "")
          + (f", stack {r['stack']}" if "stack" in r else ""))
    print(f"  step {r['step_seconds']:.3f} s   {r['tokens_per_second']:,.0f} tokens/s   "
          f"{r['model_tflops_per_gpu']:.0f} model TFLOP/s per GPU (MFU {r['mfu']:.1%}), "
          f"{r['hardware_tflops_per_gpu']:.0f} hardware")
    print("  breakdown " + ", ".join(f"{k} {v:.3f} s" for k, v in b.items()))
    if "phases" in r:  # a multimodal model: the per-module split of the step
        print(f"  {r['placement']}, critical path: {r['critical_module']}; phases "
              + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items()))
    verdict = "fits" if m["fits"] else "DOES NOT FIT"
    print(f"  memory peak {m['peak_bytes'] / GiB:.1f} GiB of {m['capacity_bytes'] / GiB:.1f} GiB: {verdict}")
    for s in m["per_stage"]:
        print(f"    {s.get('module', 'stage')} {s['stage']:3d}: params {s['params'] / GiB:6.2f}  grads {s['grads'] / GiB:6.2f}  "
              f"optimizer {s['optimizer'] / GiB:6.2f}  activations {s['activations'] / GiB:6.2f}  "
              f"peak {s['peak'] / GiB:6.2f} GiB"
              + (f" ({s['overlap'] / GiB:.2f} GiB below the parts: gradients made as activations go)"
                 if s.get("overlap") else ""))
    print(f"  {r['ranks_emulated']} ranks emulated from {r['ranks_traced']} traced stage classes "
          f"in {r['wall_seconds']:.1f} s" + (" (trace cached)" if r["trace_cached"] else ""))
    return 0 if m["fits"] else 3


def _row(r: dict) -> str:
    if "error" in r:
        return f"| `{r['layout']}` | error: {r['error']} |||||||"
    m, b = r["memory"], r["breakdown"]
    return (f"| `{r['layout']}` | {r['micro_batch']} | {r['step_seconds']:.3f} | {r['tokens_per_second']:,.0f} | "
            f"{r['model_tflops_per_gpu']:.0f} | {r['mfu']:.1%} | {m['peak_bytes'] / GiB:.1f} | "
            f"{'yes' if m['fits'] else 'NO'} | " + " / ".join(f"{b[k]:.2f}" for k in
                                                             ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble"))
            + " |")


HEADER = ("| layout | micro-batch | step s | tokens/s | model TFLOP/s/GPU | MFU | peak GiB | fits | "
          "compute / tp / dp / pp / bubble s |\n|---|---|---|---|---|---|---|---|---|")


def compare_main(args) -> int:
    from parallelism.emulator.search import compare

    try:  # an unknown model is one error, not one per layout
        first = EmulateRequest(model=args.model, layout=args.layout[0], gpus=args.gpus, gpu=args.gpu,
                               global_batch=args.global_batch, micro_batch=args.micro_batch, seq=args.seq,
                               recompute=args.recompute, gpus_per_node=args.gpus_per_node, profile=args.profile,
                               sequence_parallel=args.sequence_parallel, stack=args.stack, precision=args.precision)
    except EmulatorError as exc:
        print(f"dynaplane compare: {exc}", file=sys.stderr)
        return 2
    requests = [dataclasses.replace(first, layout=layout) for layout in args.layout]
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    results = compare(requests, progress=progress)  # a bad layout is a row with its error, not an exception
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(HEADER)
        for r in results:
            print(_row(r))
    return 2 if all("error" in r for r in results) else 0


def search_main(args) -> int:
    from parallelism.emulator.search import SearchRequest, search

    def work(progress):
        request = SearchRequest(model=args.model, gpus=args.gpus, gpu=args.gpu, global_batch=args.global_batch,
                                seq=args.seq, top=args.top, gpus_per_node=args.gpus_per_node,
                                recompute=args.recompute, profile=args.profile,
                                max_candidates=args.max_candidates, sequence_parallel=args.sequence_parallel,
                                stack=args.stack, precision=args.precision)
        return search(request, progress=progress)

    result, code = _run("search", args, work)
    if result is None:
        return code
    print(f"{result['model']} on {result['gpus']} x {result['gpu']}, global batch {result['global_batch']} x seq "
          f"{result['seq']}: {result['candidates']} layouts, {result['emulated']} emulated, "
          f"{len(result['top'])} best that fit:")
    print(HEADER)
    for r in result["top"]:
        print(_row(r))
    for kind, r in result.get("best_by_placement", {}).items():  # a multimodal model
        print(f"best {kind}: " + (f"{r['layout']} (micro-batch {r['micro_batch']}), {r['tokens_per_second']:,.0f} "
                                  f"tokens/s, {r['model_tflops_per_gpu']:.0f} model TFLOP/s per GPU"
                                  if r else "none emulated fits"))
    if not result["top"]:
        print("nothing fits; the closest misses:")
        for d in result["does_not_fit"][:5]:
            print(f"  {d['layout']} (micro-batch {d['micro_batch']}): {d['reason']}")
        return 3
    return 0


def shape_requests(args) -> list:
    """The TraceRequests of `calibrate --model M --layout L ...` (their GEMM and attention
    shapes are measured), checked as `emulate` checks a configuration."""
    from parallelism.emulator.tracer import TraceRequest
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place
    from parallelism.layout.errors import LayoutError

    if not args.layout:
        if args.model:
            raise EmulatorError("--model needs at least one --layout whose op shapes to measure")
        return []
    if not args.model:
        raise EmulatorError("--layout needs --model")
    requests = []
    for layout in args.layout:
        try:
            ml = next(iter(place(get_model(args.model), layout).modules.values()))
        except (LayoutError, KeyError, ValueError) as exc:
            raise EmulatorError(f"--model {args.model} --layout {layout}: {exc}") from exc
        per_step = args.micro_batch * ml.dp
        global_batch = args.global_batch or per_step
        if global_batch % per_step:
            raise EmulatorError(f"--global-batch {global_batch} is not divisible by micro-batch x dp = "
                                f"{args.micro_batch} x {ml.dp} for {layout}")
        requests.append(TraceRequest(args.model, layout, args.micro_batch, args.seq, global_batch // per_step,
                                     args.ranks))
    return requests


def calibrate_main(args) -> int:
    from parallelism.emulator.devices import save_profile

    if args.merge:
        return _merge_main(args)
    if args.quietest:
        print("error: --quietest chooses among calibrations given with --merge", file=sys.stderr)
        return 2
    if args.ranks < 1:
        print(f"--ranks {args.ranks} must be >= 1", file=sys.stderr)
        return 2
    if args.passes is not None and args.passes < 1:
        print(f"--passes {args.passes} must be >= 1", file=sys.stderr)
        return 2
    cuda = getattr(args, "device", "cpu") == "cuda"
    refusal = _cuda_args_refusal(args) if cuda else ""
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        requests = shape_requests(args)
    except EmulatorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not _writable_out(args.out):
        return 2
    profile = (_measure_cuda if cuda else _measure_cpu)(args, requests)
    save_profile(profile, args.out)
    _describe_profile(args.out, profile)
    return 0


def _measure_cpu(args, requests):
    from parallelism.emulator.calibrate import FULL, QUICK, calibrate

    effort = QUICK if args.quick else FULL
    if args.passes is not None:
        effort = dataclasses.replace(effort, passes=args.passes)
    print(f"measuring this machine with {args.ranks} ranks at once{' (quick)' if args.quick else ''}; "
          f"this takes minutes on a small CPU machine ...", file=sys.stderr, flush=True)
    return calibrate(args.ranks, effort, requests)


def cuda_refusal(ranks: int) -> str:
    """Why `calibrate --device cuda --ranks N` cannot run here, or "" when it can."""
    import torch

    if not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
    count = torch.cuda.device_count()
    if ranks > count:
        return f"--ranks {ranks} with --device cuda runs one rank per GPU; this machine has {count}"
    return ""


def _cuda_args_refusal(args) -> str:
    refusal = cuda_refusal(args.ranks)
    if not refusal and args.passes is not None:
        refusal = "--passes applies to --device cpu (a GPU calibration is one pass, each point a median of runs)"
    return refusal


def _measure_cuda(args, requests):
    """`calibrate --device cuda`: calibrate_device.py on --ranks GPUs."""
    from parallelism.emulator.calibrate_device import DEVICE, QUICK_DEVICE, calibrate_device

    say = lambda text: print(f"  calibrate: {text}", file=sys.stderr, flush=True)  # noqa: E731
    print(f"measuring {args.ranks} GPU(s){' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
    return calibrate_device(args.ranks, requests, "cuda", QUICK_DEVICE if args.quick else DEVICE, say)


def _writable_out(out: str) -> bool:
    """Whether the profile can be written to `out`, making its folder; says why not. Asked
    once the other arguments are known good, before measuring: a calibration takes minutes
    and must not end in a failed write."""
    path = Path(out)
    problem = ""
    if path.is_dir():
        problem = "is a directory"
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"cannot make its folder ({exc.strerror or exc})"
        else:
            if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
                problem = "is not writable"
    if problem:
        print(f"error: --out {out}: {problem}", file=sys.stderr)
    return not problem


def _merge_main(args) -> int:
    """`calibrate --merge A B ... --out P`: the median of calibrations taken at other times."""
    from parallelism.emulator.devices import load_profile, save_profile
    from parallelism.emulator.profile_merge import median_profile, quietest_calibration

    measuring = [flag for flag, given in (("--model", args.model), ("--layout", args.layout), ("--quick", args.quick),
                                          ("--passes", args.passes is not None),
                                          ("--device cuda", getattr(args, "device", "cpu") == "cuda")) if given]
    if measuring:
        print(f"error: --merge combines profiles already measured; it takes no {', '.join(measuring)}",
              file=sys.stderr)
        return 2
    try:
        profiles = [load_profile(path) for path in args.merge]
        if args.quietest:
            best, speeds = quietest_calibration(profiles)
            profile = profiles[best]
        else:
            profile = median_profile(profiles)
    except EmulatorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not _writable_out(args.out):
        return 2
    save_profile(profile, args.out)
    if args.quietest:
        print(f"kept {args.merge[best]}, the quietest of {len(args.merge)} calibrations (machine speed against "
              f"their median: {', '.join(f'{s:.3f}' for s in speeds)})", file=sys.stderr)
    else:
        print(f"merged {len(args.merge)} calibrations", file=sys.stderr)
    _describe_profile(args.out, profile)
    return 0


def _describe_profile(path: str, profile) -> None:
    print(f"wrote {path}: bf16 matmul {profile.peak('bf16') / 1e9:.0f} GFLOP/s, fp32 "
          f"{profile.peak('fp32') / 1e9:.0f} GFLOP/s, attention {profile.attention_fraction:.0%} of bf16, memory "
          f"{profile.memory_bandwidth / 1e9:.1f} GB/s, {profile.launch_seconds * 1e6:.1f} us per op "
          f"(+{profile.dispatch_seconds * 1e6:.1f} us per DTensor op, {profile.collective_host_seconds * 1e3:.2f} ms "
          f"per side-stream collective, {profile.p2p_host_seconds * 1e3:.2f} ms per send/recv, "
          f"{profile.rendezvous_seconds * 1e3:.2f} ms per rendezvous at a layer's collective), "
          f"{_overlap_words(profile)}, all-reduce "
          f"{profile.intra_bw / 1e9:.2f} GB/s + {profile.intra_node_latency * 1e6:.0f} us per hop (per rank)")
    for kind, by_size in profile.collective_table.items():
        for group, points in by_size.items():
            print(f"  {kind} over {group} ranks: " + ", ".join(f"{size / 1024:.0f} KiB {seconds * 1e3:.2f} ms"
                                                             for size, seconds in points))
