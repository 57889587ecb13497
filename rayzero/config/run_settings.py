"""A run's runtime settings, in Ray Train's shapes: scaling, run (name/storage), failure handling.

Plain pydantic models like the rest of rayzero.config, so every layer reads them (the driver
validates them, the controller is built from them); `rayzero.driver` re-exports them as
`rayzero.ScalingConfig`, `rayzero.RunConfig`, `rayzero.FailureConfig`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayzero.config.names import ALLOWED, name_problem


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ScalingConfig(_Settings):
    """How many workers, and what each one gets. One worker = one training process = one rank."""

    num_workers: int | tuple[int, int] = 1
    """Number of training processes (ranks); with `use_gpu`, one GPU each by default. A pair
    `(min, max)` makes the run elastic (Ray Train v2's shape): it starts with as many as fit (at least
    min), restarts after a failure with as many as then fit, and grows back towards max when room
    returns, keeping `train_batch_size` by recomputing gradient accumulation ([Note: elastic batch])."""
    use_gpu: bool = False
    """Give each worker a GPU and use the NCCL backend; otherwise CPU workers on gloo."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources of one worker's placement-group bundle, e.g. {"CPU": 4, "GPU": 1}.
    Default: {"CPU": 1}, plus {"GPU": 1} when `use_gpu`."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy: PACK fills few nodes (fast collectives), SPREAD one per node."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for the cluster to fit every bundle before failing with the reason."""

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    @model_validator(mode="after")
    def _worker_range_is_valid(self) -> ScalingConfig:
        if self.min_workers < 1 or self.max_workers < self.min_workers:
            raise ValueError(
                f"num_workers={self.num_workers!r}: give a count >= 1 or a range with 1 <= min <= max: "
                "(2, 8) in Python, --workers 2:8 on the command line")
        return self

    @model_validator(mode="after")
    def _gpu_resources_agree(self) -> ScalingConfig:
        resources = self.resources_per_worker or {}
        gpus = resources.get("GPU", 0)
        if gpus and not self.use_gpu:
            raise ValueError(
                f"resources_per_worker asks for GPU={gpus} but use_gpu is False; "
                "set use_gpu=True (workers then use NCCL) or drop the GPU entry"
            )
        if self.use_gpu and "GPU" in resources and gpus <= 0:
            raise ValueError("use_gpu=True needs resources_per_worker['GPU'] > 0 (or leave it out: 1)")
        negative = {key: value for key, value in resources.items() if value < 0}
        if negative:
            raise ValueError(f"resources_per_worker has negative amounts {negative}; use amounts >= 0")
        return self

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker."""
        bundle = dict(self.resources_per_worker or {"CPU": 1.0})
        if self.use_gpu:
            bundle.setdefault("GPU", 1.0)
        return bundle


class RunConfig(_Settings):
    """Name and storage of a run: where metrics and checkpoints go, and where to resume from."""

    name: str | None = None
    """Run name; a directory of that name is made under `storage`. Default: rayzero-<date>-<time>."""
    storage: str | None = None
    """Root URI for runs, any pyarrow.fs URI (file:///..., s3://..., gs://...). Default:
    `$RAYZERO_STORAGE_ROOT`, else file://<current directory>/runs. Must be reachable from every node."""
    resume_from: str | None = None
    """Checkpoint to resume from, passed to the loop as `rayzero.get_context().resume_from`.
    Default: `$RAYZERO_RESUME_FROM` (set by the Kubernetes operator on a retried attempt)."""
    progress_interval_s: float = Field(5.0, ge=0)
    """Seconds between progress lines on the driver; 0 prints one per rank-0 report."""

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, name: str | None) -> str | None:
        # [Note: names that become paths]: pydantic prints the field, the value and this reason
        problem = name_problem(name) if name is not None else None
        if problem is not None:
            raise ValueError(f"run name {name!r} {problem}; use {ALLOWED}")
        return name


class FailureConfig(_Settings):
    """What to do when a worker fails."""

    max_failures: int = Field(-1, ge=-1)
    """Worker failures tolerated over the whole run before it fails; each one restarts the worker
    group from the newest checkpoint. -1 (default): no total limit (see
    `max_failures_without_progress`); 0: fail at the first."""
    max_failures_without_progress: int = Field(3, ge=0)
    """Failures in a row with no newer committed checkpoint between them that end the run: a crash
    that comes back at the same place is not fixed by restarting. 0: no such limit."""
    process_group_timeout_s: float = Field(600.0, gt=0)
    """Timeout of the torch process group: forming it and every collective. A rank that hangs
    makes the others fail after this long instead of blocking forever."""
    backoff_s: float = Field(1.0, ge=0)
    """Seconds to wait before the first retry, doubled for each further one in a row (at most 60 s): a
    newer committed checkpoint since the previous failure starts it at this again. A placement that
    does not fit is retried like any failure, within `max_failures`."""
    hang_timeout_s: float = Field(55.0, ge=0)
    """A rank with no progress (engine step, forward, report, save) for this long after its first
    optimizer step is hung: the controller names it, prints every rank's Python stacks (the hung one
    first) and restarts (within `max_failures`). 55 s by default, so a hang is reported within a
    minute. Adaptive: at least 10x the median step time. 0 turns detection off."""
    startup_grace_s: float = Field(600.0, gt=0)
    """The hang limit before a rank's first optimizer step (model build, data, first load)."""
    stop_timeout_s: float = Field(300.0, gt=0)
    """A planned stop or resize waits this long for the boundary checkpoint before ending the group
    without it (a loop that never steps a rayzero engine has no boundary)."""
