"""The worker's side of planned stops and heartbeats: the engine's step-boundary hook.

[Note: agreed step boundary]
A planned stop, resize or `checkpoint now` must save at *one* step every rank reaches, while the
controller's requests reach the ranks at different moments (a fast rank may be a step ahead when
its request arrives). So the ranks agree among themselves: after every optimizer step each rank
contributes (its pending request kind, its request id) to one tiny MAX all-reduce on a CPU (gloo)
group. A rank that got the request makes every rank see it at the same step; all of them save
there, through the engine's own `save_checkpoint` into the run's checkpoint directory (even when
the loop never saves), wait for the commit, and only then report the request handled. A STOP also
ends the loop: `get_context().should_stop()` turns true, and a loop that does not check it gets
`RunStopped` from its next `engine(...)` call. The all-reduce of two integers costs tens of
microseconds on gloo (it is a sync point of the CPU side only: no GPU tensor is involved).
"""
from __future__ import annotations

import enum
import logging
import os
import statistics
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

NODE_LOCAL_RESUME = "node-local:"
# engine.memory_stats keys a report's `placement` carries: where the model state lives, what it is
# made of, and stage 3's most gathered parameter bytes at once (the closing memory line's parts)
PLACEMENT_KEYS = ("device_bytes", "host_bytes", "nvme_bytes", "params", "grads", "master_weights",
                  "optimizer_state", "bucket_buffers", "peak_live_param_bytes", "peak_device_allocated")
"""RAYZERO_RESUME_FROM value meaning: resume from this node's own checkpoint directory.

[Note: node-local runs]
With `checkpoint.use_node_local_storage`, `rayzero.fit` points each rank's checkpoint directory at
its node's local disk (the same relative path on every node); the checkpoint layer replicates each
shard to peers. No single path holds the run's checkpoints, so each rank reports the newest
checkpoint committed in its own directory in its heartbeat (read from the manifests there), and a
restart after losing a node resumes every new rank from its own node's directory: the loader
assembles the checkpoint from the survivors' copies and replicas (rayzero/checkpoint/loader.py)."""


class BoundaryRequest(enum.IntEnum):
    """What the controller asks the ranks to do at the next agreed step boundary (larger wins)."""

    NONE = 0
    CHECKPOINT = 1  # save, commit, go on
    STOP = 2  # save, commit, end the loop


class RunStopped(BaseException):
    """Raised by `engine(...)` in a loop that was told to stop (its checkpoint is committed) but did
    not check `rayzero.get_context().should_stop()`. A BaseException, like KeyboardInterrupt, so a
    loop's `except Exception` does not swallow it; the worker treats it as a clean planned stop."""


@dataclass(frozen=True)
class HandledRequest:
    """The newest request the ranks carried out."""

    request_id: int
    kind: int
    step: int
    """The engine's `global_steps` at the save."""
    location: str
    """The checkpoint directory (`.../global_step{N}`) as the engine's checkpoint layer resolved it."""


@dataclass(frozen=True)
class Heartbeat:
    """One rank's progress, as the controller polls it (see rayzero.controller.health)."""

    rank: int
    node_id: str
    step: int
    """Optimizer steps the rank's engine completed."""
    micro_step: int
    """Backward passes completed."""
    progress_age_s: float
    """Seconds since the rank last made progress (an engine call, a report, a save)."""
    stepped: bool
    """True once an engine in this process completed an optimizer step."""
    saving: bool
    """A boundary checkpoint is being written (progress, not a hang)."""
    step_time_s: float | None
    """Median of the rank's recent optimizer step intervals."""
    memory_bytes: int
    host_memory_bytes: int
    handled: HandledRequest | None
    finished: bool
    """The loop returned (or raised)."""
    preempted: bool = False
    """The process got SIGTERM: the group stops at the next boundary and regroups."""
    committed: tuple[int, str] | None = None
    """(step, tag directory) of the newest checkpoint committed in this rank's checkpoint directory,
    or in a directory its loop saved into (`StepBoundary.saving_into`)."""
    in_step: bool = False
    """Inside an engine step (forward called, optimizer step not yet done): in a hang, such a rank is
    usually blocked in a collective waiting for one that is not."""
    save_stall_s: float = 0.0
    """Seconds this rank's loop waited on checkpoint saves so far (goodput's checkpoint stall)."""
    loop_time_s: float | None = None
    """Median of the rank's recent times outside the engine between two steps (its data loading and
    the loop's own work): the part of a step only this rank spends ([Note: stragglers] in health.py)."""


