"""`rayzero.fit`: validate, connect to Ray, start the controller, stream reports, return a Result."""
from __future__ import annotations

import datetime
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from rayzero.config.errors import RayZeroValueError
from rayzero.controller.configs import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller.controller import Controller, ControllerActor
from rayzero.controller.errors import TrainingFailedError
from rayzero.controller.state import FailurePolicy, RunState
from rayzero.controller.worker_group import RayWorkerGroup
from rayzero.driver.cluster import check_fits, connect
from rayzero.driver.config_check import validated_config
from rayzero.driver.metrics_log import MetricsLog
from rayzero.driver.progress import Progress
from rayzero.driver.shipping import ship


@dataclass
class Result:
    """What a finished run leaves behind."""

    metrics_history: list[dict[str, Any]]
    """What rank 0 passed to `rayzero.report`, one dict per step: a step re-run after a restart keeps
    only its newest report (reports without a `step` key are all kept), in order."""
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


def _run_locations(run: RunConfig) -> tuple[str, str, str]:
    """(run name, run URI, checkpoint dir: a local path for file://, else a URI)."""
    name = run.name or (
        f"rayzero-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    )
    root = run.storage or os.environ.get("RAYZERO_STORAGE_ROOT") or Path.cwd().joinpath("runs").as_uri()
    if "://" not in root:  # a plain path is a local directory
        root = Path(root).resolve().as_uri()
    run_uri = f"{root.rstrip('/')}/{name}"
    filesystem, path = pafs.FileSystem.from_uri(run_uri)
    filesystem.create_dir(path, recursive=True)
    checkpoint_dir = f"{path}/checkpoints" if run_uri.startswith("file://") else f"{run_uri}/checkpoints"
    return name, run_uri, checkpoint_dir


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
    filesystem, path = pafs.FileSystem.from_uri(uri)

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
    """Run `train_loop(train_loop_config)` on `scaling.num_workers` Ray actors forming one process group.

    `config` is the run's DeepSpeed config (JSON path, dict or RayZeroConfig); it is validated here,
    before any worker starts, and `rayzero.initialize(model=...)` without `config=` uses it.
    `trainer` holds HF `TrainingArguments` values the config's "auto"s take (HF's defaults for the rest).
    Raises `TrainingFailedError` (naming the failing rank, with its traceback) if the run fails.
    """
    import ray

    fit_started_wall, fit_started = time.time(), time.monotonic()
    scaling, run, failure = scaling or ScalingConfig(), run or RunConfig(), failure or FailureConfig()
    ds_config, validated, trainer = validated_config(config, scaling.num_workers, trainer)
    name, run_uri, checkpoint_dir = _run_locations(run)
    resume_from = resolve_resume_from(
        run.resume_from or os.environ.get("RAYZERO_RESUME_FROM") or None, explicit=bool(run.resume_from)
    )

    working_dir = getattr(train_loop, "working_dir", None)  # a `rayzero run file.py:fn` target's directory
    train_loop = ship(train_loop)  # [Note: shipping the loop]; before Ray starts: a failure is quick
    check_fits(scaling, connect(working_dir))
    timings = {"connect_s": time.monotonic() - fit_started}
    run_env = {
        "RAYZERO_RUN_NAME": name,
        "RAYZERO_STORAGE": run_uri,
        "RAYZERO_CHECKPOINT_DIR": checkpoint_dir,
        # the engine's own bound for groups it creates (e.g. the checkpoint writer's)
        "RAYZERO_COLLECTIVE_TIMEOUT_S": str(failure.process_group_timeout_s),
    }
    if ds_config is not None:
        run_env["RAYZERO_CONFIG"] = json.dumps(ds_config)
    if trainer:
        run_env["RAYZERO_TRAINER"] = json.dumps(dict(trainer))  # HF trainer arguments for "auto"s
    datasets = dict(datasets or {})
    local_checkpoint_dir = checkpoint_dir if run_uri.startswith("file://") else None

    def make_controller() -> Controller:  # runs inside the controller actor
        def make_group(attempt: int, resume: str | None) -> RayWorkerGroup:
            env = dict(run_env, RAYZERO_ATTEMPT=str(attempt))
            if resume:
                env["RAYZERO_RESUME_FROM"] = resume
            return RayWorkerGroup(scaling, env, failure.process_group_timeout_s, datasets)

        return Controller(
            make_group, train_loop, train_loop_config, FailurePolicy(failure.max_failures),
            resume_from=resume_from, checkpoint_dir=local_checkpoint_dir,
        )

    # num_cpus=0: the controller only waits; it must not take a CPU a worker bundle needs.
    # RAYZERO_CONTROL_* (host, port, TLS files) reach the control service in the controller actor;
    # not the token: a runtime env is readable through Ray's state API (the operator's pods have it
    # in the environment of every process on the head already).
    control_env = {key: value for key, value in os.environ.items()
                   if key.startswith("RAYZERO_CONTROL_") and key != "RAYZERO_CONTROL_TOKEN"}
    controller = ray.remote(ControllerActor).options(
        num_cpus=0, max_concurrency=4, **({"runtime_env": {"env_vars": control_env}} if control_env else {})
    ).remote(make_controller, name, run_uri)
    wall_clock_breakdown = bool(validated.get("wall_clock_breakdown"))
    batch = validated.get("train_batch_size")
    progress = Progress(batch if isinstance(batch, int) else None, run.progress_interval_s, wall_clock_breakdown)
    metrics_log = MetricsLog(run_uri)
    print(f"[rayzero] run {name}: {scaling.num_workers} worker(s), storage {run_uri}", flush=True)
    try:
        history, last_checkpoint, error = _stream(controller, progress, metrics_log, timings, fit_started_wall)
    finally:
        ray.kill(controller)  # its workers and placement group go with it (fate sharing)
        metrics_log.flush()
    history = metrics_log.history()  # one entry per step: a re-run step replaces its earlier report
    timings["total_s"] = time.monotonic() - fit_started
    timings.update(progress.rates())
    if wall_clock_breakdown:
        print("[rayzero] wall clock breakdown: "
              + ", ".join(f"{key} {value:.2f}" for key, value in timings.items()), flush=True)
    if error is not None:
        raise error
    if history:
        print(progress.line(), flush=True)
    if last_checkpoint is None and local_checkpoint_dir and Path(local_checkpoint_dir, "latest").exists():
        last_checkpoint = local_checkpoint_dir
    return Result(
        metrics_history=history,
        metrics=history[-1] if history else None,
        checkpoint=last_checkpoint,
        path=run_uri,
        timings=timings,
        metrics_path=metrics_log.uri,
    )


def _stream(
    controller: Any, progress: Progress, metrics_log: MetricsLog, timings: dict[str, float], started_wall: float
) -> tuple[list[dict[str, Any]], str | None, TrainingFailedError | None]:
    """Long-poll the controller until the run ends: (rank 0's history, last checkpoint, error)."""
    import ray

    history: list[dict[str, Any]] = []
    last_checkpoint: str | None = None
    try:
        ray.get(controller.start.remote())
        while True:
            update = ray.get(controller.poll.remote(1.0))
            for line in update.events:
                print(f"[rayzero] {line}", flush=True)
            for item in update.reports:
                if "fit_to_first_report_s" not in timings:
                    timings["fit_to_first_report_s"] = max(0.0, item.time - started_wall)
                if item.rank == 0:
                    history.append(item.metrics)
                progress.observe(item)
                metrics_log.add(item)
                last_checkpoint = item.checkpoint or last_checkpoint
            if update.state.is_terminal:
                timings.update(update.timings)
                error = update.error if update.state is RunState.ERRORED else None
                return history, last_checkpoint, error
    except ray.exceptions.RayActorError as died:
        return history, last_checkpoint, TrainingFailedError(f"the rayzero controller actor died: {died}")
