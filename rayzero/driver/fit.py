"""`rayzero.fit` in six named steps, each a function below, called in order by `fit`: validate the
config, locate the run (run_location.py), locate the cluster, start the controller, stream its
progress, collect the result."""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayzero.checkpoint.retention import claim_run_lineage
from rayzero.config.environment import (
    ATTEMPT,
    CHECKPOINT_DIR,
    COLLECTIVE_TIMEOUT_S,
    CONFIG,
    CONTROL_HOST,
    CONTROL_SERVICE_VARIABLES,
    RESUME_FROM,
    RUN,
    RUN_LINEAGE,
    RunHandoff,
)
from rayzero.config.errors import RayZeroValueError
from rayzero.config.loader import logged_notes
from rayzero.config.run_settings import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller import committed_checkpoints
from rayzero.controller.controller import Controller, ControllerActor, ControllerSettings, ControllerUpdate
from rayzero.controller.elastic import BatchPlan, plan_batches
from rayzero.controller.errors import TrainingFailedError
from rayzero.controller.failures import FailurePolicy
from rayzero.controller.health import HangPolicy, Straggler
from rayzero.controller.states import RunState
from rayzero.controller.worker_group import RayWorkerGroup, draining_nodes, free_worker_slots
from rayzero.driver.cluster import Connection, check_fits, connect
from rayzero.driver.config_check import validated_config
from rayzero.driver.metrics_log import MetricsLog
from rayzero.driver.metrics_store import read_goodput
from rayzero.driver.progress import Progress, goodput_line
from rayzero.driver.run_location import RunLocation, locate_run
from rayzero.driver.say import say
from rayzero.driver.scripts import prepare_script, script_environment
from rayzero.driver.shipping import ship
from rayzero.driver.signals import StopSignals
from rayzero.workers.script import ScriptTarget


@dataclass
class Result:
    """What a finished run leaves behind."""

    metrics_history: Sequence[dict[str, Any]]
    """Every dict rank 0 passed to `rayzero.report` in this call, in order, a re-run step once (its
    newest report); read from the run's metrics.parquet when first used ([Note: metrics in parts])."""
    metrics: dict[str, Any] | None
    """The last of them (None if rank 0 never reported)."""
    checkpoint: str | None
    """The newest checkpoint: the last one reported, else the run's checkpoint dir if it has one."""
    path: str
    """URI of the run's storage directory (metrics.parquet, checkpoints/)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Start-up phases and throughput in seconds / per second, e.g. `fit_to_first_report_s`."""
    metrics_path: str | None = None
    """URI of the Parquet metrics log (every rank's reports)."""
    stopped: bool = False
    """The run ended through a planned stop (Ctrl-C/SIGTERM, `rayzero stop`), its checkpoint committed;
    run `fit` again with the same name and storage to go on from it."""
    failures: int = 0
    """Restarts charged to `FailureConfig.max_failures` (crash, hang, node loss)."""
    checkpoint_step: int | None = None
    """Step of the newest committed checkpoint the controller found (None when there is none)."""
    stragglers: list[Straggler] = field(default_factory=list)
    """Ranks found persistently slower than the others, each once per streak ([Note: stragglers])."""
    goodput: dict[str, Any] = field(default_factory=dict)
    """`goodput` (kept training time / wall time, over every call of this run name), `wall_s`,
    `productive_s`, `badput_s` by cause and per attempt ([Note: goodput accounting])."""



