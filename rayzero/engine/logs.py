"""Where the engine's own log lines go when the program has not configured logging.

[Note: visible engine logs]
DeepSpeed prints what a config asks it to print (`steps_per_print`'s `step=N, skipped=…` line,
`wall_clock_breakdown`'s timings, the activation-checkpointing profile, checkpoint loads) through
its own logger, which writes INFO to stderr by default. rayzero logs the same lines at INFO on the
`rayzero.engine` loggers, which Python would drop (no handler: only WARNING reaches stderr). So the
first `rayzero.initialize` gives `rayzero.engine` a stderr handler at INFO, unless the program
configured it already. (Config notes stay as they were: their warnings print, their "auto:"
resolutions are INFO for whoever asks, and `rayzero config validate` prints them all.) The handler
steps aside whenever the root logger has a handler (a program that calls `logging.basicConfig`,
pytest's capture, Ray's worker logging): records propagate there instead, so no line is printed
twice.
"""
from __future__ import annotations

import logging
import sys

_LOGGER = "rayzero.engine"


class _DefaultHandler(logging.StreamHandler):
    """stderr, only while nothing else would print the record."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)


def show_engine_logs() -> None:
    """Make the engine's INFO lines visible ([Note: visible engine logs]); idempotent."""
    package = logging.getLogger(_LOGGER)
    if package.handlers:
        return
    handler = _DefaultHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[rayzero] %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
