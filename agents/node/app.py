"""The agent's Celery app: consumes node.<name> and emulate; never imports Django."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from celery import Celery, signals
from kombu.exceptions import OperationalError

from agents import protocol
from agents.seal import AGENT_KEY_ENV, Seal, SealError, seal, seal_read, seal_valid
from agents.celery_consumer import CONSUMER
from agents.runtime.outbox import Outbox
from agents.node.config import AgentConfig
from agents.node.emulation_slots import RETRY_SECONDS, EmulationSlots, pool_size
from agents.node.heartbeat import HeartbeatSender
from agents.node.jobs import JobRunner
from agents.node.preflight import run_preflight
from agents.node.inventory import discover

log = logging.getLogger(__name__)


def build_app(config: AgentConfig, emulation_slots: int = 1) -> tuple[Celery, HeartbeatSender]:
    """The app with the agent's tasks registered, and its (not yet started) heartbeats.
    At most `emulation_slots` emulations run at once (agents/node/emulation_slots.py)."""
    app = Celery(f"agent-{config.name}", broker=config.broker_url, set_as_current=True)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_default_queue=config.queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        worker_prefetch_multiplier=1,
        worker_consumer=CONSUMER,  # back within a second of the broker (agents/celery_consumer.py)
        broker_connection_max_retries=None,  # however long the broker is away (Celery's default: 100 tries)
    )
    gpus = discover(config.device, config.gpus, config.virtual_gpu_memory_bytes)
    heartbeats = HeartbeatSender(config, gpus)
    def publish(task: str, report: protocol.JobReport | protocol.TransitionReport | protocol.PreflightReport) -> None:
        body = report.model_dump(mode="json")
        app.send_task(task, args=[body], kwargs={"seal": seal(config.key, config.name, task, body)},
                      queue=protocol.CONTROL_QUEUE, retry=False)

    # What the agent says of its jobs' ranks (a rank exited, stopped, ...) waits out a broker
    # outage in order, as rank 0's reports do; the runner's threads never block or fail on it.
    reports = Outbox(publish, name=f"agent {config.name} reports")

    def send_report(report: protocol.JobReport | protocol.TransitionReport) -> None:
        task = (protocol.CONTROL_TRANSITION_REPORT if isinstance(report, protocol.TransitionReport)
                else protocol.CONTROL_JOB_REPORT)
        reports.put(task, report)

    def send_log(tail: protocol.JobLogTail) -> None:
        try:  # (from the runner's supervisor thread: a broker outage must not stop it watching the ranks)
            body = tail.model_dump(mode="json")
            app.send_task(protocol.CONTROL_JOB_LOG, args=[body],
                          kwargs={"seal": seal(config.key, config.name, protocol.CONTROL_JOB_LOG, body)},
                          queue=protocol.CONTROL_QUEUE, expires=60)  # a newer tail follows; an old one can go
        except (OperationalError, OSError) as exc:
            log.warning("log tail of job %d not sent: %s", tail.job_id, exc)

    runner = JobRunner(send_report, config.name, config.device, config.broker_url, _run_root(config),
                       send_log=send_log, env={AGENT_KEY_ENV: config.key.encode()} if config.key else None)
    emulating: set[int] = set()  # emulation runs this agent is working on
    heartbeats.live = lambda: (runner.running(), tuple(emulating))
    slots = EmulationSlots(emulation_slots)

    def working_on(task: str, order: dict, run) -> None:
        run_id = int(order.get("run_id", 0))

        def work() -> None:
            emulating.add(run_id)
            try:
                run(app, config, order)
            finally:
                emulating.discard(run_id)

        def requeue() -> None:
            log.info("emulation run %d: every slot busy here; back to the %s queue", run_id, protocol.EMULATE_QUEUE)
            app.send_task(task, args=[order], queue=protocol.EMULATE_QUEUE, countdown=RETRY_SECONDS)

        slots.run_or_requeue(work, requeue)

    @app.task(name=protocol.NODE_PING)
    def ping() -> dict:
        """Answer with the node's current report (used to check a node end to end)."""
        from agents.node.heartbeat import build_heartbeat

        return build_heartbeat(config, gpus, heartbeats.live).model_dump(mode="json")

    @app.task(name=protocol.EMULATE_RUN)
    def emulate_run(order: dict) -> None:
        """Emulate one configuration (parallelism/emulator) and report progress and the result to
        the control plane. Tracing runs in child processes; this thread only waits."""
        working_on(protocol.EMULATE_RUN, order, run_emulation)

    @app.task(name=protocol.EMULATE_SEARCH)
    def emulate_search(order: dict) -> None:
        """Rank the layouts worth emulating for one setting (the compare page's "top K
        from search") and report them as the run's result."""
        working_on(protocol.EMULATE_SEARCH, order, run_search)

    def ordered(task: str, order: dict, received: dict | None) -> bool:
        """Whether the control plane sealed `order` for this node with this agent's key."""
        why = order_refusal(config, task, order, received)
        if why is not None:
            log.warning("refused %s (job %r): %s", task, order.get("job_id"), why)
        return why is None

    # Orders are carried out only under the control plane's seal made with this agent's key
    # (agents/seal.py): a process that reaches the broker cannot order this node about.
    @app.task(name=protocol.NODE_JOB_START)
    def job_start(order: dict, seal: dict | None = None) -> None:
        """Start this node's ranks of a job (returns at once; the runner watches them)."""
        if ordered(protocol.NODE_JOB_START, order, seal):
            runner.start(protocol.JobStartOrder.model_validate(order))

    @app.task(name=protocol.NODE_JOB_SWITCH)
    def job_switch(order: dict, seal: dict | None = None) -> None:
        """Start the ranks joining a job here and tell its local ranks about the switch."""
        if ordered(protocol.NODE_JOB_SWITCH, order, seal):
            runner.switch(protocol.JobSwitchOrder.model_validate(order))

    @app.task(name=protocol.NODE_JOB_SWITCH_CANCEL)
    def job_switch_cancel(order: dict, seal: dict | None = None) -> None:
        """Abandon a switch that has not started moving state."""
        if ordered(protocol.NODE_JOB_SWITCH_CANCEL, order, seal):
            runner.cancel(protocol.JobSwitchCancel.model_validate(order))

    @app.task(name=protocol.NODE_JOB_RECOVER)
    def job_recover(order: dict, seal: dict | None = None) -> None:
        """Ranks lost: this node's ranks that outlived their world form the survivors' one."""
        if ordered(protocol.NODE_JOB_RECOVER, order, seal):
            runner.recover(protocol.JobRecoverOrder.model_validate(order))

    @app.task(name=protocol.NODE_JOB_STOP)
    def job_stop(order: dict, seal: dict | None = None) -> None:
        if ordered(protocol.NODE_JOB_STOP, order, seal):
            runner.stop(protocol.JobStopOrder.model_validate(order))

    @app.task(name=protocol.NODE_PREFLIGHT)
    def preflight(order: dict, seal: dict | None = None) -> None:
        """Check this host with the order's other nodes before a start or a grow (its own thread:
        it waits for them up to the order's timeout); the report waits out a broker outage."""
        if not ordered(protocol.NODE_PREFLIGHT, order, seal):
            return
        parsed = protocol.PreflightOrder.model_validate(order)
        if config.name not in parsed.nodes:
            log.warning("refused pre-flight %d of job %d: node %s is not one of its nodes", parsed.preflight_id,
                        parsed.job_id, config.name)
            return

        def check() -> None:
            report = run_preflight(parsed, config.name)
            log.info("pre-flight %d of job %s: %s in %.1f s", parsed.preflight_id, parsed.job_name,
                     "passed" if report.ok else "; ".join(f"{c.name}: {c.detail}" for c in report.checks if not c.ok),
                     report.seconds)
            reports.put(protocol.CONTROL_PREFLIGHT_REPORT, report)

        threading.Thread(target=check, name=f"preflight-{parsed.preflight_id}", daemon=True).start()

    @signals.worker_ready.connect(weak=False)
    def _start_heartbeats(sender=None, **_: object) -> None:
        log.info("agent %s ready on %s with %d %s device(s)", config.name, config.queue, len(gpus), config.device)
        heartbeats.start()
        if not _loopback(config.host):  # other hosts reach it: its pre-flights will meet theirs
            threading.Thread(target=_preload_preflight_meeting, name="preload-torch", daemon=True).start()

    @signals.worker_shutting_down.connect(weak=False)
    def _stop_heartbeats(**_: object) -> None:
        heartbeats.stop()
        runner.shutdown()

    return app, heartbeats


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def _preload_preflight_meeting() -> None:
    """Load torch now, beside the agent's work, so that the first pre-flight across hosts does
    not wait seconds for it while the other nodes wait on this one."""
    started = time.perf_counter()
    import agents.runtime.preflight_meeting  # noqa: F401

    log.info("torch loaded for pre-flights in %.1f s", time.perf_counter() - started)