def fit(
    train_loop: Callable[..., Any],
    config: Any = None,
    *,
    scaling: ScalingConfig | None = None,
    run: RunConfig | None = None,
    failure: FailureConfig | None = None,
    train_loop_config: dict[str, Any] | None = None,
    datasets: Mapping[str, Any] | None = None,
    trainer: Mapping[str, Any] | None = None,
) -> Result:
    """Run `train_loop(train_loop_config)` on `scaling.num_workers` Ray actors forming one process group,
    or with a `rayzero.Script(...)` run that script as `__main__` on each of them, as torchrun would
    ([Note: scripts on workers]; `config` then optional, `train_loop_config` unused).

    `config` is the run's DeepSpeed config (JSON path, dict or RayZeroConfig); it is validated here,
    before any worker starts, and `rayzero.initialize(model=...)` without `config=` uses it.
    `trainer` holds HF `TrainingArguments` values the config's "auto"s take (HF's defaults for the rest).
    Raises `TrainingFailedError` (naming the failing rank, with its traceback) if the run fails.
    """
    fit_started_wall, fit_started = time.time(), time.monotonic()
    scaling, run, failure = scaling or ScalingConfig(), run or RunConfig(), failure or FailureConfig()
    job = _validate(train_loop, config, scaling, train_loop_config, trainer)
    where = locate_run(run, job.node_local)
    shipped_loop, connection = _locate_cluster(job.train_loop, scaling)
    timings = {"connect_s": time.monotonic() - fit_started}
    controller = _start_controller(job, where, scaling, failure, shipped_loop, train_loop_config, datasets,
                                   connection, fit_started_wall)
    progress, metrics_log, streamed = _stream_progress(controller, job, where, scaling, run, failure, timings,
                                                       fit_started_wall)
    timings["total_s"] = time.monotonic() - fit_started
    return _collect_result(streamed, progress, metrics_log, where, timings, job)


@dataclass(frozen=True)
class _ValidatedJob:
    """What `fit` checked before it touches storage or Ray."""

    train_loop: Any
    """The loop, or a Script's launcher (`prepare_script`); shipped later."""
    script: bool
    plan: BatchPlan
    """The world sizes the run may take and each one's batch keys ([Note: elastic batch])."""
    ds_config: dict[str, Any] | None
    """The DeepSpeed config the workers get, per world size through `plan.config_for`."""
    validated: dict[str, Any]
    """The validated config as DeepSpeed's dict: what the driver itself reads from it."""
    trainer: Mapping[str, Any] | None
    """HF trainer arguments the "auto"s take."""

    @property
    def node_local(self) -> bool:
        return bool((self.validated.get("checkpoint") or {}).get("use_node_local_storage"))


def _validate(train_loop: Any, config: Any, scaling: ScalingConfig, train_loop_config: dict[str, Any] | None,
              trainer: Mapping[str, Any] | None) -> _ValidatedJob:
    """Step 1: the config for every world size the run may take, and a Script's arguments."""
    raw = _raw_config(config)
    plan = _batch_plan(raw, scaling)
    first_size = plan.choose(None) or scaling.max_workers
    script = isinstance(train_loop, ScriptTarget)
    if script:  # checked before anything starts
        if train_loop_config is not None:
            raise RayZeroValueError("a Script takes its arguments as Script(path, args=[...]), not train_loop_config")
        train_loop = prepare_script(train_loop, first_size)
    elastic_batch = bool(((raw or {}).get("elasticity") or {}).get("enabled"))
    # An elastic run is validated with the batch keys of its largest size ([Note: elastic batch]).
    to_check = plan.config_for(raw, first_size) if scaling.elastic or elastic_batch else config
    # a script's trainer (HF, Accelerate) fills the "auto"s no fact given here resolves
    ds_config, validated, trainer = validated_config(to_check, first_size, trainer, allow_unresolved=script)
    return _ValidatedJob(train_loop, script, plan, ds_config, validated, trainer)


def _locate_cluster(train_loop: Any, scaling: ScalingConfig) -> tuple[Any, Connection]:
    """Step 3 (after locating the run, run_location.py): ship the loop ([Note: shipping the loop];
    before Ray starts, so a failure is quick), join or start Ray ([Note: joining only when asked] in
    cluster.py) and check that the cluster can ever hold the run."""
    working_dir = getattr(train_loop, "working_dir", None)  # a `rayzero run file.py:fn` target's directory
    shipped_loop = ship(train_loop)
    connection = connect(working_dir)
    check_fits(scaling, connection)
    return shipped_loop, connection


