"""`rayzero.fit`: validate, connect to Ray, start the controller, stream reports, return a Result."""
from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from rayzero.checkpoint.retention import RUN_LINEAGE_ENV, claim_run_lineage
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.errors import RayZeroValueError
from rayzero.config.loader import NOTES_SHOWN_ENV, logged_notes
from rayzero.config.names import check_name
from rayzero.config.run_settings import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller import registry
from rayzero.controller.controller import Controller, ControllerActor, ControllerSettings, ControllerUpdate
from rayzero.controller.elastic import BatchPlan, plan_batches
from rayzero.controller.errors import TrainingFailedError
from rayzero.controller.health import HangPolicy, Straggler
from rayzero.controller.state import FailurePolicy, RunState
from rayzero.controller.worker_group import RayWorkerGroup, draining_nodes, free_worker_slots
from rayzero.driver.cluster import check_fits, connect
from rayzero.driver.config_check import validated_config
from rayzero.driver.metrics_log import MetricsLog
from rayzero.driver.progress import Progress
from rayzero.driver.scripts import prepare_script, script_environment
from rayzero.driver.shipping import ship
from rayzero.driver.signals import StopSignals
from rayzero.workers.boundary import CHECKPOINT_TIER_ENV, NODE_LOCAL_RESUME
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



def _run_locations(run: RunConfig) -> tuple[str, str, str, bool]:
    """(run name, run URI, checkpoint dir: a local path for file://, else a URI, whether the run's
    directory existed already: a rerun under the same name)."""
    name = check_name(run.name or f"rayzero-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}",
                      "RunConfig.name")  # [Note: names that become paths]; a RunConfig may be built unvalidated
    root = run.storage or os.environ.get("RAYZERO_STORAGE_ROOT") or Path.cwd().joinpath("runs").as_uri()
    if "://" not in root:  # a plain path is a local directory
        root = Path(root).resolve().as_uri()
    run_uri = f"{root.rstrip('/')}/{name}"
    filesystem, path = filesystem_from_uri(run_uri)
    try:
        existed = filesystem.get_file_info(path).type != pafs.FileType.NotFound
    except OSError:
        existed = False  # _check_writable names the trouble
    _check_writable(root, run_uri)
    checkpoint_dir = f"{path}/checkpoints" if run_uri.startswith("file://") else f"{run_uri}/checkpoints"
    return name, run_uri, checkpoint_dir, existed


def _check_writable(root: str, run_uri: str) -> None:
    """Create the run's directory and write a probe file there, before any worker starts: an
    unwritable `--storage` is named with its reason at once, not as a traceback from a worker."""
    probe = f"{filesystem_from_uri(run_uri)[1]}/.rayzero-write-probe-{secrets.token_hex(4)}"
    try:
        filesystem, path = filesystem_from_uri(run_uri)
        filesystem.create_dir(path, recursive=True)
        with filesystem.open_output_stream(probe) as stream:
            stream.write(b"rayzero checks that the run directory is writable\n")
        filesystem.delete_file(probe)
    except (OSError, ValueError, pa.ArrowException) as error:
        raise RayZeroValueError(
            f"storage {root!r} (RunConfig.storage / --storage): cannot write the run directory {run_uri}: "
            f"{error}. Give a location this machine and every node can write: a directory (./runs, "
            "file:///shared/runs) or an object store URI (s3://bucket/prefix) with its credentials set"
        ) from None


