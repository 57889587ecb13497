"""The CPU optimizer step overlapped with backward (ZeRO-Offload, stages 1-3).

[Note: step overlapped with backward]
With `offload_optimizer.device: cpu`, each bucket's masters, gradients and optimizer state are the
bucket's own tensors on the host. At the accumulation boundary, as soon as a bucket's gradient
reduction is issued, a background thread waits for it, copies the reduced shard to the host
(the bucket's finish callback) and runs the optimizer on that bucket's master alone, while the main
thread goes on with backward for the earlier layers. `engine.step()` then only waits for the last
buckets and publishes the weights. The math is unchanged, bit for bit: Adam, AdamW and SGD are
elementwise per parameter with a per-parameter step count, so stepping bucket by bucket gives the
same result as one step over all of them. Stage 3 does the same per optimizer sub-group
(`sub_group_size`): a sub-group steps once the last of its gradient shards was added (stage3/strategy.py,
through the reducer's `on_added`); with one sub-group (the default size on most models) that is
the end of backward, so only smaller sub-groups hide the step.

The step applies only where nothing global must be known before any element is updated: no
gradient clipping (the norm needs every gradient) and no fp16 (an overflow anywhere skips the whole
step), and torch's Adam, AdamW or SGD (an arbitrary optimizer may couple its parameters). Otherwise
the step runs after backward, but the thread still finishes each bucket as its reduction completes,
so the device-to-host copies of reduced gradients run during backward in every case.

Where it runs (`RAYZERO_OFFLOAD_OVERLAP_STEP`, `overlap_enabled`): by default (`auto`) only when
compute runs on an accelerator. On a CPU-only machine backward and the host step share the same
cores, and measured there (bench/offload.py `overlap`, 2 cores) the thread hid 86% of the CPU step
but made the whole step 1.08x slower; `1` forces it on (the tests do, to run this path on CPU), `0`
turns it off. Decided in engine/api.py and host.py; bucketed/strategy.py and stage3/strategy.py
(sub-groups) submit; host.py steps them.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rayzero.config.environment import OFFLOAD_OVERLAP_STEP
from rayzero.config.errors import RayZeroRuntimeError


def overlap_enabled(compute_device: torch.device) -> bool:
    """Whether an offloading backend runs the background thread at all ([Note: step overlapped
    with backward]): `auto` (default) on an accelerator only, `1` always, `0` never."""
    mode = OFFLOAD_OVERLAP_STEP.get()
    return mode == "1" or (mode == "auto" and compute_device.type != "cpu")


def overlap_allowed(gradient_clipping: float, fp16: bool, optimizer: torch.optim.Optimizer,
                    elementwise: tuple[type, ...]) -> bool:
    """Whether the math lets the step run during backward ([Note: step overlapped with backward])."""
    return gradient_clipping == 0 and not fp16 and type(optimizer) in elementwise


def run_step(stepper: BackgroundStepper | None, offload, optimizer: torch.optim.Optimizer,
             backward_end: float, pieces: int, what: str) -> None:
    """The optimizer step of a boundary: already done piece by piece during backward (record its
    timings), or run now by the offload backend; `pieces` buckets / sub-groups, named `what`."""
    stepped, seconds, exposed = stepper.take(backward_end) if stepper is not None else (0, 0.0, 0.0)
    if stepped == pieces:
        offload.record_overlapped_step(seconds, exposed)
    elif stepped == 0:
        offload.step(optimizer)
    else:
        raise RayZeroRuntimeError(f"internal: {stepped} of {pieces} {what} stepped during backward")


def _init_thread(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)  # this thread's OpenMP team only


def _stop_pool(pool: ThreadPoolExecutor) -> None:
    """Shut `pool` down and join its thread, unless this runs on that thread (a collection there)."""
    pool.shutdown(wait=False)
    for thread in list(getattr(pool, "_threads", ())):  # CPython's executor keeps its threads here
        if thread is not threading.current_thread():
            thread.join()


class _Pending:
    """An `_inflight` entry of the flat strategy: `wait()` returns once the bucket was stepped."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> bool:
        self.future.result()  # re-raises the background thread's error here
        return True


class BackgroundStepper:
    """One thread that finishes each submitted bucket's reduction and steps its master."""

    def __init__(self, step_subset, threads: int) -> None:
        """`step_subset`: how to step one bucket's master (None: this thread only finishes buckets)."""
        self._step_subset = step_subset  # (optimizer, [master]) -> seconds; None: finish only
        self.can_step = step_subset is not None
        self._threads = threads
        # the initializer must not hold `self`: the thread keeps it for its whole life
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayzero-cpu-step",
                                        initializer=_init_thread, initargs=(threads,))
        # An engine dropped without close() is freed ([Note: gradient hooks hold their engine
        # weakly]): its thread stops then, not at some later point of the executor's own clean-up.
        weakref.finalize(self, _stop_pool, self._pool)
        self.stepped = 0  # buckets stepped since the strategy last consumed them
        self._optimizer: torch.optim.Optimizer | None = None
        self._hyper: list[dict] | None = None  # the groups' hyperparameters the early steps used
        self._spans: list[tuple[float, float]] = []  # perf_counter (start, end) of each bucket's step


    def submit(self, optimizer: torch.optim.Optimizer, master: torch.Tensor, master_grad: torch.Tensor,
               work, finish, step: bool) -> tuple[_Pending, object]:
        """Queue: wait for `work`, run `finish` (the reduced shard into `master_grad`), then, with
        `step`, step this bucket's master."""
        if step and self._hyper is None:
            self._optimizer, self._hyper = optimizer, _hyperparameters(optimizer)
        def run() -> None:
            if work is not None:
                work.wait()
            finish()
            if not step:
                return
            master.grad = master_grad
            start = time.perf_counter()
            self._step_subset(optimizer, [master])
            self._spans.append((start, time.perf_counter()))
            self.stepped += 1
        return _Pending(self._pool.submit(run)), _nothing

    def check_consumed(self) -> None:
        if self.stepped:
            raise RayZeroRuntimeError(
                "engine.backward() was called again at a gradient-accumulation boundary before "
                "engine.step(): with CPU offload the optimizer already stepped during the first "
                "backward; call engine.step() after each boundary backward")

    def _check_hyperparameters(self) -> None:
        """The early steps used the hyperparameters set before backward; a change made after it
        (between engine.backward and engine.step) would apply one step late: refuse it."""
        used, self._hyper = self._hyper, None
        if used is None or self._optimizer is None:
            return
        for index, (before, now) in enumerate(zip(used, _hyperparameters(self._optimizer))):
            changed = [key for key in now if key not in before or not _same(before[key], now[key])]
            if changed:
                raise RayZeroRuntimeError(
                    f"optimizer param group {index}: {', '.join(changed)} changed between engine.backward() and "
                    "engine.step(); with CPU offload the step already ran during backward with the old value "
                    "([Note: step overlapped with backward]). Set hyperparameters before the boundary backward "
                    "(e.g. at the top of the iteration, or through the lr scheduler), or set "
                    "RAYZERO_OFFLOAD_OVERLAP_STEP=0 to step after backward")

    def take(self, backward_end: float) -> tuple[int, float, float]:
        """(buckets stepped, seconds spent stepping, seconds of it after `backward_end` — the part
        backward did not hide) since the last call; resets."""
        self._check_hyperparameters()
        total = sum(end - start for start, end in self._spans)
        exposed = sum(max(0.0, end - max(start, backward_end)) for start, end in self._spans)
        out = (self.stepped, total, exposed)
        self.stepped, self._spans = 0, []
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _nothing() -> None:
    return None


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
