"""What a training loop sees of the runtime: its context, `report`, and its dataset shards.

[Note: the worker session]
`rayzero.fit` runs the user's loop inside a Ray actor. The loop talks to the runtime through three
free functions (`get_context`, `report`, `get_dataset_shard`) rather than through an argument, so
the same loop file runs unchanged under `rayzero.fit`, `rayzero run` and plain `torchrun`. They find
the runtime through one process-wide slot, `_ACTIVE`, that the worker actor fills before calling the
loop and empties after. Outside a worker (torchrun, a notebook) the slot is empty: the context is
read from the environment variables torchrun sets, `report` keeps the metrics in this process
(`local_reports()`), and `get_dataset_shard` says how to pass datasets.
"""
from __future__ import annotations

import json
import os
import queue
import resource
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.environment import (
    ATTEMPT,
    CHECKPOINT_DIR,
    CONFIG,
    NODE_ID,
    NODE_LOCAL_DIR,
    RESUME_FROM,
    RUN,
)
from rayzero.config.errors import RayZeroRuntimeError


@dataclass(frozen=True)
class TrainContext:
    """Where this training process sits in the run. Built from the environment the worker sets."""

    rank: int
    """Global rank in the process group (0 .. world_size-1)."""
    local_rank: int
    """Rank among the workers on this node; the GPU index to use when `use_gpu`."""
    world_size: int
    """Number of training processes in the run."""
    local_world_size: int
    """Number of training processes on this node."""
    node_id: str
    """Ray node id of this worker ('' outside Ray)."""
    run_name: str
    """`RunConfig.name` of the run ('' outside rayzero.fit)."""
    storage: str
    """URI of this run's storage directory, `<RunConfig.storage>/<name>` ('' outside rayzero.fit)."""
    checkpoint_dir: str
    """Where `engine.save_checkpoint()` writes without a `save_dir` (a local path for file://)."""
    node_local_dir: str
    """A directory on this node's local disk for node-local checkpoint tiers."""
    resume_from: str | None
    """Checkpoint to resume from (`--resume-from`, or the newest committed one on a restart)."""
    attempt: int = 0
    """0 for the first attempt, incremented each time the controller restarts the worker group."""
    resuming: bool = False
    """True when this process continues earlier training of the same run: a restart after a failure
    or a resize (`attempt > 0`), a rerun under the same name and storage, or a resume point given
    (`resume_from`). A training script whose trainer keeps its own checkpoints (HF `checkpoint-N`,
    Lightning `.ckpt`) resumes from its newest one when this is true ([Note: scripts on workers])."""

    def should_stop(self) -> bool:
        """True once the run was told to stop (driver Ctrl-C/SIGTERM, `rayzero stop`, a resize or a
        preemption) and, for a loop that steps a rayzero engine, the stop checkpoint is committed at a
        step every rank reached. Leave the loop when it turns true; a loop that does not check gets
        `RunStopped` from its next `engine(...)` call. Always False outside rayzero.fit."""
        return _ACTIVE is not None and _ACTIVE.boundary is not None and _ACTIVE.boundary.should_stop()

    @property
    def config(self) -> dict[str, Any] | None:
        """The run's validated DeepSpeed config (what `rayzero.initialize` uses without `config=`)."""
        text = CONFIG.get()
        return json.loads(text) if text else None


def context_from_environment(environ: Mapping[str, str] | None = None) -> TrainContext:
    """Read the context from the variables set by the worker actor (or by torchrun)."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    run, resume_from, attempt = RUN.get(env), RESUME_FROM.get(env), ATTEMPT.get(env)
    return TrainContext(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
        node_id=NODE_ID.get(env) or "",
        run_name=run.name,
        storage=run.storage,
        checkpoint_dir=CHECKPOINT_DIR.get(env) or "",
        node_local_dir=NODE_LOCAL_DIR.get(env) or "",
        resume_from=resume_from,
        attempt=attempt,
        resuming=bool(resume_from) or attempt > 0 or run.resuming,
    )


@dataclass(frozen=True)
class Report:
    """One `rayzero.report(...)` call, as it travels from a worker to the driver."""

    rank: int
    """Rank that reported."""
    seq: int
    """0, 1, 2, ... per rank: the order of this rank's reports."""
    time: float
    """Unix time of the call on the worker."""
    metrics: dict[str, Any]
    """The dict the loop passed, unchanged."""
    checkpoint: str | None = None
    """Checkpoint location the loop attached (`report(metrics, checkpoint=...)`), if any."""
    peak_memory_bytes: int = 0
    """Peak memory of the worker so far: GPU max allocated when on a GPU, else peak RSS."""
    placement: dict[str, int] | None = None
    """Where the rank's engine keeps its model state: device/host/nvme bytes (None: no engine)."""
    attempt: int = 0
    """The controller's attempt (worker group) this report came from (RAYZERO_ATTEMPT)."""
    engine_lr: float | None = None
    """The learning rate of the rank's engine when it reported (its `get_lr()[0]`; None: no engine)."""
    intra_node_bytes: int | None = None
    """Bytes the rank's engine sent to ranks on its own node in its last step (None: no engine)."""
    inter_node_bytes: int | None = None
    """Bytes the rank's engine sent to ranks on other nodes in its last step (None: no engine)."""
    layout: dict[str, Any] | None = None
    """The engine's node layout and groups (`engine.layout()`), on the first report after an engine
    stepped; None on the others. Not a metrics column: `rayzero status` shows rank 0's."""


