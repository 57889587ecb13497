"""Stage 3: a collective that stalls is checked for ranks running different modules.

[Note: stalled stage-3 collectives]
[Note: modules every rank runs] (hooks.py) checks, while the fetch trace records, that every
rank fetches the same module before each gather. After that the trace replays with no check (a
collective per gather would cost more than the gathers on small modules), so a rank whose forward
departs later (a module run on one rank from some step on) leaves its peers in collectives that
never pair: gloo then waits for its timeout (`RAYZERO_COLLECTIVE_TIMEOUT_S`, 300 s by default) and
reports "Timed out waiting ... for recv operation", naming nothing.

So every wait on a stage-3 collective (parameter all-gathers, gradient reduce-scatters, the trace
agreement) that is not already complete is watched: when it has not finished after
`RAYZERO_STAGE3_STALL_CHECK_S` seconds (default 10; 0 turns the watch off), the rank writes the
module it is fetching into the process group's store and waits there (as long again) for every
other rank's. Ranks stuck together in a mismatched collective all get there; if they name
different modules and some rank left the order it recorded in this micro-step (the divergence
itself), each raises the same error naming every rank's module. Otherwise — the same module, no
rank departed (a rank that lags behind on a slow link names an earlier module of the same order),
or some rank never writes (slow, not stuck, or stuck elsewhere) — the wait simply goes on. One
check per micro-step. A wait that is already complete, the common case, costs one
`is_completed()` call; a pending one, an event and a completion callback.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch.distributed as dist

from rayzero.config.environment import STAGE3_STALL_CHECK_S
from rayzero.config.errors import RayZeroRuntimeError


def different_modules_error(names: list[str]) -> RayZeroRuntimeError:
    return RayZeroRuntimeError(
        "stage 3: the ranks fetch different modules at the same point of the pass ("
        + ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(names))
        + "). Every rank must run the same modules in the same order: a module called on some ranks "
        "only (e.g. under `if rank == 0:`) would leave the others waiting in its parameter "
        "all-gather. Run it on every rank, or outside the model the engine wraps")


class StallWatch:
    """Waits on stage-3 collectives; diagnoses one that stalls ([Note: stalled stage-3 collectives])."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int,
                 where: Callable[[], tuple[int, str, bool]]) -> None:
        self.seconds = STAGE3_STALL_CHECK_S.get()
        self._group, self._rank, self._world = group, rank, world_size
        # (micro-step number, "module (pass)", whether this rank left its recorded order in it)
        self._where = where
        self._checked_step = -1
        self._waiter: ThreadPoolExecutor | None = None
        self._waiting = None  # the waiter's last future

    def wait(self, work) -> None:
        if self.seconds <= 0 or self._world == 1 or work.is_completed():
            work.wait()
            return
        try:
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            finished = done.wait(self.seconds)
        except RuntimeError:  # a Work without a future (gloo's reduce-scatter): a thread waits instead
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(1, thread_name_prefix="rayzero-stage3-wait")
            self._waiting = self._waiter.submit(work.wait)
            try:
                self._waiting.result(timeout=self.seconds)
                finished = True
            except FutureTimeout:
                finished = False
        if not finished:
            self._check()
        work.wait()

    def close(self) -> None:
        """Stop the waiting thread, if one was started, and watch no more: the engine is being
        closed, and its last gathers (handing the parameters back) wait plainly."""
        self.seconds = 0.0
        if self._waiter is not None:
            # an idle thread is joined (close() leaves no thread behind); one still in a wait that
            # timed out is let go, not waited for
            self._waiter.shutdown(wait=self._waiting is None or self._waiting.done())
            self._waiter = self._waiting = None

    def _check(self) -> None:
        step, name, departed = self._where()
        if step == self._checked_step:
            return
        self._checked_step = step
        try:
            store = dist.PrefixStore(f"rayzero/stage3-stall/{self._group_tag()}/{step}/",
                                     dist.distributed_c10d._get_default_store())
            store.set(str(self._rank), f"{int(departed)}{name}")
            keys = [str(rank) for rank in range(self._world)]
            store.wait(keys, datetime.timedelta(seconds=self.seconds))
            said = [store.get(key).decode() for key in keys]
        except (RuntimeError, ValueError):  # some rank did not get here (not stuck, or stuck elsewhere)
            return
        names = [entry[1:] for entry in said]
        if len(set(names)) > 1 and any(entry[0] == "1" for entry in said):
            raise different_modules_error(names)

    def _group_tag(self) -> str:
        """The same on every rank of the group, different between groups of one world."""
        if self._group is None or self._group is dist.group.WORLD:
            return "world"
        return "-".join(str(rank) for rank in dist.get_process_group_ranks(self._group))