def _worker_environment(job: _ValidatedJob, where: RunLocation, failure: FailureConfig) -> dict[str, str]:
    """What every worker of every attempt finds in its environment (the controller adds the attempt,
    the config for its size and the resume point)."""
    handoff = RunHandoff(
        name=where.name,
        storage=where.uri,
        resuming=where.rerun,  # get_context().resuming: a rerun under the same name
        node_local_checkpoints=job.node_local,  # [Note: node-local runs]
        trainer=dict(job.trainer) if job.trainer else None,  # HF trainer arguments for "auto"s
        notes_shown=tuple(logged_notes()),  # [Note: config notes once]
    )
    run_env = {
        RUN.name: handoff.to_text(),  # [Note: environment variables]
        CHECKPOINT_DIR.name: where.checkpoint_dir,
        # the engine's own bound for groups it creates (e.g. the checkpoint writer's)
        COLLECTIVE_TIMEOUT_S.name: str(failure.process_group_timeout_s),
        # one per run name, every invocation and attempt: retention rotates this run's checkpoints
        # and never another run's ([Note: retention owns only its own] in checkpoint/retention.py)
        RUN_LINEAGE.name: claim_run_lineage(where.uri),
    }
    if job.script:
        run_env.update(script_environment(failure))
    return run_env


def _start_controller(job: _ValidatedJob, where: RunLocation, scaling: ScalingConfig, failure: FailureConfig,
                      shipped_loop: Any, train_loop_config: dict[str, Any] | None,
                      datasets: Mapping[str, Any] | None, connection: Connection, started_wall: float) -> Any:
    """Step 4: the controller actor, on the driver's node, which builds each attempt's worker group."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run_env = _worker_environment(job, where, failure)
    datasets = dict(datasets or {})
    checkpoint = job.validated.get("checkpoint") or {}
    durable_uri = checkpoint.get("durable_uri")
    settings = ControllerSettings(
        hang=HangPolicy(failure.hang_timeout_s, failure.startup_grace_s),
        stop_timeout_s=failure.stop_timeout_s,
        checkpoint_locations=(where.checkpoint_dir, *([durable_uri] if durable_uri else [])),
        node_local=job.node_local,
        goodput_before=read_goodput(where.uri),  # a rerun goes on counting ([Note: goodput accounting])
        started_wall=started_wall,
        checkpoint_interval=checkpoint.get("interval"),
        **({"failures_per_node_day": checkpoint["failures_per_node_day"]}
           if checkpoint.get("failures_per_node_day") else {}),
    )
    # What the closure below takes into the controller actor: plain values and the shipped loop,
    # never `job` (its loop is not shipped).
    plan, ds_config, resume_from = job.plan, job.ds_config, where.resume_from

    def make_controller() -> Controller:  # runs inside the controller actor
        def make_group(attempt: int, resume: str | None, workers: int) -> RayWorkerGroup:
            env = dict(run_env, **{ATTEMPT.name: str(attempt)})
            worker_config = plan.config_for(ds_config, workers)
            if worker_config is not None:
                env[CONFIG.name] = json.dumps(worker_config)
            if resume:
                env[RESUME_FROM.name] = resume
            group = RayWorkerGroup(scaling, workers, env, failure.process_group_timeout_s, datasets)
            if workers > plan.min_workers:
                # Above the minimum the size came from the free resources: if it does not place
                # quickly a node went away meanwhile, and the controller tries the next smaller size.
                group.placement_timeout_s = min(scaling.placement_timeout_s, 10.0)
            return group

        return Controller(
            make_group, shipped_loop, train_loop_config,
            FailurePolicy(failure.max_failures, failure.backoff_s, failure.max_failures_without_progress),
            resume_from=resume_from, plan=plan, capacity=lambda: free_worker_slots(scaling.bundle()),
            draining=draining_nodes,
            settings=settings,
        )

    # num_cpus=0: the controller only waits; it must not take a CPU a worker bundle needs. Pinned to
    # the driver's node: a lost worker node must not take the controller with it.
    # The control service's settings (host, port, TLS files) reach it in the controller actor; not
    # the token: a runtime env is readable through Ray's state API (the operator's pods have it in
    # the environment of every process on the head already).
    control_env = {variable.name: os.environ[variable.name] for variable in CONTROL_SERVICE_VARIABLES
                   if variable.name in os.environ}
    if connection.started:  # a Ray of one machine, started here: its control service stays on loopback
        control_env.setdefault(CONTROL_HOST.name, "127.0.0.1")
    return _create_controller_actor(ray.remote(ControllerActor).options(
        num_cpus=0, max_concurrency=8, name=controller_actor_name(where.name),
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        **({"runtime_env": {"env_vars": control_env}} if control_env else {}),
    ), make_controller, where.name, where.uri)


_Streamed = tuple[dict[str, Any] | None, str | None, TrainingFailedError | None, ControllerUpdate | None]
"""What `_stream` returns: rank 0's newest report, the last checkpoint reported, the error, the final update."""