def host_memory_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as source:
            return int(source.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def thread_stacks() -> str:
    """Every Python thread's stack in this process (what faulthandler prints, as text)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class StepBoundary:
    """The engine step-boundary hook of one worker ([Note: step boundary hook] in engine.py,
    [Note: agreed step boundary])."""

    def __init__(self, rank: int, node_id: str, group: Any = None, checkpoint_dir: str | None = None) -> None:
        self.rank = rank
        self._checkpoint_dir = checkpoint_dir  # listed for `Heartbeat.committed` (local paths only)
        # directories the loop chose to save into (an HF Trainer's checkpoint-N), newest last: the
        # newest commit is in one of the last few, so listing costs the same at any step
        self._save_dirs: deque[str] = deque(maxlen=3)
        self._committed_cache: dict[str, tuple[float, tuple[int, str] | None]] = {}  # dir -> (mtime, result)
        self.node_id = node_id
        self._group = group  # a gloo group for the agreement (None: the default group, when gloo)
        self._lock = threading.Lock()  # requests and heartbeats come from other actor threads
        self._pending_kind = BoundaryRequest.NONE
        self._pending_id = 0
        self._handled: HandledRequest | None = None
        self._progress_at = time.monotonic()
        self._last_step_at: float | None = None
        self._step_intervals: deque[float] = deque(maxlen=32)
        self._step_done_at: float | None = None  # when after_step returned (the loop has control again)
        self._loop_times: deque[float] = deque(maxlen=32)  # step done -> next step's first forward
        self.step = 0
        self.micro_step = 0
        self.stepped = False  # an engine stepped: stops go through the agreed boundary
        self._engine: weakref.ref | None = None  # the engine that stepped last (for placement)
        self._layout_told: weakref.ref | None = None  # the engine whose layout a report carried (new_layout)
        self.saving = False
        self.stop_committed = False
        self.finished = False
        self.preempted = False  # this process got SIGTERM ([Note: preemption] in actor.py)
        self.in_step = False  # between before_forward and after_step
        self.save_stall_s = 0.0  # seconds the loop waited on saves (save_stalled)

    # ---- requests (from the controller, through the worker actor) --------------------------
    def request(self, request_id: int, kind: int) -> None:
        with self._lock:
            if self._handled is not None and request_id <= self._handled.request_id:
                return  # the ranks agreed on it already (another rank brought it to the boundary)
            if kind >= self._pending_kind:
                self._pending_kind = BoundaryRequest(kind)
                self._pending_id = max(self._pending_id, request_id)

    def preempt(self) -> None:
        """This process was told to end (SIGTERM): stop the whole group at the next agreed boundary.
        Safe from a signal handler: it only sets fields (no lock: the handler may interrupt a holder)."""
        self.preempted = True
        self._pending_kind = BoundaryRequest.STOP

    def should_stop(self) -> bool:
        if self.stop_committed:
            return True
        # A loop that never steps an engine has no boundary to agree on: stop when asked.
        return not self.stepped and self._pending_kind is BoundaryRequest.STOP

    def _live_engine(self) -> Any:
        """The engine that stepped last, while it is open; else None."""
        engine = self._engine() if self._engine is not None else None
        return None if engine is None or engine.closed else engine

    def placement(self) -> dict[str, int] | None:
        """Where the engine's model state lives now (device/host/nvme bytes) and what it is made of
        (engine.memory_stats), for the progress line and the run's closing memory line; None before an
        engine stepped."""
        engine = self._live_engine()
        if engine is None:
            return None
        stats = engine.memory_stats()
        return {key: int(stats[key]) for key in PLACEMENT_KEYS if key in stats}

    def link_bytes(self) -> tuple[int | None, int | None]:
        """Bytes this rank sent in the engine's last step inside its node and to other nodes
        ([Note: bytes per link class] in rayzero/engine/comm.py); (None, None) before an engine stepped."""
        engine = self._live_engine()
        if engine is None:
            return None, None
        total = engine.comm_stats().get("total", {})
        return int(total.get("intra_node_bytes", 0)), int(total.get("inter_node_bytes", 0))

    def new_layout(self) -> dict[str, Any] | None:
        """The engine's node layout and groups (`engine.layout()`) the first time it is asked for
        each engine, else None: it changes only with a new engine, and travels once."""
        engine = self._live_engine()
        if engine is None or (self._layout_told is not None and self._layout_told() is engine):
            return None
        self._layout_told = weakref.ref(engine)
        return engine.layout()

    def learning_rate(self) -> float | None:
        """The learning rate of the engine that stepped last, for the metrics (None before one did)."""
        engine = self._live_engine()
        if engine is None:
            return None
        try:
            rates = engine.get_lr()
            return float(rates[0]) if rates else None
        except (AttributeError, IndexError, TypeError, ValueError):
            return None

    def save_stalled(self, seconds: float) -> None:
        """The engine waited `seconds` on a save ([Note: goodput accounting] in rayzero/controller)."""
        self.save_stall_s += seconds
        self._progress_at = time.monotonic()  # a save is progress, not a hang

    def progressed(self) -> None:
        self._progress_at = time.monotonic()

    def output_progressed(self) -> None:
        """A line of a script's output: progress until an engine first steps, after which only engine
        steps, reports and saves are ([Note: scripts on workers] in script.py)."""
        if not self.stepped:
            self._progress_at = time.monotonic()

    # ---- the hook ----------------------------------------------------------------------------
    def before_forward(self, engine: Any) -> None:
        self._progress_at = time.monotonic()
        if not self.in_step and self._step_done_at is not None:  # the first forward of a step
            self._loop_times.append(self._progress_at - self._step_done_at)
        self.in_step = True
        if self.stop_committed:
            raise RunStopped(f"rank {self.rank}: the run was stopped at step {self.step} (checkpoint "
                             "committed); check rayzero.get_context().should_stop() to leave the loop cleanly")

    def after_step(self, engine: Any) -> None:
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_intervals.append(now - self._last_step_at)
        self._last_step_at = now
        self._progress_at = now
        self.in_step = False
        self.step, self.micro_step, self.stepped = engine.global_steps, engine.micro_steps, True
        self._engine = weakref.ref(engine)
        kind, request_id = self._agree(engine)
        self._step_done_at = time.monotonic()
        if kind is BoundaryRequest.NONE:
            return
        self.saving = True
        if self.preempted and kind is BoundaryRequest.STOP:  # said now that it happens, not at the signal
            logging.getLogger("rayzero.workers").warning(
                "rank %d got SIGTERM: saving the checkpoint of step %d, then stopping", self.rank, engine.global_steps)
        try:
            engine.save_checkpoint()
            engine.wait_for_checkpoint()  # committed before anyone hears it is done
            location = os.path.join(engine.checkpointer.resolve_dir(None), f"global_step{engine.global_steps}")
        finally:
            self.saving = False
            self._progress_at = time.monotonic()
            self._last_step_at = self._progress_at  # the save is not step time
            self._step_done_at = None  # nor loop time
        with self._lock:
            self._handled = HandledRequest(request_id, int(kind), engine.global_steps, location)
            if self._pending_id <= request_id:
                self._pending_kind, self._pending_id = BoundaryRequest.NONE, 0
        if kind is BoundaryRequest.STOP:
            self.stop_committed = True

    def _agree(self, engine: Any) -> tuple[BoundaryRequest, int]:
        with self._lock:
            mine = (int(self._pending_kind), self._pending_id)
        if engine.world_size == 1:
            return BoundaryRequest(mine[0]), mine[1]
        import torch
        import torch.distributed as dist

        if self._group is None and dist.get_backend() != "gloo":
            # A script formed its own (NCCL) group: the agreement's gloo twin is made now, at the first
            # step, by every rank in the same order ([Note: scripts on workers] in script.py).
            self._group = dist.new_group(backend="gloo")
        agreed = torch.tensor(mine, dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
        return BoundaryRequest(int(agreed[0])), int(agreed[1])

    def heartbeat(self, memory_bytes: int) -> Heartbeat:
        intervals, loop_times = list(self._step_intervals), list(self._loop_times)  # copies: the loop appends
        with self._lock:
            handled = self._handled
        return Heartbeat(
            rank=self.rank, node_id=self.node_id, step=self.step, micro_step=self.micro_step,
            progress_age_s=time.monotonic() - self._progress_at, stepped=self.stepped, saving=self.saving,
            step_time_s=statistics.median(intervals) if intervals else None, memory_bytes=memory_bytes,
            host_memory_bytes=host_memory_bytes(), handled=handled, finished=self.finished,
            preempted=self.preempted, committed=self.newest_committed(), in_step=self.in_step,
            loop_time_s=statistics.median(loop_times) if len(loop_times) >= 3 else None,
            save_stall_s=self.save_stall_s,
        )

    def saving_into(self, save_dir: str) -> None:
        """The loop saves into `save_dir` (a directory of its choosing): list it for `newest_committed`.
        Made absolute here: the heartbeat carries it to the controller, whose working directory is
        not this worker's (a Trainer's `--output_dir out` is relative)."""
        if "://" not in save_dir:
            save_dir = os.path.abspath(save_dir)
        if save_dir != self._checkpoint_dir:
            with self._lock:
                if save_dir in self._save_dirs:
                    self._save_dirs.remove(save_dir)
                self._save_dirs.append(save_dir)

    def newest_committed(self) -> tuple[int, str] | None:
        """(step, tag directory) of the newest checkpoint committed in this rank's checkpoint directory
        or in a directory the loop saved into itself (an HF Trainer's `output_dir/checkpoint-N`)."""
        with self._lock:
            directories = [self._checkpoint_dir, *self._save_dirs]
        found = [newest for newest in map(self._newest_in, directories) if newest is not None]
        cache = self._committed_cache
        self._committed_cache = {directory: cache[directory] for directory in directories if directory in cache}
        return max(found, key=lambda item: item[0]) if found else None

    def _newest_in(self, directory: str | None) -> tuple[int, str] | None:
        if not directory or "://" in directory:
            return None
        from rayzero.checkpoint.manifest import committed_tags

        try:
            mtime = os.stat(directory).st_mtime
            cached = self._committed_cache.get(directory)
            if cached is not None and mtime == cached[0]:  # a commit moves `latest`: the directory changes
                return cached[1]
            tags = committed_tags(directory)
        except OSError:  # not made yet, or removed meanwhile (a Trainer's save_total_limit)
            return None
        newest = (tags[0][0], os.path.join(directory, tags[0][1])) if tags else None
        self._committed_cache[directory] = (mtime, newest)
        return newest
