"""What a live run says about itself, and the requests it takes while it runs.

[Note: the control seam]
The controller (controller.py) implements `ControlTarget`; the gRPC service (rayzero.v1.Control,
served from the controller actor) and everything behind it — `rayzero status|stop|scale`,
`rayzero checkpoint now`, the Kubernetes operator — see a run only through it. The types here are
plain frozen dataclasses of numbers and strings, so the service maps them field by field onto its
protobuf messages and tests build them without Ray.

Requests are carried out by the controller's own `step()` loop, never by the calling thread: a
method records the request and waits (bounded) for the step loop to report its outcome, so the
state machine stays the one place that changes the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RankStatus:
    """One rank as its last heartbeat described it."""

    rank: int
    """Global rank in the current worker group."""
    node_id: str
    """Ray node id the rank runs on."""
    heartbeat_age_s: float
    """Seconds since the controller last heard from the rank, as of its newest heartbeat round (at most
    `heartbeat_interval_s` old; [Note: status at scale] in status_view.py)."""
    step: int
    """Optimizer steps the rank's engine completed (its `global_steps`)."""
    micro_step: int
    """Backward passes completed (gradient accumulation counts each)."""
    memory_bytes: int
    """Peak memory so far: device max-allocated on a GPU, else peak RSS."""
    host_memory_bytes: int = 0
    """Resident host memory now (pinned/offloaded state lives here)."""


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as the checkpoint layer knows it (manifest + `latest`)."""

    tier: str
    """`node_local`, `peer` (a replica on another node) or `durable` (the pyarrow.fs copy)."""
    location: str
    """Path or URI of the checkpoint directory (`.../global_step{N}`)."""
    step: int
    """The engine's `global_steps` when it was saved."""
    time: float = 0.0
    """Unix time of the commit (0 when unknown)."""


@dataclass(frozen=True)
class AttemptStart:
    """One attempt of a run (a worker group) as it began, and why."""

    attempt: int
    """The controller's attempt number in this `fit` call (0 first)."""
    cause: str
    """Why it began: start, rerun (a same-name run resuming), worker died, hang, loop error, setup
    error, placement, preemption, resize (grow / scale / drain)."""
    time: float
    """Unix time it began."""
    resumed_step: int | None
    """The step of the checkpoint it resumed from (None: from the start)."""
    workers: int
    """Workers it was planned with."""
    failures: int = 0
    """Restarts charged to `FailureConfig.max_failures` when it began, this attempt's own cause
    included (a resize or a preemption charges none): what its progress lines say, however late the
    driver hears of it."""


@dataclass(frozen=True)
class RunStatus:
    """A snapshot of a live (or just ended) run."""

    run_name: str
    state: str
    """The controller's `RunState` value: initializing, scheduling, running, resizing, draining,
    restarting, finished, errored."""
    attempt: int
    """0 for the first worker group; +1 for each restart or resize."""
    world_size: int
    """Workers in the current group (0 while none is running)."""
    min_workers: int
    """Elastic range: the fewest workers the run accepts."""
    max_workers: int
    """Elastic range: the most workers the run asks for."""
    started_at: float
    """Unix time the run started (the controller was created)."""
    step: int = 0
    """Newest step rank 0 reported (its `step` metric, else the engine's step count)."""
    loss: float | None = None
    """Loss of rank 0's newest report, when it had one."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    last_report_time: float = 0.0
    """Unix time of rank 0's newest report."""
    checkpoints: tuple[CheckpointRecord, ...] = ()
    """The newest committed checkpoint in each tier that has one."""
    failures: int = 0
    """Restarts charged to the retry budget so far (crash, hang, node loss)."""
    max_failures: int = 0
    """The budget (`FailureConfig.max_failures`); -1 is unlimited."""
    ranks: tuple[RankStatus, ...] = ()
    message: str = ""
    """The newest event in words (why it restarted, what it waits for)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Anything else worth showing, as text."""
    goodput: float | None = None
    """Kept training time / wall time over every call of this run name ([Note: goodput accounting])."""
    wall_s: float = 0.0
    """The wall time that goodput is a share of."""
    badput_s: dict[str, float] = field(default_factory=dict)
    """Where the rest went: seconds per cause."""


class ControlTarget(Protocol):
    """What the control plane may ask of a run (implemented by the controller)."""

    def status(self) -> RunStatus:
        """A snapshot now; never blocks on the workers."""
        ...

    def checkpoint_now(self, timeout_s: float) -> CheckpointRecord:
        """Have every rank save at the next step boundary they all reach (even when the loop never
        saves) and return once that checkpoint is committed. Raises RayZeroRuntimeError when the
        run cannot (not running, or ended first) or `timeout_s` passes."""
        ...

    def stop(self, timeout_s: float) -> CheckpointRecord | None:
        """Planned stop: checkpoint at the next common step boundary, then end the run (the driver's
        Result says it was stopped; `rayzero run` exits 0). Returns the final checkpoint, or None
        when the run ended before one could be taken."""
        ...

    def scale(self, workers: int) -> None:
        """Resize to `workers` through a planned stop (checkpoint, regroup, resume). Raises
        RayZeroValueError outside [min_workers, max_workers] or for a size the batch cannot split."""
        ...

    def kill(self, reason: str) -> None:
        """End the run now, without a checkpoint."""
        ...