def _stream_progress(controller: Any, job: _ValidatedJob, where: RunLocation, scaling: ScalingConfig,
                     run: RunConfig, failure: FailureConfig, timings: dict[str, float], started_wall: float,
                     ) -> tuple[Progress, MetricsLog, _Streamed]:
    """Step 5: progress lines and the metrics log from the controller's updates until the run ends;
    then the controller goes, and its workers with it."""
    import ray

    batch = job.validated.get("train_batch_size")
    progress = Progress(batch if isinstance(batch, int) else None, run.progress_interval_s,
                        bool(job.validated.get("wall_clock_breakdown")))
    progress.max_failures = failure.max_failures
    metrics_log = MetricsLog(where.uri)
    workers = str(scaling.num_workers) if not scaling.elastic else f"{scaling.min_workers}:{scaling.max_workers}"
    say(f"[rayzero] run {where.name}: {workers} worker(s), storage {where.uri}")
    try:
        streamed = _stream(controller, progress, metrics_log, timings, started_wall, failure.stop_timeout_s)
    finally:
        try:  # let a control call that ended the run (stop, kill) get its reply first
            ray.get(controller.quiesce.remote(2.0), timeout=5)
        except Exception as error:  # noqa: BLE001 - the controller may be gone already
            logging.getLogger("rayzero.driver").debug("controller quiesce: %s", error)
        ray.kill(controller)  # its workers and placement group go with it (fate sharing)
        if progress.goodput:
            metrics_log.goodput_rows(progress.goodput)
        metrics_log.close()
        if progress.goodput:
            say(f"[rayzero] {goodput_line(progress.goodput)}")
    return progress, metrics_log, streamed


def _collect_result(streamed: _Streamed, progress: Progress, metrics_log: MetricsLog, where: RunLocation,
                    timings: dict[str, float], job: _ValidatedJob) -> Result:
    """Step 6: the run's error raised, or its Result: the newest committed checkpoint (what the
    controller found, else what the loop reported, else a listing), metrics and timings."""
    last_metrics, last_checkpoint, error, final = streamed
    timings.update(progress.rates())
    if job.validated.get("wall_clock_breakdown"):
        print("[rayzero] wall clock breakdown: "
              + ", ".join(f"{key} {value:.2f}" for key, value in timings.items()), flush=True)
    if error is not None:
        raise error
    final_line = progress.final_line() if last_metrics is not None else None
    if final_line is not None:
        print(final_line, flush=True)
    checkpoint_dir = where.checkpoint_dir
    record = final.checkpoint if final is not None else None
    if record is not None:
        last_checkpoint = checkpoint_dir if record.location.startswith(checkpoint_dir) else record.location
    elif last_checkpoint is None:
        found = committed_checkpoints.newest([checkpoint_dir])
        last_checkpoint = found.root if found is not None else None
        record = found.record if found is not None else None
    stopped = bool(final and final.stopped)
    if stopped:
        where_saved = f"checkpoint {record.location} (step {record.step})" if record else "no checkpoint was taken"
        say(f"[rayzero] run {where.name} stopped: {where_saved}. Rerun with the same name ({where.name}) "
              "and storage to resume.")
    return Result(
        metrics_history=metrics_log.history(),
        metrics=last_metrics,
        checkpoint=last_checkpoint,
        path=where.uri,
        timings=timings,
        metrics_path=metrics_log.uri,
        stopped=stopped,
        failures=final.failures if final is not None else 0,
        checkpoint_step=record.step if record is not None else None,
        stragglers=list(final.stragglers) if final is not None else [],
        goodput=dict(progress.goodput or {}),
    )


def controller_actor_name(run_name: str) -> str:
    """The Ray actor name of a run's controller (in the driver's namespace): `ray.get_actor(...)`
    gives a `ControlTarget` ([Note: the control seam]) to code in the driver's job."""
    return f"rayzero-controller:{run_name}"


