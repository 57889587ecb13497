"""The worker actor: environment -> process group -> the user's loop -> reports. Deliberately thin.

The controller creates one `TrainWorker` per placement-group bundle (see
`rayzero.controller.worker_group`). It is a *threaded* actor: `run` blocks in one thread for the
whole loop while `collect` (asked by its node's relay, [Note: node relays] in relay.py) is served in
another, so heartbeats and reports stream out while the loop runs without the loop ever waiting on
the controller.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayzero.config.environment import CHECKPOINT_DIR, NODE_ID, NODE_LOCAL_DIR, RESUME_FROM, RUN, SCRIPT
from rayzero.ports import server_port
from rayzero.workers import session as session_module
from rayzero.workers.boundary import (
    NODE_LOCAL_RESUME,
    BoundaryRequest,
    Heartbeat,
    RunStopped,
    StepBoundary,
    thread_stacks,
)
from rayzero.workers.errors import WorkerSetupError
from rayzero.workers.script import ScriptLaunch, run_script, torchelastic_environment
from rayzero.workers.session import Report, WorkerSession, peak_memory_bytes


@dataclass(frozen=True)
class NodeInfo:
    """Where a worker landed, used to assign ranks and the rendezvous address."""

    node_id: str
    """Ray node id."""
    node_ip: str
    """IP address of the node (MASTER_ADDR when this worker becomes rank 0)."""
    gpu_ids: tuple[str, ...]
    """GPUs Ray assigned to this actor (empty on CPU)."""
    pid: int
    """Process id, for messages that point at a process."""


@dataclass(frozen=True)
class WorkerOutcome:
    """How a worker's loop ended. `error` is None when it returned normally."""

    rank: int
    """Global rank of the worker."""
    error: str | None = None
    """`Type: message` of the exception that ended the loop, or None."""
    traceback_text: str = ""
    """The formatted traceback of that exception, as the worker saw it."""
    stopped: bool = False
    """The loop ended because the run was told to stop (a planned stop, its checkpoint committed)."""
    preempted: bool = False
    """This worker's process got SIGTERM (the stop was a preemption)."""
    save_stall_s: float = 0.0
    """Seconds the loop waited on checkpoint saves in this attempt (the last ones no heartbeat saw)."""
    exit_code: int | None = None
    """A script's exit status when it failed ([Note: scripts on workers] in script.py)."""
    committed: tuple[int, str] | None = None
    """(step, tag directory) of the newest checkpoint committed in this rank's checkpoint directory
    as the loop ended: with node-local storage a planned stop's boundary save, which no heartbeat saw."""


def _takes_an_argument(function: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(function).parameters) > 0
    except (TypeError, ValueError):  # a callable without a readable signature: give it the config
        return True