def order_refusal(config: AgentConfig, task: str, order: dict, received: object) -> str | None:
    """Why this agent refuses an order (None: sealed for this node with its key)."""
    if config.key is None:
        return "this agent has no key (start it with --token): it takes no orders"
    try:
        parsed: Seal = seal_read(received)
    except SealError as exc:
        return str(exc)
    if parsed.node != config.name or parsed.key_id != config.key.key_id:
        return f"sealed for node {parsed.node} with key {parsed.key_id}, not for {config.name} with {config.key.key_id}"
    if not seal_valid(config.key.secret, parsed, task, order):
        return "the seal does not match the order (forged or altered)"
    return None


def _run_root(config: AgentConfig) -> Path:
    """Where rank processes keep their order, logs and stop file: the stack's var dir."""
    base = Path(os.environ.get("DYNAPLANE_VAR_DIR") or Path(tempfile.gettempdir()) / "dynaplane")
    return base / "agents" / config.name / "jobs"


def run(config: AgentConfig, emulation_slots: int = 1, loglevel: str = "INFO") -> None:
    """Run the agent until it is told to stop (SIGTERM or Ctrl-C)."""
    app, _ = build_app(config, emulation_slots)
    app.worker_main(
        [
            "worker",
            "--queues", f"{config.queue},{protocol.EMULATE_QUEUE}",
            "--hostname", f"agent@{config.name}",
            "--pool", "threads",
            "--concurrency", str(pool_size(emulation_slots)),
            "--loglevel", loglevel,
            "--without-mingle",
            "--without-gossip",
        ]
    )