def _create_controller_actor(actor_options: Any, make_controller: Callable[[], Controller], name: str,
                             run_uri: str | None = None) -> Any:
    # A rerun of the same name right after the previous one ended: Ray frees the actor name only
    # once the old controller is marked dead (ray.kill is asynchronous), so wait a little for it.
    deadline = time.monotonic() + 15.0
    while True:
        try:
            return actor_options.remote(make_controller, name, run_uri)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def _raw_config(config: Any) -> dict[str, Any] | None:
    """The DeepSpeed config as a plain dict (what the batch plan reads), before validation."""
    if config is None:
        return None
    from rayzero.config import RayZeroConfig

    if isinstance(config, RayZeroConfig):
        return config.to_deepspeed_dict()
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    try:
        return json.loads(Path(config).read_text())
    except (OSError, ValueError):
        return None  # not readable here: validation names the problem


def _batch_plan(ds_config: dict[str, Any] | None, scaling: ScalingConfig) -> BatchPlan:
    plan = plan_batches(ds_config, scaling.min_workers, scaling.max_workers)
    if not plan.valid_sizes():
        reasons = "; ".join(f"{size}: {why}" for size, why in sorted(plan.skipped.items()))
        raise RayZeroValueError(
            f"no world size in ScalingConfig.num_workers={scaling.num_workers!r} keeps the global batch "
            f"({reasons}); change the range or train_batch_size / train_micro_batch_size_per_gpu")
    for size, why in sorted(plan.skipped.items()):
        say(f"[rayzero] world size {size} will not be used: {why}")
    return plan


def _stream(
    controller: Any, progress: Progress, metrics_log: MetricsLog, timings: dict[str, float], started_wall: float,
    stop_timeout_s: float,
) -> _Streamed:
    """Long-poll the controller until the run ends: (rank 0's newest report, last checkpoint, error,
    final update). Each report costs O(1) here ([Note: reporting never waits] in metrics_log.py).
    Ctrl-C / SIGTERM meanwhile are a planned stop ([Note: driver signals])."""
    import ray

    last_metrics: dict[str, Any] | None = None
    dropped_said = 0
    last_checkpoint: str | None = None
    with StopSignals() as signals:
        try:
            ray.get(controller.start.remote(), timeout=60)
            while True:
                received = signals.take()
                if received == 1:
                    say(f"[rayzero] {signals.name}: stopping at the next step boundary after a checkpoint "
                          "(send it again to kill the run without one)")
                    controller.stop.remote(stop_timeout_s)
                elif received > 1:
                    say(f"[rayzero] {signals.name} again: killing the run without a checkpoint")
                    controller.kill.remote(f"{signals.name} received twice on the driver")
                update: ControllerUpdate = ray.get(controller.poll.remote(1.0), timeout=60)
                progress.stragglers = sorted({found.rank for found in update.stragglers
                                              if found.attempt == update.attempt})
                for line in update.events:
                    say(f"[rayzero] {line}")
                for start in update.attempts:  # before the reports: an attempt begins before its first one
                    metrics_log.add_attempt(start)
                    progress.attempt_began(start)
                if update.goodput:
                    progress.goodput = update.goodput
                    metrics_log.set_goodput(update.goodput)
                if update.dropped_reports > dropped_said:
                    dropped_said = update.dropped_reports
                    say(f"[rayzero] metrics: the controller dropped {dropped_said} report(s) the driver did not "
                          "collect in time; training was not slowed")
                for item in update.reports:
                    if "fit_to_first_report_s" not in timings:
                        timings["fit_to_first_report_s"] = max(0.0, item.time - started_wall)
                    if item.rank == 0:
                        last_metrics = item.metrics
                    progress.observe(item)
                    metrics_log.add(item)
                    last_checkpoint = item.checkpoint or last_checkpoint
                if update.state.is_terminal:
                    timings.update(update.timings)
                    error = update.error if update.state is RunState.ERRORED else None
                    return last_metrics, last_checkpoint, error, update
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as died:
            return last_metrics, last_checkpoint, TrainingFailedError(f"the rayzero controller actor died: {died}"), None
