"""The run's metrics log: every rank's reports as one Parquet table under the run's storage URI.

One row per (rank, step): after a restart the group re-runs the steps since the newest checkpoint,
and their rows replace the earlier attempt's (the `attempt` column says which attempt wrote a row),
so a plot or a `groupby(step)` never sees a step twice. Reports without a `step` key are all kept.
A new attempt is recognised by a rank's report sequence number starting again (every attempt
starts fresh worker processes, whose `seq` counts from 0).

Written through `pyarrow.fs`, so file://, s3://, gs://, hdfs:// all work. Parquet files cannot be
appended to, so the whole table is rewritten (to a temporary name, then moved) on each flush; the
driver flushes every `flush_interval_s` and at the end, so a crashed driver loses at most that much.
"""
from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.workers.session import Report, as_row

METRICS_FILE = "metrics.parquet"


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    return json.dumps(value, default=str)


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table with one column per key; a column whose values mix types is stored as text."""
    columns: dict[str, list[Any]] = {}
    for index, row in enumerate(rows):
        for key in row:
            columns.setdefault(key, [None] * index)
        for key, values in columns.items():
            values.append(_scalar(row.get(key)))
    arrays = {}
    for key, values in columns.items():
        try:
            arrays[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[key] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
    return pa.table(arrays)


class MetricsLog:
    """Collects reports and writes `<run uri>/metrics.parquet`."""

    def __init__(self, run_uri: str, flush_interval_s: float = 30.0) -> None:
        self._filesystem, self._dir = filesystem_from_uri(run_uri)
        self.uri = run_uri.rstrip("/") + "/" + METRICS_FILE
        self._rows: list[dict[str, Any]] = []
        self._row_of: dict[tuple[int, Any], int] = {}  # (rank, step) -> index in _rows
        self._last_seq: dict[int, int] = {}  # rank -> newest seq of the current attempt
        self._metrics: list[dict[str, Any]] = []  # per row: the dict the loop reported
        self.attempt = 0
        """The attempt the newest report came from (0 first, +1 on each restart seen)."""
        self._flush_interval_s = flush_interval_s
        self._flushed_at = time.monotonic()
        self._dirty = False
        # A rerun of the same run name appends to its log instead of replacing it: the earlier rows
        # stay (a step this run re-does replaces its row), this run's reports are a later attempt,
        # and `history()` is this run's own (None marks a row no report of this run wrote).
        try:
            with self._filesystem.open_input_file(f"{self._dir}/{METRICS_FILE}") as source:
                self._rows = pq.read_table(source).to_pylist()
        except (OSError, pa.ArrowInvalid):
            pass
        self._metrics = [None] * len(self._rows)
        for index, row in enumerate(self._rows):
            step = row.get("step")
            if isinstance(row.get("rank"), int) and isinstance(step, (int, float, str)) and not isinstance(step, bool):
                self._row_of[(row["rank"], step)] = index
        attempts = [row["attempt"] for row in self._rows if isinstance(row.get("attempt"), int)]
        self.attempt = max(attempts) + 1 if attempts else 0

    def add(self, item: Report) -> None:
        if item.seq <= self._last_seq.get(item.rank, -1):  # a fresh worker process: the next attempt
            self.attempt += 1
            self._last_seq.clear()
        self._last_seq[item.rank] = item.seq
        row = as_row(item)
        row["attempt"] = self.attempt
        step = item.metrics.get("step")
        key = (item.rank, step) if isinstance(step, (int, float, str)) and not isinstance(step, bool) else None
        if key is not None and key in self._row_of:
            index = self._row_of[key]  # a re-run step: the newer attempt's row replaces the older one
            self._rows[index], self._metrics[index] = row, item.metrics
        else:
            if key is not None:
                self._row_of[key] = len(self._rows)
            self._rows.append(row)
            self._metrics.append(item.metrics)
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self._flush_interval_s:
            self.flush()

    def history(self, rank: int = 0) -> list[dict[str, Any]]:
        """What `rank` reported, one dict per step (a re-run step's newest report), in step order of
        first appearance; what `Result.metrics_history` holds for rank 0."""
        return [metrics for row, metrics in zip(self._rows, self._metrics)
                if row["rank"] == rank and metrics is not None]

    def flush(self) -> None:
        self._flushed_at = time.monotonic()
        if not self._dirty or not self._rows:
            return
        self._filesystem.create_dir(self._dir, recursive=True)
        final = f"{self._dir}/{METRICS_FILE}"
        temporary = f"{final}.tmp"
        with self._filesystem.open_output_stream(temporary) as stream:
            pq.write_table(rows_to_table(self._rows), stream)
        self._filesystem.move(temporary, final)
        self._dirty = False