def resolve_resume_from(location: str | None, explicit: bool) -> str | None:
    """The checkpoint directory to hand the loop for a resume point given as any of:
    a checkpoint directory (holds `latest`), a run directory (`<storage>/<name>`, what the Kubernetes
    operator passes on a retried attempt: its `checkpoints/` is used) or a single checkpoint (holds
    `manifest.json`). A location with no committed checkpoint yet (an attempt that failed before its
    first save) means a fresh start, said on the driver. file:// becomes a local path, like
    RAYZERO_CHECKPOINT_DIR; other URIs stay URIs.
    """
    if not location:
        return None
    uri = location if "://" in location else Path(location).resolve().as_uri()
    filesystem, path = filesystem_from_uri(uri)

    def exists(relative: str) -> bool:
        target = f"{path.rstrip('/')}/{relative}" if relative else path
        return filesystem.get_file_info(target).type != pafs.FileType.NotFound

    def as_location(relative: str) -> str:
        base = path if uri.startswith("file://") else uri
        return f"{base.rstrip('/')}/{relative}" if relative else base

    for relative, marker in (("", "latest"), ("", "manifest.json"), ("checkpoints", "latest")):
        if exists(f"{relative}/{marker}" if relative else marker):
            return as_location(relative)
    if not exists("") and explicit:
        raise RayZeroValueError(
            f"RunConfig.resume_from / --resume-from = {location!r} does not exist; give a checkpoint "
            "directory (with `latest`), a run directory (<storage>/<name>) or one checkpoint"
        )
    print(f"[rayzero] resume point {location} holds no committed checkpoint yet: starting from scratch",
          flush=True)
    return None


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
    import ray

    fit_started_wall, fit_started = time.time(), time.monotonic()
    scaling, run, failure = scaling or ScalingConfig(), run or RunConfig(), failure or FailureConfig()
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
    name, run_uri, checkpoint_dir, rerun = _run_locations(run)
    explicit = run.resume_from or os.environ.get("RAYZERO_RESUME_FROM") or None
    resume_from = resolve_resume_from(explicit, explicit=bool(run.resume_from))
    node_local = bool((validated.get("checkpoint") or {}).get("use_node_local_storage"))
    if resume_from is None and explicit is None:
        resume_from = _resume_same_name(name, run_uri, checkpoint_dir, node_local)

    working_dir = getattr(train_loop, "working_dir", None)  # a `rayzero run file.py:fn` target's directory
    train_loop = ship(train_loop)  # [Note: shipping the loop]; before Ray starts: a failure is quick
    connection = connect(working_dir)
    check_fits(scaling, connection)
    timings = {"connect_s": time.monotonic() - fit_started}
    run_env = {
        "RAYZERO_RUN_NAME": name,
        "RAYZERO_STORAGE": run_uri,
        "RAYZERO_CHECKPOINT_DIR": checkpoint_dir,
        # the engine's own bound for groups it creates (e.g. the checkpoint writer's)
        "RAYZERO_COLLECTIVE_TIMEOUT_S": str(failure.process_group_timeout_s),
        # one per run name, every invocation and attempt: retention rotates this run's checkpoints
        # and never another run's ([Note: retention owns only its own] in checkpoint/retention.py)
        RUN_LINEAGE_ENV: claim_run_lineage(run_uri),
    }
    if trainer:
        run_env["RAYZERO_TRAINER"] = json.dumps(dict(trainer))  # HF trainer arguments for "auto"s
    if script:
        run_env.update(script_environment(failure))
    if rerun:
        run_env["RAYZERO_RESUMING"] = "1"  # get_context().resuming: a rerun under the same name
    run_env[NOTES_SHOWN_ENV] = json.dumps(logged_notes())  # [Note: config notes once]
    datasets = dict(datasets or {})
    locations = [checkpoint_dir] + ([validated["checkpoint"]["durable_uri"]]
                                    if (validated.get("checkpoint") or {}).get("durable_uri") else [])
    if node_local:
        run_env[CHECKPOINT_TIER_ENV] = "node_local"  # [Note: node-local runs]
    settings = ControllerSettings(
        hang=HangPolicy(failure.hang_timeout_s, failure.startup_grace_s),
        stop_timeout_s=failure.stop_timeout_s,
        checkpoint_locations=tuple(locations),
        node_local=node_local,
    )

    def make_controller() -> Controller:  # runs inside the controller actor
        def make_group(attempt: int, resume: str | None, workers: int) -> RayWorkerGroup:
            env = dict(run_env, RAYZERO_ATTEMPT=str(attempt))
            worker_config = plan.config_for(ds_config, workers)
            if worker_config is not None:
                env["RAYZERO_CONFIG"] = json.dumps(worker_config)
            if resume:
                env["RAYZERO_RESUME_FROM"] = resume
            group = RayWorkerGroup(scaling, workers, env, failure.process_group_timeout_s, datasets)
            if workers > plan.min_workers:
                # Above the minimum the size came from the free resources: if it does not place
                # quickly a node went away meanwhile, and the controller tries the next smaller size.
                group.placement_timeout_s = min(scaling.placement_timeout_s, 10.0)
            return group

        return Controller(
            make_group, train_loop, train_loop_config,
            FailurePolicy(failure.max_failures, failure.backoff_s, failure.max_failures_without_progress),
            resume_from=resume_from, plan=plan, capacity=lambda: free_worker_slots(scaling.bundle()),
            draining=draining_nodes,
            settings=settings,
        )

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the controller only waits; it must not take a CPU a worker bundle needs. Pinned to
    # the driver's node: a lost worker node must not take the controller with it.
    # RAYZERO_CONTROL_* (host, port, TLS files) reach the control service in the controller actor;
    # not the token: a runtime env is readable through Ray's state API (the operator's pods have it
    # in the environment of every process on the head already).
    control_env = {key: value for key, value in os.environ.items()
                   if key.startswith("RAYZERO_CONTROL_") and key != "RAYZERO_CONTROL_TOKEN"}
    if connection.started:  # a Ray of one machine, started here: its control service stays on loopback
        control_env.setdefault("RAYZERO_CONTROL_HOST", "127.0.0.1")
    controller = _start_controller(ray.remote(ControllerActor).options(
        num_cpus=0, max_concurrency=8, name=controller_actor_name(name),
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        **({"runtime_env": {"env_vars": control_env}} if control_env else {}),
    ), make_controller, name, run_uri)
    wall_clock_breakdown = bool(validated.get("wall_clock_breakdown"))
    batch = validated.get("train_batch_size")
    progress = Progress(batch if isinstance(batch, int) else None, run.progress_interval_s, wall_clock_breakdown)
    progress.max_failures = failure.max_failures
    metrics_log = MetricsLog(run_uri)
    workers = str(scaling.num_workers) if not scaling.elastic else f"{scaling.min_workers}:{scaling.max_workers}"
    print(f"[rayzero] run {name}: {workers} worker(s), storage {run_uri}", flush=True)
    try:
        last_metrics, last_checkpoint, error, final = _stream(controller, progress, metrics_log, timings,
                                                              fit_started_wall, failure.stop_timeout_s)
    finally:
        try:  # let a control call that ended the run (stop, kill) get its reply first
            ray.get(controller.quiesce.remote(2.0), timeout=5)
        except Exception as error:  # noqa: BLE001 - the controller may be gone already
            logging.getLogger("rayzero.driver").debug("controller quiesce: %s", error)
        ray.kill(controller)  # its workers and placement group go with it (fate sharing)
        metrics_log.close()
    timings["total_s"] = time.monotonic() - fit_started
    timings.update(progress.rates())
    if wall_clock_breakdown:
        print("[rayzero] wall clock breakdown: "
              + ", ".join(f"{key} {value:.2f}" for key, value in timings.items()), flush=True)
    if error is not None:
        raise error
    final_line = progress.final_line() if last_metrics is not None else None
    if final_line is not None:
        print(final_line, flush=True)
    record = final.checkpoint if final is not None else None
    if record is not None:
        last_checkpoint = checkpoint_dir if record.location.startswith(checkpoint_dir) else record.location
    elif last_checkpoint is None:
        found = registry.newest([checkpoint_dir])
        last_checkpoint = found.root if found is not None else None
        record = found.record if found is not None else None
    stopped = bool(final and final.stopped)
    if stopped:
        where = f"checkpoint {record.location} (step {record.step})" if record else "no checkpoint was taken"
        print(f"[rayzero] run {name} stopped: {where}. Rerun with the same name ({name}) and storage to resume.",
              flush=True)
    return Result(
        metrics_history=metrics_log.history(),
        metrics=last_metrics,
        checkpoint=last_checkpoint,
        path=run_uri,
        timings=timings,
        metrics_path=metrics_log.uri,
        stopped=stopped,
        failures=final.failures if final is not None else 0,
        checkpoint_step=record.step if record is not None else None,
        stragglers=list(final.stragglers) if final is not None else [],
    )


