"""`dynaplane train`: local training with one process per rank and online switches."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict

from parallelism.engine.errors import EngineError
from parallelism.engine.launch import run_ranks
from parallelism.layout.errors import LayoutError
from parallelism.training.data import training_data
from parallelism.training.parallel import StepResult, TrainConfig, TrainingError
from parallelism.training.run import (EvalResult, SwitchReport, Switch, check_layout, check_schedule, parse_switch,
                                      train_rank, union_world)


def _print_progress(rank: int, event: StepResult | SwitchReport | EvalResult) -> None:
    """Rank 0 speaks for the run (it is in every layout)."""
    if rank != 0:
        return
    if isinstance(event, EvalResult):
        bits = event.loss / math.log(2)
        per_byte = f", {bits / event.bytes_per_token:.4f} bits per byte" if event.bytes_per_token else ""
        print(f"eval after step {event.step}: validation loss {event.loss:.4f} ({bits:.4f} bits per token"
              f"{per_byte})", flush=True)
        return
    if isinstance(event, StepResult):
        print(f"step {event.step:5d}  loss {event.loss:.4f}  {event.seconds * 1000:7.1f} ms  "
              f"{event.tokens / event.seconds:9.0f} tok/s", flush=True)
    else:
        print(f"switch before step {event.step + 1}: {event.src} -> {event.dst}: transfer {event.seconds:.3f} s, "
              f"{event.network_bytes / 2**20:.2f} MiB in {event.rounds} rounds, verified bit-exact "
              f"({event.verify_seconds:.3f} s); rank 0 peak {event.peak_bytes / 2**20:.2f} MiB "
              f"(planner {event.predicted_peak_bytes / 2**20:.2f} MiB)", flush=True)


def _rank(rank: int, world: int, config: TrainConfig, layout: str, steps: int, switches: list[Switch],
          staging_bytes: int, eval_every: int, eval_batches: int, init_from: str | None, export: str | None) -> dict:
    log = train_rank(rank, world, config, layout, steps, switches, staging_bytes, on_step=_print_progress,
                     eval_every=eval_every, eval_batches=eval_batches, init_from=init_from, export=export)
    return {"steps": [asdict(s) for s in log.steps], "switches": [asdict(s) for s in log.switches],
            "evals": [asdict(e) for e in log.evals]}


def _absolute(path: str | None) -> str | None:
    """An absolute path: every rank process opens the same directory whatever its working directory."""
    return os.path.abspath(path) if path else None


def train_main(args) -> int:
    try:
        switches = [parse_switch(s) for s in args.switch or []]
        check_schedule(args.steps, switches)
        init_from, export = _absolute(args.init_from), _absolute(args.export)
        model = args.model or (os.path.join(init_from, "config.json") if init_from else "tiny-gpt")
        config = TrainConfig(model=model, global_batch=args.global_batch, seq_len=args.seq,
                             micro_batches=args.micro_batches, seed=args.seed, lr=args.lr,
                             total_steps=max(args.steps, 1), sequence_parallel=args.sequence_parallel,
                             dataset=_absolute(args.dataset))
        for layout in [args.layout, *(s.layout for s in switches)]:
            check_layout(config, layout)
        needed = union_world(config, args.layout, switches)
        world = args.world or needed
        if world < needed:
            raise TrainingError(f"--world {world} is smaller than the {needed} ranks the layouts need")
        if args.steps < 0 or (args.steps == 0 and not (init_from and export)):
            raise TrainingError(f"--steps {args.steps}: train at least one step (0 only with --init-from and "
                                "--export: load and export unchanged)")
        if init_from:
            from parallelism.hf_weights.load import hf_model_config, check_same_model
            from parallelism.layout.catalog import model_from_config

            check_same_model(config.tensors, model_from_config(hf_model_config(init_from)),
                             os.path.join(init_from, "config.json"))
        if args.eval_every < 0 or args.eval_batches < 1:
            raise TrainingError(f"--eval-every {args.eval_every} must be >= 0 and --eval-batches "
                                f"{args.eval_batches} >= 1")
        if args.eval_every:
            if config.dataset is None:
                raise TrainingError("--eval-every needs --dataset: synthetic tokens have no validation split")
            training_data(config, "validation")
    except (TrainingError, LayoutError, KeyError, ValueError) as exc:  # DatasetError, HFWeightsError too
        print(f"dynaplane train: {exc}", file=sys.stderr)
        return 2
    print(f"training {config.model} on {world} local ranks: {args.layout}"
          + "".join(f", then {s.layout} at step {s.step}" for s in switches), flush=True)
    if config.dataset:
        print(f"data: {config.dataset}, seed {config.seed}", flush=True)
    try:
        ranks = run_ranks(world, _rank, config, args.layout, args.steps, switches,
                          int(args.staging_mb * 2**20), args.eval_every, args.eval_batches, init_from, export,
                          timeout_s=args.timeout)
    except EngineError as exc:
        print(f"dynaplane train: {exc}", file=sys.stderr)
        return 1
    if export:
        print(f"exported the weights after step {args.steps} to {export} (a Hugging Face model directory)", flush=True)
    if args.json:
        print(json.dumps(ranks[0], indent=2))
    return 0
