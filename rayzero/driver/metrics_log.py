"""The run's metrics log: every rank's reports, appended to `<run uri>/metrics.parquet/` in parts.

[Note: reporting never waits]
The driver's main thread polls the controller and hands each report to `MetricsLog.add`, which only
turns it into a row and queues it: O(1), no I/O. A writer thread takes the queued rows in batches
and writes each batch as a new Parquet part file ([Note: metrics in parts] in metrics_store.py),
every `flush_interval_s` or as soon as `rows_per_part` rows wait. So a flush costs only the new
rows, and the driver holds at most `max_pending_rows` rows, whatever the run's length.

[Note: rows wait as Arrow columns]
A row is a dict of Python objects (~1 kB with its values); a flush interval's worth of them (60,000
rows at 2,000 a second) held for 30 s and then freed all at once left Python's small-object
allocator with arenas it could not give back, a few long-lived objects pinning each: the driver's
memory crept by ~2.4 MiB per 100,000 steps with no object kept (bench/longrun.py: its arenas grew,
its live blocks did not). So the writer turns the queued rows into an Arrow table every
`CHUNK_ROWS` rows (its buffers are pyarrow's, not Python objects), and the rows live for a chunk's
worth of reports only; the part is written from those tables, as before at the interval or at
`rows_per_part` rows. A waiting row costs ~100 bytes instead of ~1 kB.

[Note: the driver's long-lived objects]
Python's small-object allocator (objects up to 512 bytes) takes memory in 1 MiB arenas and gives an
arena back only once every block in it is free. The driver makes and frees thousands of small objects
a second (each report, its row), so an object kept for the run and made among them lands in an arena
that burst opened and holds all of it once the burst is freed: memory grows by arenas, not by the
kept objects' size. bench/longrun.py simulate measured it over 10^7 rows from 64 ranks: the flush log
as a dict of three floats per written part (497 of them) took Python's arenas 33 -> 35 MiB while its
live blocks grew by ~4,000 (the benchmark's own samples, kept as dicts, among them). So what the driver
keeps for the run is kept outside that allocator: the flush log in one buffer of doubles
(`FlushLog`), bench/longrun.py's samples as JSON text (a string past 512 bytes is malloc's). The
arenas then stay at 33 MiB over the 10^7 rows (live blocks +47). After each part the writer also hands
back the free pages of malloc ([Note: the allocator's free pages]) and of pyarrow's pool (mimalloc
keeps freed pages: the driver's RSS swung by ~5 MiB from one sample to the next with it).

A slow or dead sink (storage down, s3 throttling) costs metrics, never steps: the writer keeps
retrying with a growing pause while rows wait; once `max_pending_rows` wait, further rows are
dropped and counted, and the driver says so once per trouble (the error, the rows dropped so far)
and again in the summary. `close()` writes what is left, waiting at most its timeout.

Each row carries the run's attempt: the controller's attempt of the report (its worker group)
after those of earlier `fit` calls of the same name, whose newest the part names give. Each
attempt's start (why: start, rerun, worker died, hang, preemption, resize, ...) is written beside the
rows as `<run>/attempts/attempt-<n>.json` ([Note: attempts on record]).

Written through `pyarrow.fs`, so file://, s3://, gs://, hdfs:// all work.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.controller.status import AttemptStart
from rayzero.driver.metrics_store import (
    GOODPUT_FILE,
    METRICS_DIR,
    MetricsHistory,
    adopt_single_file,
    attempt_file_name,
    attempts_directory,
    list_parts,
    metric_column,
    part_name,
    read_attempts,
    rows_to_table,
)
from rayzero.workers.heap import release_free_heap
from rayzero.workers.session import Report

METRICS_FILE = METRICS_DIR  # the name users and older code know
CHUNK_ROWS = 1024
"""Queued rows the writer turns into one Arrow table ([Note: rows wait as Arrow columns])."""


def report_row(item: Report, attempt: int) -> dict[str, Any]:
    """A flat row: the runtime's columns, then the loop's metrics (a clashing key as `metric_<key>`)."""
    row: dict[str, Any] = {field.name: getattr(item, field.name) for field in dataclasses.fields(item)
                           if field.name not in ("metrics", "layout")}
    row["attempt"] = attempt
    for key, value in item.metrics.items():
        row[metric_column(str(key))] = value
    return row


class MetricsLog:
    """Queues reports as rows; a writer thread appends them to `<run uri>/metrics.parquet/` in parts."""

    def __init__(self, run_uri: str, flush_interval_s: float = 30.0, rows_per_part: int = 20_000,
                 max_pending_rows: int = 100_000, emit: Callable[[str], None] = print) -> None:
        self._filesystem, run_path = filesystem_from_uri(run_uri)
        self._run_uri, self._run_path = run_uri, run_path
        self._dir = f"{run_path}/{METRICS_DIR}"
        self.uri = f"{run_uri.rstrip('/')}/{METRICS_DIR}"
        self._flush_interval_s = flush_interval_s
        self._rows_per_part = rows_per_part
        self._max_pending = max_pending_rows  # the bound on driver memory ([Note: reporting never waits])
        self._emit = emit
        try:  # a rerun of the same name continues the directory with its next attempt
            adopt_single_file(self._filesystem, self._dir)
            newest = max([part[0] for part in list_parts(self._filesystem, self._dir)]
                         + [record["attempt"] for record in read_attempts(run_uri)], default=-1)
        except OSError:
            newest = -1
        self.first_attempt = newest + 1
        """The attempt of this log's first report (0, or the one after a same-name predecessor's newest)."""
        self.attempt = self.first_attempt
        """The attempt the newest report came from (+1 on each restart seen)."""
        self._next_index = 0
        self._pending: list[dict[str, Any]] = []  # rows not yet turned into a table
        self._tables: list[tuple[int, pa.Table]] = []  # (attempt, rows as a table) not yet written, in order
        self._table_rows = 0  # rows in _tables
        self._converting = 0  # rows the writer took from _pending and is turning into tables
        self._pending_attempts: list[dict[str, Any]] = []  # attempt records not yet written
        self._goodput: dict[str, Any] | None = None  # newest goodput snapshot not yet written
        self._cond = threading.Condition()
        self._flush_now = False
        self._closing = False
        self._writing = False  # a batch is being written (flush() waits for it)
        self.rows_written = 0
        self.parts_written = 0
        self.dropped = 0
        """Rows lost because the sink fell behind by more than `max_pending_rows`."""
        self.flush_log = FlushLog()
        """Per written batch, the newest 10,000: rows written before it, its rows, seconds (bench/longrun.py)."""
        self._trouble: str | None = None  # the sink's current error, said once per streak
        # started at once: its first conversion's imports are done before the first reports come
        self._writer = threading.Thread(target=self._write_loop, name="rayzero-metrics", daemon=True)
        self._writer.start()

    # ---- the driver's side: O(1) per report -------------------------------------------------
    def add(self, item: Report) -> None:
        self.attempt = self.first_attempt + item.attempt  # the run's attempt: this call's, after its predecessors'
        row = report_row(item, self.attempt)
        with self._cond:
            if self._queued() >= self._max_pending:
                self.dropped += 1
                return
            self._pending.append(row)
            if len(self._pending) >= CHUNK_ROWS or self._queued() >= self._rows_per_part:
                self._cond.notify()

    def _queued(self) -> int:
        """Rows not yet written (the caller holds the lock)."""
        return len(self._pending) + self._converting + self._table_rows

    def add_attempt(self, start: AttemptStart) -> None:
        """Record an attempt's start (written with the next batch: [Note: attempts on record])."""
        record = dataclasses.asdict(start)
        record["attempt"] = self.first_attempt + start.attempt
        with self._cond:
            self._pending_attempts.append(record)

    def set_goodput(self, snapshot: dict[str, Any]) -> None:
        """The run's newest goodput figures: written as `<run>/goodput.json` with the next batch, so
        a rerun (even after the driver was killed) goes on from them ([Note: goodput accounting])."""
        if snapshot:
            with self._cond:
                self._goodput = snapshot

    def goodput_rows(self, snapshot: dict[str, Any]) -> None:
        """One row per attempt of this call and per cause (seconds), beside the reports in the dataset
        (`goodput_cause`, `goodput_seconds`; no `rank` or `step`: `read_metrics(goodput=True)` reads them)."""
        now = time.time()
        for attempt, buckets in sorted((snapshot.get("attempts") or {}).items(), key=lambda item: int(item[0])):
            for cause, seconds in sorted(buckets.items()):
                row = {"attempt": self.first_attempt + int(attempt), "goodput_cause": cause,
                       "goodput_seconds": seconds, "time": now}
                with self._cond:
                    self._pending.append(row)

    def history(self, rank: int = 0) -> MetricsHistory:
        """What `rank` reported in this log's attempts, one dict per step (a re-run step's newest
        report), in step order of first appearance; read from storage when first used."""
        return MetricsHistory(self._run_uri, rank, self.first_attempt)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Write every queued row now; True when all were written within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flush_now = True
            self._cond.notify()
            while self._unwritten() and time.monotonic() < deadline:
                self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            return not self._unwritten()

    def _unwritten(self) -> bool:
        """Rows, attempt records or goodput not yet written, or a write under way (the caller holds the lock)."""
        return bool(self._queued() or self._pending_attempts or self._goodput or self._writing)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is left (at most `timeout_s`), stop the writer, and say what was lost."""
        written = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            left = self._queued()
            self._cond.notify()
        if not written and left:
            self.dropped += left
            self._emit(f"[rayzero] metrics: {left} row(s) could not be written to {self.uri} within "
                       f"{timeout_s:g}s ({self._trouble or 'the sink is slow'}); they are lost")
        if self.dropped:
            self._emit(f"[rayzero] metrics: {self.dropped} row(s) were dropped in all because the metrics sink "
                       f"fell behind; training was not slowed")

    # ---- the writer thread ------------------------------------------------------------------
    def _write_loop(self) -> None:
        # pyarrow's first conversion of Python values imports pandas (~0.7 s): paid now, not while the
        # first chunk's rows wait (a feeder at tens of thousands of rows a second filled the bound meanwhile)
        rows_to_table([{"warm": 1}])
        pause = 0.0  # after a failed write: wait before the next try
        written_at = time.monotonic()
        while True:
            with self._cond:
                # after a failure the pause holds even when a part's worth is queued: a dead sink is
                # retried with backoff, not in a busy loop (a flush or close asks at once); rows are
                # turned into tables meanwhile all the same
                while not self._closing and not self._flush_now and len(self._pending) < CHUNK_ROWS:
                    left = (pause or self._flush_interval_s) - (time.monotonic() - written_at)
                    if left <= 0 or (not pause and self._queued() >= self._rows_per_part):
                        break
                    self._cond.wait(left)
                if self._closing:
                    return
                rows, self._pending = self._pending, []
                self._converting = len(rows)
                due = (time.monotonic() - written_at >= (pause or self._flush_interval_s)
                       or (not pause and self._queued() >= self._rows_per_part))
                write = self._flush_now or due
                if write:
                    attempts, self._pending_attempts = self._pending_attempts, []
                    goodput, self._goodput = self._goodput, None
                    self._flush_now = False
                self._writing = write
            tables: list[tuple[int, pa.Table]] = []
            try:
                tables = _tables_of(rows)  # outside the lock: add() goes on meanwhile
            except Exception as error:  # noqa: BLE001 - a row pyarrow cannot take costs that chunk, not the run
                self.dropped += len(rows)
                self._emit(f"[rayzero] metrics: {len(rows)} row(s) could not be turned into a table and are lost "
                           f"({type(error).__name__}: {error})")
                rows = []
            finally:
                with self._cond:
                    self._tables.extend(tables)
                    self._table_rows += len(rows)
                    self._converting = 0
                    self._cond.notify_all()
            del rows
            if not write:
                continue
            written_at = time.monotonic()
            try:
                if goodput:
                    self._write_json(f"{self._run_path}/{GOODPUT_FILE}", goodput)
                    goodput = None
                if attempts:
                    self._write_attempts(attempts)
                    attempts = []
                if self._tables:
                    self._write()
                    release_free_heap()  # [Note: the allocator's free pages]
                    pa.default_memory_pool().release_unused()  # pyarrow's pool (mimalloc) keeps freed pages
                pause = 0.0
                if self._trouble is not None:
                    self._emit(f"[rayzero] metrics: writing to {self.uri} works again")
                    self._trouble = None
            except Exception as error:  # noqa: BLE001 - storage trouble costs metrics, never the run
                pause = min(60.0, max(1.0, pause * 2))
                with self._cond:  # what was not written stays queued (the tables stay where they are)
                    self._pending_attempts = attempts + self._pending_attempts
                    self._goodput = self._goodput or goodput
                message = f"{type(error).__name__}: {error}"
                if self._trouble is None:
                    self._emit(f"[rayzero] metrics: cannot write to {self.uri} ({message}); retrying, "
                               f"training goes on ({self.dropped} row(s) dropped so far)")
                self._trouble = message
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write_attempts(self, records: list[dict[str, Any]]) -> None:
        directory = attempts_directory(self._run_path)
        self._filesystem.create_dir(directory, recursive=True)
        for record in records:
            self._write_json(f"{directory}/{attempt_file_name(record['attempt'])}", record)

    def _write_json(self, path: str, record: dict[str, Any]) -> None:
        """Written whole under a temporary name, then moved: a reader sees the old file or the new one."""
        directory, _, name = path.rpartition("/")
        self._filesystem.create_dir(directory, recursive=True)
        with self._filesystem.open_output_stream(f"{directory}/.{name}.tmp") as stream:
            stream.write(json.dumps(record).encode())
        self._filesystem.move(f"{directory}/.{name}.tmp", path)

    def _write(self) -> None:
        """The queued tables as new parts, one per attempt among them (names sort in writing order);
        each table leaves the queue once its part is written."""
        started, rows_before = time.monotonic(), self.rows_written
        self._filesystem.create_dir(self._dir, recursive=True)
        with self._cond:
            tables = list(self._tables)
        batch_rows = sum(table.num_rows for _, table in tables)
        start = 0
        while start < len(tables):
            attempt = tables[start][0]
            end = start
            while end < len(tables) and tables[end][0] == attempt:
                end += 1
            try:  # one part of the attempt's tables; columns that differ between them are unified
                parts = [pa.concat_tables([table for _, table in tables[start:end]], promote_options="permissive")]
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                parts = [table for _, table in tables[start:end]]  # a key whose kind changed: a part each
            for part in parts:
                name = part_name(attempt, self._next_index)
                temporary = f"{self._dir}/.{name}.tmp"  # dot-named: readers of the dataset skip it
                with self._filesystem.open_output_stream(temporary) as stream:
                    pq.write_table(part, stream)
                self._filesystem.move(temporary, f"{self._dir}/{name}")
                self._next_index += 1
                self.parts_written += 1
            written = sum(table.num_rows for _, table in tables[start:end])
            self.rows_written += written
            with self._cond:
                del self._tables[:end - start]
                self._table_rows -= written
            start = end
        self.flush_log.append(rows_before, batch_rows, time.monotonic() - started)


class FlushLog:
    """The newest `capacity` flushes (rows before, rows, seconds) in packed doubles: a record a flush
    kept as Python objects, made among a burst of rows, pins an arena of Python's allocator for the
    run ([Note: the driver's long-lived objects]). Read as dicts: `log[-1]["seconds"]`, `list(log)`."""

    FIELDS = ("rows_before", "rows", "seconds")

    def __init__(self, capacity: int = 10_000) -> None:
        self._capacity = capacity
        self._values = array("d", bytes(8 * len(self.FIELDS) * capacity))  # one malloc'd buffer, never grown
        self._count = 0  # flushes appended in all

    def append(self, rows_before: float, rows: float, seconds: float) -> None:
        at = (self._count % self._capacity) * len(self.FIELDS)
        self._values[at], self._values[at + 1], self._values[at + 2] = rows_before, rows, seconds
        self._count += 1

    def __len__(self) -> int:
        return min(self._count, self._capacity)

    def __getitem__(self, index: int) -> dict[str, float]:
        kept = len(self)
        if not -kept <= index < kept:
            raise IndexError(f"flush {index} of {kept}")
        at = ((self._count - kept + index % kept) % self._capacity) * len(self.FIELDS)
        return dict(zip(self.FIELDS, self._values[at:at + len(self.FIELDS)]))

    def __iter__(self) -> Iterator[dict[str, float]]:
        return (self[index] for index in range(len(self)))


def _tables_of(rows: list[dict[str, Any]]) -> list[tuple[int, pa.Table]]:
    """(attempt, table) per run of rows of one attempt, in order."""
    out = []
    start = 0
    while start < len(rows):
        attempt = rows[start]["attempt"]
        end = start
        while end < len(rows) and rows[end]["attempt"] == attempt:
            end += 1
        out.append((attempt, rows_to_table(rows[start:end])))
        start = end
    return out
