"""The monitor sections DeepSpeed users already read: `tensorboard`, `csv_monitor`, `wandb`.

Names and defaults are DeepSpeed 0.19's (deepspeed/monitor/config.py). rayzero's engine writes the
same events with the same tags from rank 0 (rayzero.engine.monitor).
"""
from __future__ import annotations

from typing import Optional

from rayzero.config.base import Bool, ConfigModel


class TensorBoardConfig(ConfigModel):
    """TensorBoard event files (needs the `tensorboard` package: `pip install rayzero[monitor]`)."""

    enabled: Bool = False
    """Write TensorBoard events from rank 0."""
    output_path: str = ""
    """Directory the job's directory goes in ("" = the current directory, as DeepSpeed)."""
    job_name: str = "DeepSpeedJobName"
    """Directory inside `output_path` the events are written to."""


class CSVMonitorConfig(ConfigModel):
    """One CSV file per tag (`step,<name>` rows), DeepSpeed's csvMonitor layout."""

    enabled: Bool = False
    """Write CSV files from rank 0."""
    output_path: str = ""
    """Directory the job's directory goes in ("" = the current directory, as DeepSpeed)."""
    job_name: str = "DeepSpeedJobName"
    """Directory inside `output_path` the files are written to."""


class WandbConfig(ConfigModel):
    """Weights & Biases, used only when `wandb` is installed; otherwise a warning names what is missing."""

    enabled: Bool = False
    """Log to Weights & Biases from rank 0."""
    group: Optional[str] = None
    """Run group."""
    team: Optional[str] = None
    """Team (wandb's `entity`)."""
    project: str = "deepspeed"
    """Project."""