def _progress_sender(app: Celery, config: AgentConfig, run_id: int):
    def report(**fields: object) -> None:
        body = protocol.EmulationProgress(run_id=run_id, agent=config.name, **fields).model_dump(mode="json")
        app.send_task(protocol.CONTROL_EMULATION_PROGRESS, args=[body], queue=protocol.CONTROL_QUEUE,
                      kwargs={"seal": seal(config.key, config.name, protocol.CONTROL_EMULATION_PROGRESS, body)})

    return report


def run_emulation(app: Celery, config: AgentConfig, order: dict) -> None:
    parsed = protocol.EmulationOrder.model_validate(order)
    report = _progress_sender(app, config, parsed.run_id)
    started = time.perf_counter()
    report(state="running", message="tracing")
    from parallelism.emulator.emulate import EmulateRequest, emulate  # torch: loaded only when an emulation runs

    def work():  # the request resolves its model when made: an unknown one is this run's failure
        request = EmulateRequest(model=parsed.model, layout=parsed.layout, gpus=parsed.gpus, gpu=parsed.gpu,
                                 global_batch=parsed.global_batch, micro_batch=parsed.micro_batch, seq=parsed.seq,
                                 recompute=parsed.recompute, gpus_per_node=parsed.gpus_per_node)
        return emulate(request, progress=lambda line: report(state="running", message=line[:500]))

    _report_outcome(report, parsed.run_id, started, work)


def run_search(app: Celery, config: AgentConfig, order: dict) -> None:
    parsed = protocol.SearchOrder.model_validate(order)
    report = _progress_sender(app, config, parsed.run_id)
    started = time.perf_counter()
    report(state="running", message=f"ranking the layouts of {parsed.model} on {parsed.gpus} GPUs")
    from parallelism.emulator.search_candidates import search_candidates  # torch: loaded only when a search runs

    _report_outcome(report, parsed.run_id, started, lambda: search_candidates(
        model=parsed.model, gpus=parsed.gpus, gpu=parsed.gpu, global_batch=parsed.global_batch,
        micro_batch=parsed.micro_batch, seq=parsed.seq, top=parsed.top, recompute=parsed.recompute,
        gpus_per_node=parsed.gpus_per_node))


def _report_outcome(report, run_id: int, started: float, work) -> None:
    """Run `work` and report its result as done, or its error as failed."""
    from parallelism.emulator.errors import EmulatorError

    try:
        result = work()
    except EmulatorError as exc:
        report(state="failed", error=str(exc)[:4000], wall_seconds=time.perf_counter() - started)
        return
    except Exception as exc:  # an emulator bug: the run must not stay "running" forever
        log.exception("emulation %d failed", run_id)
        report(state="failed", error=f"internal error: {type(exc).__name__}: {exc}"[:4000],
               wall_seconds=time.perf_counter() - started)
        return
    report(state="done", result=result, wall_seconds=time.perf_counter() - started)