def peak_memory_bytes() -> int:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except ImportError:  # a loop that does not use torch still reports
        pass
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class WorkerSession:
    """The runtime side of one worker process while its loop runs (see [Note: the worker session])."""

    rank: int
    """This worker's global rank; stamped on every report."""
    dataset_shards: dict[str, Any] = field(default_factory=dict)
    """Ray Data iterators for this rank, by dataset name."""
    reports: queue.Queue[Report | None] = field(default_factory=queue.Queue)
    """Reports not yet collected by the controller (through the node's relay)."""
    boundary: Any = None
    """The engine step-boundary hook of this worker (rayzero.workers.boundary.StepBoundary)."""
    attempt: int = field(default_factory=ATTEMPT.get)
    """The controller's attempt this worker belongs to (stamped on every report)."""
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, metrics: Mapping[str, Any], checkpoint: str | None = None) -> None:
        with self._lock:  # a loop may report from several threads; keep seq and queue order equal
            placement = self.boundary.placement() if self.boundary is not None else None
            learning_rate = self.boundary.learning_rate() if self.boundary is not None else None
            intra, inter = self.boundary.link_bytes() if self.boundary is not None else (None, None)
            layout = self.boundary.new_layout() if self.boundary is not None else None
            item = Report(self.rank, self._seq, time.time(), dict(metrics), checkpoint, peak_memory_bytes(),
                          placement, self.attempt, learning_rate, intra, inter, layout)
            self._seq += 1
            self.reports.put(item)
        if self.boundary is not None:
            self.boundary.progressed()

    def drain(self, timeout_s: float) -> list[Report]:
        """Wait up to `timeout_s` for a first report, then take every report already queued."""
        out: list[Report] = []
        try:
            first = self.reports.get(timeout=timeout_s) if timeout_s > 0 else self.reports.get_nowait()
        except queue.Empty:
            return out
        if first is not None:
            out.append(first)
        while True:
            try:
                item = self.reports.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                out.append(item)


# The one process-wide slot; see [Note: the worker session].
_ACTIVE: WorkerSession | None = None
_LOCAL_REPORTS: list[Report] = []


def activate(session: WorkerSession | None) -> None:
    """Install (or with None, remove) the session the free functions below talk to."""
    global _ACTIVE
    _ACTIVE = session


def get_context() -> TrainContext:
    """Where this process sits in the run: rank, world size, node, run name, storage, resume point."""
    return context_from_environment()


def report(metrics: Mapping[str, Any], checkpoint: str | None = None) -> None:
    """Send `metrics` (a dict of numbers/strings) to the driver, in order.

    Keys the driver's progress line understands: `step`, `loss`, `samples` and `tokens` (cumulative
    counts over all ranks, turned into samples/s and tokens/s). Rank 0's reports form
    `Result.metrics_history`; every rank's reports go to the Parquet metrics log.
    `checkpoint` records where a checkpoint was saved; the last one becomes `Result.checkpoint`.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"rayzero.report(metrics) takes a dict, got {type(metrics).__name__}")
    if _ACTIVE is not None:
        _ACTIVE.report(metrics, checkpoint)
        return
    rank = context_from_environment().rank
    _LOCAL_REPORTS.append(
        Report(rank, len(_LOCAL_REPORTS), time.time(), dict(metrics), checkpoint, peak_memory_bytes())
    )


def local_reports() -> list[Report]:
    """Reports made in this process outside a rayzero worker (e.g. under torchrun)."""
    return list(_LOCAL_REPORTS)


def get_dataset_shard(name: str = "train") -> Any:
    """This rank's share of the Ray Data dataset passed as `rayzero.fit(datasets={name: ...})`.

    Returns a `ray.data.DataIterator`; iterate it with `.iter_batches()` / `.iter_torch_batches()`.
    """
    if _ACTIVE is None:
        raise RayZeroRuntimeError(
            "rayzero.get_dataset_shard() works only inside a loop started by rayzero.fit(datasets=...); "
            "outside it, read your data directly."
        )
    shards = _ACTIVE.dataset_shards
    if name not in shards:
        known = ", ".join(sorted(shards)) or "none"
        raise KeyError(
            f"no dataset named {name!r} was passed to rayzero.fit(datasets=...); datasets passed: {known}"
        )
    return shards[name]