class TrainWorker:
    """One training process of a run (a Ray actor; created by the controller's worker group)."""

    def __init__(self) -> None:
        # Filled by setup(); the loop's report()/get_dataset_shard() reach it via session.activate.
        self._session: WorkerSession | None = None
        # The node's own node-local directory (e.g. the Kubernetes operator mounts a volume and exports
        # RAYZERO_NODE_LOCAL_DIR in the pod), read before setup() overwrites the environment.
        self._node_local_root = NODE_LOCAL_DIR.get()
        # [Note: preemption] SIGTERM to this process (a pod being deleted, a spot node reclaimed) is a
        # planned stop of the whole group: checkpoint at the next agreed boundary, then regroup on
        # what remains. Ray runs an actor's __init__ on the process's main thread, the only place
        # Python lets us install a signal handler; outside a running loop Ray's own handler (exit)
        # still applies.
        self.preempted = False
        self._running = False
        self._loop_ended = False  # run() returned: nothing more will be reported
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        boundary = self._session.boundary if self._session is not None else None
        if self._running and boundary is not None and not self.preempted:
            self.preempted = True
            boundary.preempt()
            # Nothing is announced yet: Ray's own teardown of the group (`rayzero kill`, another rank
            # failed) also sends SIGTERM, and then no checkpoint comes. The boundary says so when the
            # checkpoint is actually being written (StepBoundary.after_step).
            logging.getLogger("rayzero.workers").debug("rank %d got SIGTERM", boundary.rank)
            return
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def node_info(self) -> NodeInfo:
        import ray

        runtime = ray.get_runtime_context()
        gpu_ids = tuple(str(g) for g in runtime.get_accelerator_ids().get("GPU", []))
        return NodeInfo(runtime.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid())

    def master_port(self) -> int:
        """A TCP port free on this node, for MASTER_PORT when this worker is rank 0: bound only once
        every rank has its environment, so from below the ephemeral range ([Note: ports below the
        ephemeral range])."""
        return server_port(host="")

    def setup(
        self,
        rank: int,
        env: dict[str, str],
        backend: str,
        timeout_s: float,
        dataset_shards: dict[str, Any],
    ) -> None:
        """Set the environment and join the process group (blocks until every rank joined)."""
        try:
            env = dict(env)
            node_id, run = NODE_ID.get(env), RUN.get(env)
            if self._node_local_root and node_id:
                # Per node id under the node's root, as for the default root: two Ray nodes sharing one
                # host path (two pods on one machine) must not share a checkpoint tier.
                env[NODE_LOCAL_DIR.name] = f"{self._node_local_root}/{node_id}"
            node_local_dir = NODE_LOCAL_DIR.get(env)
            if node_local_dir:
                os.makedirs(node_local_dir, exist_ok=True)
            if node_local_dir and run.node_local_checkpoints:
                # [Note: node-local runs] checkpoints stay on this node's disk (peers keep replicas);
                # the same name under every node's root, so a rank resumes from whatever its node holds.
                env[CHECKPOINT_DIR.name] = f"{node_local_dir}/checkpoints/{run.name or 'run'}"
                if RESUME_FROM.get(env) == NODE_LOCAL_RESUME:
                    env[RESUME_FROM.name] = env[CHECKPOINT_DIR.name]
            os.environ.update(env)
            if SCRIPT.get(env):
                # A script forms its own group ([Note: scripts on workers]); the boundary's agreement
                # group comes from it at the first step.
                os.environ.update(torchelastic_environment(env))
                boundary = StepBoundary(rank, node_id or "", None, CHECKPOINT_DIR.get(env))
                self._session = WorkerSession(rank=rank, dataset_shards=dict(dataset_shards), boundary=boundary)
                return
            import torch
            import torch.distributed as dist

            if backend == "nccl":
                # The worker group set CUDA_VISIBLE_DEVICES to every GPU of this node's workers, in
                # local-rank order, so `cuda:LOCAL_RANK` is this worker's own GPU (as under torchrun).
                torch.cuda.set_device(int(env["LOCAL_RANK"]))
            dist.init_process_group(
                backend=backend,
                init_method="env://",
                rank=rank,
                world_size=int(env["WORLD_SIZE"]),
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            # The boundary agreement runs on the CPU ([Note: agreed step boundary]): NCCL gets a gloo
            # twin (creating it is collective: every rank does it here, in the same order).
            agreement_group = dist.new_group(backend="gloo") if backend == "nccl" else None
            boundary = StepBoundary(rank, node_id or "", agreement_group, CHECKPOINT_DIR.get(env))
            self._session = WorkerSession(rank=rank, dataset_shards=dict(dataset_shards), boundary=boundary)
        except Exception as error:  # noqa: BLE001 - the controller reports it with this rank and traceback
            raise WorkerSetupError(
                f"rank {rank} could not join the process group ({backend}, "
                f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}): {type(error).__name__}: {error}",
                rank,
                traceback.format_exc(),
            ) from None

    def run(self, train_loop: Callable[..., Any], loop_config: dict[str, Any] | None) -> WorkerOutcome:
        """Run the loop to its end; an exception is returned as data, not raised, with its traceback."""
        assert self._session is not None, "setup() must run before run()"
        rank = self._session.rank
        boundary = self._session.boundary
        session_module.activate(self._session)
        from rayzero.engine.engine import set_step_boundary_hook

        set_step_boundary_hook(boundary)
        self._running = True
        try:
            if isinstance(train_loop, ScriptLaunch):
                ended = run_script(train_loop, rank, on_output=boundary.output_progressed)
                if ended.code != 0:
                    return WorkerOutcome(rank, ended.error, ended.traceback_text, exit_code=ended.code)
            # Ray Train's convention: a loop with a parameter gets the config ({} when none was given).
            elif _takes_an_argument(train_loop):
                train_loop({} if loop_config is None else loop_config)
            else:
                train_loop()
            # An async checkpoint save may still be writing or uploading when the loop returns; the
            # group is torn down right after, so finish it here (a no-op when nothing is in flight).
            from rayzero.checkpoint.saver import wait_for_pending_saves

            wait_for_pending_saves()
            return WorkerOutcome(rank, stopped=boundary is not None and boundary.should_stop(),
                                 preempted=self.preempted, save_stall_s=boundary.save_stall_s,
                                 committed=boundary.newest_committed() if boundary is not None else None)
        except RunStopped:
            return WorkerOutcome(rank, stopped=True, preempted=self.preempted, save_stall_s=boundary.save_stall_s,
                                 committed=boundary.newest_committed())
        except BaseException as error:  # noqa: BLE001 - SystemExit from an argparse loop is a failure too
            return WorkerOutcome(rank, f"{type(error).__name__}: {error}", traceback.format_exc())
        finally:
            self._running = False
            self._loop_ended = True
            set_step_boundary_hook(None)
            from rayzero.engine.offload.backend import release_scratch

            release_scratch()  # NVMe swap files are the run's scratch: gone when the loop ends
            session_module.activate(None)
            if boundary is not None:
                boundary.finished = True

    def collect(self, grace_s: float = 0.0) -> tuple[Heartbeat | None, list[Report]]:
        """This rank's heartbeat now (None before setup) and every report its loop made since the
        previous collect: what its node's relay asks once per heartbeat round ([Note: node relays]
        in relay.py). Served while the loop runs; until its loop has ended, with nothing reported,
        waits up to `grace_s` for a first report (the survivors' last words after a failure; a rank
        whose run() call has not begun yet, on a loaded machine, is waited for too)."""
        if self._session is None:
            return None, []
        # first: the heartbeat is at least as new as the reports
        reports = self._session.drain(0.0 if self._loop_ended else grace_s)
        boundary = self._session.boundary
        return (boundary.heartbeat(peak_memory_bytes()) if boundary is not None else None), reports

    def request_boundary(self, request_id: int, kind: int) -> None:
        """Ask for a checkpoint (and a stop) at the next step boundary all ranks agree on."""
        if self._session is not None and self._session.boundary is not None:
            self._session.boundary.request(request_id, BoundaryRequest(kind))

    def stacks(self) -> str:
        """Every thread's Python stack in this worker process (for hang reports)."""
        return thread_stacks()

    def shutdown(self) -> None:
        """Leave the process group so a restarted group in this process could form a new one."""
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - best effort: the actor is killed right after
            logging.getLogger("rayzero.workers").debug("destroy_process_group failed: %s", error)
