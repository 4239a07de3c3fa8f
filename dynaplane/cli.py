"""`dynaplane <command>`: each subcommand imports only what it needs (the agent never
imports Django; `up` only starts processes)."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _add_agent(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run a node agent (a Celery worker on node.<name>)")
    p.add_argument("--name", default=None,
                   help="node name: a lowercase DNS label, e.g. node-1 (default with --join: the token's node)")
    p.add_argument("--token", default=None,
                   help="this agent's token, issued by an admin (`dynaplane tokens issue NODE`); default: "
                        "$DYNAPLANE_AGENT_TOKEN (better: the command line is visible to other users)")
    p.add_argument("--join", default=None, metavar="URL",
                   help="the control plane's web address: the agent enrols there with its token and is given "
                        "the broker (with its password) and its node name")
    p.add_argument("--gpus", type=int, default=0, help="devices to manage (cpu: virtual GPUs; cuda: first K, 0 = all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: virtual GPUs on the host; cuda: this host's GPUs")
    p.add_argument("--broker", default=None, help="Redis URL (default: $REDIS_URL, else redis://127.0.0.1:6379/0)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory of each virtual GPU (default: RAM / gpus)")
    p.add_argument("--emulation-slots", type=int, default=1,
                   help="emulations run at once here; job orders always have threads of their own (default 1)")
    p.add_argument("--advertise", default=None, metavar="ADDRESS",
                   help="the IPv4 address other hosts reach this one on; rank 0's rendezvous uses it "
                        "(default: this host's address on the route to the broker)")
    p.add_argument("--interface", default=None, metavar="NAME",
                   help="the network interface gloo and NCCL use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; "
                        "default: the one holding the advertised address)")
    p.add_argument("--loglevel", default="INFO", help="the agent's log level (DEBUG, INFO, WARNING, ERROR)")
    p.set_defaults(func=_run_agent)


def _run_agent(args: argparse.Namespace) -> int:
    from agents.node.app import run
    from agents.node.config import AgentConfig

    from agents.node.enrol import EnrolError, agent_token, enrol
    from agents.node.network import choose

    gpus = args.gpus if args.device == "cuda" or args.gpus else 1
    try:
        enrolment = enrol(agent_token(args.token), args.join, args.name)
    except EnrolError as exc:
        print(f"dynaplane agent: {exc}", file=sys.stderr)
        return 2
    name = args.name or enrolment.node
    if not name:
        print("dynaplane agent: give --name (or --join, which names the node the token speaks for)", file=sys.stderr)
        return 2
    broker = args.broker or enrolment.broker_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        host, interface = choose(broker, args.advertise, args.interface)
        config = AgentConfig(
            name=name,
            gpus=gpus,
            device=args.device,
            broker_url=broker,
            virtual_gpu_memory_bytes=int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None,
            host=host,
            key=enrolment.key,
        )
    except ValueError as exc:
        print(f"dynaplane agent: {exc}", file=sys.stderr)
        return 2
    if interface is not None and (args.interface or interface != "lo"):  # the ranks inherit it
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if args.emulation_slots < 1:
        print(f"dynaplane agent: --emulation-slots must be at least 1 (got {args.emulation_slots})", file=sys.stderr)
        return 2
    from agents.node.inventory import InventoryError

    try:
        run(config, emulation_slots=args.emulation_slots, loglevel=args.loglevel)
    except InventoryError as exc:
        print(f"dynaplane agent: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the whole stack locally: web, worker, agents, demo job")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the web server listens on and answers for (default 127.0.0.1: this "
                        "machine only; give the address other hosts reach it on for agents elsewhere)")
    p.add_argument("--port", type=int, default=8000, help="web port (0: pick a free one)")
    p.add_argument("--agents", type=int, default=2, help="local agents to start (0-64; default 2)")
    p.add_argument("--gpus-per-agent", type=int, default=2, help="virtual GPUs of each local agent (default 2)")
    p.add_argument("--workers", type=int, default=1,
                   help="control-plane worker processes (default 1; more for large clusters: docs/scaling.md)")
    p.add_argument("--web", type=int, default=1,
                   help="web server processes sharing the port (default 1; more for many open dashboards and API "
                        "readers: docs/scaling.md; one with --tls-cert)")
    p.add_argument("--var-dir", default=None, help="local state (database, logs); default ./var or $DYNAPLANE_VAR_DIR")
    p.add_argument("--no-demo", action="store_true", help="do not create the demo job")
    p.add_argument("--no-agent-restart", action="store_true",
                   help="leave an agent that exits dead (its node is marked lost); web and worker are still restarted")
    p.add_argument("--verbose", action="store_true", help="stream every process's log to the console")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain), with --tls-key; agents then join https://... "
                        "(a self-signed one: give them its certificate in SSL_CERT_FILE)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from dynaplane.stack import StackOptions, run_stack

    try:
        options = StackOptions.from_args(args)
    except ValueError as exc:
        print(f"dynaplane up: {exc}", file=sys.stderr)
        return 2
    return run_stack(options)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("switch", help="engine switch vs checkpoint-restart (DCP) on local ranks")
    p.add_argument("--model", required=True, help="catalog name (see `dynaplane models`) or path to a config.json")
    p.add_argument("--world", type=int, required=True, help="local processes (the union of both layouts' ranks)")
    p.add_argument("--from", dest="src", required=True, help="the layout switched from, e.g. tp=2,dp=2")
    p.add_argument("--to", dest="dst", required=True, help="the layout switched to, e.g. pp=2,dp=2")
    p.add_argument("--staging-mb", type=float, default=256.0,
                   help="memory each rank may stage in flight per round, MB (default 256)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo ranks, state on the host; cuda: NCCL ranks, one GPU each, state on it")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_bench_switch)


def _run_bench_switch(args: argparse.Namespace) -> int:
    import json

    from parallelism.engine.bench import bench_rank, summarize
    from parallelism.engine.errors import EngineError
    from parallelism.engine.launch import run_ranks

    try:
        ranks = run_ranks(args.world, bench_rank, args.model, args.src, args.dst, args.staging_mb, timeout_s=600,
                          backend="nccl" if args.device == "cuda" else "gloo")
    except EngineError as exc:
        print(f"dynaplane bench switch: {exc}", file=sys.stderr)
        return 1
    result = summarize(args.model, args.world, args.src, args.dst, ranks)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        r = result
        print(f"{r['model']} {r['src']} -> {r['dst']} on {r['world']} ranks: switch {r['switch_seconds']:.3f} s, "
              f"checkpoint {r['checkpoint_seconds']:.3f} s ({r['speedup']:.1f}x); {r['network_bytes'] / 2**20:.0f} MiB "
              f"in {r['rounds']} rounds at {r['achieved_gbps']:.2f} GB/s (raw p2p {r['p2p_gbps']:.2f} GB/s, "
              f"same messages replayed {r['replay_gbps']:.2f} GB/s); "
              f"bitexact {r['bitexact']}")
    return 0 if result["bitexact"] else 1


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on local ranks (one process each), with online layout switches")
    p.add_argument("--model", default=None,
                   help="a catalog name or a config.json (default: --init-from's config.json, else tiny-gpt)")
    p.add_argument("--layout", required=True, help="e.g. tp=2,pp=1,dp=2,zero=1")
    p.add_argument("--world", type=int, default=0, help="local processes (default: the largest layout's ranks)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--switch", action="append", metavar="STEP:LAYOUT",
                   help="switch to LAYOUT before step STEP+1 (repeatable; worlds may grow or shrink)")
    p.add_argument("--global-batch", type=int, default=8,
                   help="sequences per optimizer step, over all data-parallel ranks (default 8)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per step and data-parallel rank (default 2)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-style sequence parallelism with tp > 1 (llama-style models)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the sample order (default 0)")
    p.add_argument("--dataset", metavar="DIR", default=None,
                   help="a dataset directory (`dynaplane data prepare`); default: synthetic tokens")
    p.add_argument("--init-from", metavar="HF_DIR", default=None,
                   help="start from a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--export", metavar="HF_DIR", default=None,
                   help="write the final weights as a Hugging Face model directory")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="validation loss every N steps on the dataset's held-out split (default: never)")
    p.add_argument("--eval-batches", type=int, default=4, metavar="B",
                   help="global batches of the validation split each evaluation reads (default 4)")
    p.add_argument("--staging-mb", type=float, default=64.0,
                   help="memory each rank may stage in flight per switch round, MB (default 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a silent rank fails the run")
    p.add_argument("--json", action="store_true", help="print rank 0's steps and switches as JSON at the end")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from parallelism.training.cli import train_main

    return train_main(args)


def _add_emulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("emulate", help="predict step time, throughput and memory of a configuration at any scale")
    p.add_argument("--model", required=True, help="catalog name (see `dynaplane models`) or path to a config.json")
    p.add_argument("--layout", required=True, help="the parallel layout, e.g. tp=8,pp=4,dp=2,zero=1")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", default="h100", help="a100, h100, h200, b200 or cpu")
    p.add_argument("--global-batch", type=int, required=True,
                   help="sequences per optimizer step, over all data-parallel ranks")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recomputation: none, selective (attention core) or full (every layer)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-style sequence parallelism with tp > 1 (llama-style models)")
    p.add_argument("--attention", default="flash", choices=("flash", "unfused"),
                   help="attention kernels: fused flash (the program's), or unfused core attention as "
                        "Megatron-LM ran it before FlashAttention (s x s scores through memory)")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on the attention probabilities (--attention unfused; Megatron's default 0.1)")
    p.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout on the residual stream, in the bias-dropout-add kernels (Megatron's default 0.1)")
    p.add_argument("--grad-sync", default="program", choices=("program", "step", "overlapped"),
                   help="when data-parallel gradients are reduced: as the program does, after the last backward, "
                        "or in 25 MB buckets through the backward (PyTorch DDP, FSDP)")
    p.add_argument("--grad-accumulation", default="program", choices=("program", "fused"),
                   help="micro-batch gradients added in a pass of their own (the program), or fused into the "
                        "weight-gradient GEMMs (Megatron-LM's --gradient-accumulation-fusion)")
    p.add_argument("--pipeline-p2p", default="program", choices=("program", "megatron"),
                   help="pipeline sends: asynchronous (the program), or Megatron-LM's synchronous exchange with "
                        "the scatter-gather optimization")
    p.add_argument("--optimizer", default="program", choices=("program", "megatron"),
                   help="the optimizer step's kernels: the program's foreach AdamW, or Megatron-LM's mixed-precision "
                        "optimizer with apex's fused Adam (one pass per kernel)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="the linear layers' GEMMs: bf16, or fp8 as Transformer Engine and torchao run them (casts "
                        "with transposes, FP8 weight copies; attention, the LM head and routers stay bf16); "
                        "fp8 needs h100, h200 or b200")
    p.add_argument("--fp8-casts", default="separate", choices=("separate", "fused"),
                   help="with --precision fp8: casts as kernels of their own, or fused as Transformer Engine runs "
                        "them (norms and the activation write FP8, a weight cast once a step)")
    p.add_argument("--elementwise", default="program", choices=("program", "fused"),
                   help="a decoder layer's element-wise kernels: the program's eager ones, or Transformer Engine's "
                        "fused norms, RoPE, activation and residual adds (dense decoders)")
    p.add_argument("--param-gather", default="step", choices=("step", "overlapped"),
                   help="ZeRO-1/2's parameter all-gathers: after the optimizer (the program), or beside the next "
                        "step's first forward (Megatron-Core's overlap_param_gather)")
    p.add_argument("--memory-model", default="program", choices=("program", "megatron-core"),
                   help="what the run keeps in memory: the program's eager activations and fp32 gradient buffers, or "
                        "Megatron-Core's (per-layer activations from its saved tensors, bf16 main gradients)")
    p.add_argument("--stack", default="program", choices=("program", "megatron-core", "megatron-lm-2021"),
                   help="the program the run used; it sets the options above that are left at their defaults: "
                        "megatron-core (NeMo 2.0 / Megatron-Bridge with Transformer Engine: overlapped distributed "
                        "optimizer, fused accumulation, Megatron's optimizer, fused element-wise kernels, its "
                        "memory), "
                        "megatron-lm-2021 (unfused attention, dropout 0.1, synchronous pipeline exchange, Megatron's "
                        "optimizer)")
    p.add_argument("--fp8-scaling", default="delayed", choices=("delayed", "current"),
                   help="with --precision fp8: delayed (Transformer Engine's default: amax history, one all-reduce "
                        "a forward) or current (torchao's default: an amax pass before each cast)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: tensor-parallel groups stay within one (default 8)")
    p.add_argument("--profile", help="a calibrated device profile (JSON) instead of --gpu's built-in one")
    p.add_argument("--no-cache", action="store_true", help="trace again even when a cached trace exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_emulator_command("emulate_main"))


def _add_compare_and_search(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True, help="catalog name (see `dynaplane models`) or path to a config.json")
        p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
        p.add_argument("--gpu", default="h100", help="a100, h100, h200, b200 or cpu")
        p.add_argument("--global-batch", type=int, required=True,
                       help="sequences per optimizer step, over all data-parallel ranks")
        p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
        p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                       help="activation recomputation: none, selective (attention core) or full (every layer)")
        p.add_argument("--sequence-parallel", action="store_true",
                       help="Megatron-style sequence parallelism with tp > 1 (llama-style models)")
        p.add_argument("--gpus-per-node", type=int, default=8,
                       help="GPUs per node: tensor-parallel groups stay within one (default 8)")
        p.add_argument("--profile", help="a calibrated device profile (JSON)")
        p.add_argument("--stack", default="program", choices=("program", "megatron-core", "megatron-lm-2021"),
                       help="the program every configuration runs (see `dynaplane emulate --help`)")
        p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                       help="the linear layers' GEMMs: bf16 or fp8 (h100, h200, b200)")
        p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("compare", help="emulate several layouts side by side")
    common(p)
    p.add_argument("--layout", action="append", required=True, help="repeat for each layout to compare")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.set_defaults(func=_emulator_command("compare_main"))
    p = sub.add_parser("search", help="feasible layouts for a GPU count, ranked by predicted throughput")
    common(p)
    p.add_argument("--top", type=int, default=5, help="how many of the fastest fitting layouts to print (default 5)")
    p.add_argument("--max-candidates", type=int, default=24, help="emulate at most this many layouts")
    p.set_defaults(func=_emulator_command("search_main"))


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine as an emulator device profile (--profile)")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--ranks", type=int, default=2, help="ranks that will share this machine (measured at once); "
                                                        "with --device cuda one per GPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="measure the CPU (default) or this machine's CUDA GPUs (NCCL between --ranks GPUs)")
    p.add_argument("--passes", type=int, default=None,
                   help="passes over all measurements, each point their median (default 3; --quick 1)")
    p.add_argument("--merge", nargs="+", metavar="PROFILE",
                   help="measure nothing: write the median of these calibrations of this machine, taken at "
                        "other times (a shared host's speed wanders for minutes)")
    p.add_argument("--quietest", action="store_true",
                   help="with --merge: keep the one calibration taken while the machine ran fastest (its "
                        "least disturbed window) instead of the median")
    p.add_argument("--quick", action="store_true",
                   help="a rough profile in a fraction of the time (fewer shapes, sizes and repeats)")
    p.add_argument("--model", help="also time the GEMMs and attentions of this model's traced steps at their "
                                   "own shapes (with --layout)")
    p.add_argument("--layout", action="append", default=[], help="a layout of --model to trace (repeatable)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of the traced steps")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size of the traced steps")
    p.add_argument("--global-batch", type=int, default=0,
                   help="global batch of the traced steps (default: one micro-batch per dp rank)")
    p.set_defaults(func=_emulator_command("calibrate_main"))  # it traces and runs ranks too


def _emulator_command(name: str):
    """The parallelism.emulator.cli function `name`, run after starting the tracer's process server.

    A trace forks its stage-class processes from a server that imports torch first (2-4 s);
    started here, before this process imports torch itself, the two imports overlap on two
    cores instead of following each other. With a cached trace the server is never used
    and exits with this process."""
    def run(args: argparse.Namespace) -> int:
        from parallelism.engine.launch import rank_context

        rank_context()
        import parallelism.emulator.cli

        return getattr(parallelism.emulator.cli, name)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynaplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_agent(sub)
    from dynaplane.layout_commands import add_commands

    add_commands(sub)
    _add_bench(sub)
    _add_train(sub)
    from dynaplane.data_commands import add_data_commands

    add_data_commands(sub)
    from dynaplane.export_command import add_export_command

    add_export_command(sub)
    from dynaplane.token_commands import add_token_commands

    add_token_commands(sub)
    from dynaplane.hosts_command import add_parser as add_hosts_command

    add_hosts_command(sub)
    _add_emulate(sub)
    _add_compare_and_search(sub)
    _add_calibrate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