def controller_actor_name(run_name: str) -> str:
    """The Ray actor name of a run's controller (in the driver's namespace): `ray.get_actor(...)`
    gives a `ControlTarget` ([Note: the control seam]) to code in the driver's job."""
    return f"rayzero-controller:{run_name}"


def _start_controller(actor_options: Any, make_controller: Callable[[], Controller], name: str,
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
        print(f"[rayzero] world size {size} will not be used: {why}", flush=True)
    return plan


def _resume_same_name(name: str, run_uri: str, checkpoint_dir: str, node_local: bool) -> str | None:
    """A rerun with the same name and storage goes on from the run's newest committed checkpoint
    (Ray Train v2's contract), found through the checkpoint layer's manifests."""
    if node_local:  # the checkpoints are on the nodes' disks: each rank looks at its own
        filesystem, path = filesystem_from_uri(run_uri)
        if filesystem.get_file_info(f"{path}/metrics.parquet").type == pafs.FileType.NotFound:
            return None
        print(f"[rayzero] run {name} exists: resuming from the newest checkpoint on the nodes' disks", flush=True)
        return NODE_LOCAL_RESUME
    found = registry.newest([checkpoint_dir])
    if found is None:
        return None
    print(f"[rayzero] run {name} exists: resuming from its checkpoint {found.record.location} "
          f"(step {found.record.step})", flush=True)
    return found.root


def _stream(
    controller: Any, progress: Progress, metrics_log: MetricsLog, timings: dict[str, float], started_wall: float,
    stop_timeout_s: float,
) -> tuple[dict[str, Any] | None, str | None, TrainingFailedError | None, ControllerUpdate | None]:
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
                    print(f"[rayzero] {signals.name}: stopping at the next step boundary after a checkpoint "
                          "(send it again to kill the run without one)", flush=True)
                    controller.stop.remote(stop_timeout_s)
                elif received > 1:
                    print(f"[rayzero] {signals.name} again: killing the run without a checkpoint", flush=True)
                    controller.kill.remote(f"{signals.name} received twice on the driver")
                update: ControllerUpdate = ray.get(controller.poll.remote(1.0), timeout=60)
                progress.failures = update.failures
                progress.checkpoint_step = update.checkpoint.step if update.checkpoint is not None else None
                progress.stragglers = sorted({found.rank for found in update.stragglers
                                              if found.attempt == update.attempt})
                for line in update.events:
                    print(f"[rayzero] {line}", flush=True)
                for start in update.attempts:
                    metrics_log.add_attempt(start)
                if update.dropped_reports > dropped_said:
                    dropped_said = update.dropped_reports
                    print(f"[rayzero] metrics: the controller dropped {dropped_said} report(s) the driver did not "
                          "collect in time; training was not slowed", flush=True)
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
