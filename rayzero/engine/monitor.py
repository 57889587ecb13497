"""What the engine reports while it trains, as DeepSpeed reports it: progress lines every
`steps_per_print` steps, `wall_clock_breakdown` timers, and the `tensorboard` / `csv_monitor` /
`wandb` monitors with DeepSpeed's tag names, written by rank 0 only.

[Note: monitor events]
At every accumulation boundary rank 0 writes (tag, value, step) with step = samples trained so far
(DeepSpeed's `global_samples`): `Train/Samples/train_loss` (mean loss of the window on rank 0, the
tag DeepSpeed's pipeline engine and HF users read), `Train/Samples/lr` (first group),
`Train/Samples/loss_scale` (fp16 only) and, with `wall_clock_breakdown`,
`Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}` summed
over the window. `backward_inner` is autograd's backward, `backward_allreduce` the strategy's
gradient communication (launching buckets after backward and waiting for them at the boundary).
Timers synchronise the accelerator around each phase, as DeepSpeed's do: they cost speed, which is
why they are off by default.
"""
from __future__ import annotations

import contextlib
import csv
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger("rayzero.engine")

TIMER_NAMES = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
"""DeepSpeed's global timers, `elapsed_time_ms_<name>` in the monitors."""


class StepTimers:
    """Milliseconds per phase, summed over one accumulation window (`wall_clock_breakdown`)."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device  # synchronised around each phase so GPU work is counted where it runs
        self.elapsed = dict.fromkeys(TIMER_NAMES, 0.0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.elapsed[name] += (time.perf_counter() - start) * 1000.0

    def take(self) -> dict[str, float]:
        """The window's totals, then zero them for the next window."""
        taken, self.elapsed = self.elapsed, dict.fromkeys(TIMER_NAMES, 0.0)
        return taken


class _CSVWriter:
    """DeepSpeed's csvMonitor layout: <output_path>/<job_name>/<tag with / -> _>.csv, `step,<last part>`."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = os.path.join(output_path, job_name)
        os.makedirs(self.directory, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            filename = tag.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.directory, filename + ".csv"), "a+", newline="") as handle:
                writer = csv.writer(handle)
                if filename not in self.started:
                    self.started.add(filename)
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class _TensorBoardWriter:
    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=os.path.join(output_path, job_name))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    def __init__(self, section: Any) -> None:
        import wandb

        if wandb.run is None:
            wandb.init(project=section.project, group=section.group, entity=section.team)
        self.wandb = wandb

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        pass


class Monitor:
    """The writers the config enables, on rank 0 (no writer anywhere else)."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for writer in self.writers:
            writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def build_monitor(config: Any, rank: int) -> Monitor:
    """Writers for the config's enabled monitor sections; a missing package is warned about by name
    (training goes on: a monitor never changes what is trained)."""
    if rank != 0:
        return Monitor([])
    writers: list[Any] = []
    if config.csv_monitor.enabled:
        writers.append(_CSVWriter(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        try:
            writers.append(_TensorBoardWriter(config.tensorboard.output_path, config.tensorboard.job_name))
        except ImportError:
            logger.warning("tensorboard.enabled is true but the `tensorboard` package is not installed: no "
                           "TensorBoard events are written. Install it: pip install 'rayzero[monitor]'")
    if config.wandb.enabled:
        try:
            writers.append(_WandbWriter(config.wandb))
        except ImportError:
            logger.warning("wandb.enabled is true but the `wandb` package is not installed: nothing is logged to "
                           "Weights & Biases. Install and configure it (WANDB_MODE=offline works without a server)")
    return Monitor(writers)


def progress_line(step: int, skipped: int, optimizer: torch.optim.Optimizer) -> str:
    """DeepSpeed's `_report_progress` line: `step=N, skipped=S, lr=[...], mom=[...]`."""
    lrs = [float(group["lr"]) for group in optimizer.param_groups]
    moms = [group["betas"] if "betas" in group else group.get("momentum") for group in optimizer.param_groups]
    return f"step={step}, skipped={skipped}, lr={lrs}, mom={moms}"
