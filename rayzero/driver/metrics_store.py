"""The run's metrics as stored: Parquet part files under `<run>/metrics.parquet/`, read as one table.

[Note: metrics in parts]
A run reports one row per rank and step for as long as it runs (64 ranks x 200,000 steps is 12.8 M
rows), so nothing may keep or rewrite the whole history: the driver's writer (metrics_log.py)
appends each batch of new rows as its own part file, `metrics.parquet/part-a<attempt>-<n>.parquet`,
and forgets them. A flush costs the new rows only, and the driver holds a bounded buffer.

`metrics.parquet` is therefore a directory: a Parquet dataset that pyarrow, pandas, polars and
DuckDB read as one table. Parts are never rewritten, so a step the run did again after a restart
appears once per attempt in the raw rows. The replacement happens on read: `read_metrics` keeps,
for each (rank, step), the row of the newest attempt (the last written), at the place the step
first appeared; rows without a `step` are all kept. That is the table `Result.metrics_history`,
`rayzero plot` and a same-name rerun see. Parts are named by attempt, so a rerun learns the next
attempt number from the file names alone, without reading a row.

The dataset also holds the run's goodput: one row per attempt and cause ([Note: goodput accounting]),
with the runtime's own columns `goodput_cause` and `goodput_seconds` and no `rank` or `step`.
`read_metrics` leaves them out unless asked (`goodput=True` returns only them), so a table of
reports never has rows that are not reports.

Columns can differ between parts (a key reported only later, an int column that later holds
floats): `read_metrics` unifies them (numbers widen, anything else that disagrees becomes text). A
run written by an earlier rayzero as one `metrics.parquet` file is moved into the directory as its
first part when the run is continued (`adopt_single_file`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any, overload

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.errors import RayZeroValueError

METRICS_DIR = "metrics.parquet"
PART = re.compile(r"^part-a(\d+)-(\d+)\.parquet$")

REPORT_COLUMNS = ("rank", "seq", "time", "checkpoint", "peak_memory_bytes", "placement", "attempt", "engine_lr",
                  "intra_node_bytes", "inter_node_bytes", "goodput_cause", "goodput_seconds")
"""Columns the runtime adds to every row; a loop's metric of the same name is stored as `metric_<name>`."""


def part_name(attempt: int, index: int) -> str:
    return f"part-a{attempt:06d}-{index:08d}.parquet"


def metric_column(key: str) -> str:
    """The column a loop's metric `key` is stored in (reversible: see `metric_key`)."""
    return f"metric_{key}" if key in REPORT_COLUMNS or key.startswith("metric_") else key


def metric_key(column: str) -> str:
    return column.removeprefix("metric_")


# ---- rows -> table ----------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """numpy / torch scalars as Python numbers; anything pyarrow cannot store as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str, list, dict)):
        return value
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    return json.dumps(value, default=str)


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    try:
        return pa.array([_plain(v) for v in values])
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # a key whose values mix kinds (a number here, a string there): kept, as text
        return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(_plain(v), default=str))
                         for v in values], type=pa.string())


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table with one column per key any row has (null where a row lacks it); linear in the rows."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return pa.table({key: _column([row.get(key) for row in rows]) for key in keys})


# ---- where the parts are -------------------------------------------------------------------------

def metrics_location(run: str) -> str:
    """`run` may be a run directory (path or URI) or its metrics.parquet; the URI of metrics.parquet."""
    uri = run if "://" in run else f"file://{_absolute(run)}"
    return uri.rstrip("/") if uri.rstrip("/").endswith(".parquet") else f"{uri.rstrip('/')}/{METRICS_DIR}"


def _absolute(path: str) -> str:
    import os

    return os.path.abspath(path)


def list_parts(filesystem: pafs.FileSystem, directory: str) -> list[tuple[int, int, str]]:
    """(attempt, index, path) of every part under `directory`, in writing order."""
    infos = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    parts = []
    for info in infos:
        found = PART.match(info.base_name)
        if found and info.type == pafs.FileType.File:
            parts.append((int(found.group(1)), int(found.group(2)), info.path))
    return sorted(parts)


def adopt_single_file(filesystem: pafs.FileSystem, directory: str) -> None:
    """An earlier rayzero wrote `metrics.parquet` as one file: make it the directory's first part,
    named after the newest attempt it holds (so later attempts sort after it)."""
    if filesystem.get_file_info(directory).type != pafs.FileType.File:
        return
    with filesystem.open_input_file(directory) as source:
        has_attempt = "attempt" in pq.read_schema(source).names
        attempts = pq.read_table(source, columns=["attempt"]).column("attempt") if has_attempt else None
    newest = pc.max(attempts).as_py() if attempts is not None and len(attempts) else 0
    moved = f"{directory}.single-file"
    filesystem.move(directory, moved)
    filesystem.create_dir(directory, recursive=True)
    filesystem.move(moved, f"{directory}/{part_name(int(newest or 0), 0)}")


# ---- attempts ------------------------------------------------------------------------------------
# [Note: attempts on record]
# Every attempt of a run (a worker group: the first, each restart, each resize, each same-name rerun)
# is recorded as `<run>/attempts/attempt-<n>.json`: its run-wide number n (the `attempt` column of
# the metrics), why it began, its Unix start time, the checkpoint step it resumed from and its size.
# Plots label restarts with the cause, and time between attempts is attributed to it. One small file
# per attempt, written once: no rewrite, any pyarrow.fs store.

ATTEMPTS_DIR = "attempts"
GOODPUT_FILE = "goodput.json"  # the run's goodput totals so far ([Note: goodput accounting])


def read_goodput(run: str) -> dict[str, Any] | None:
    """What earlier `fit` calls of the run left (None for a new run)."""
    uri = run if "://" in run else f"file://{_absolute(run)}"
    filesystem, path = filesystem_from_uri(uri)
    try:
        with filesystem.open_input_stream(f"{path.rstrip('/')}/{GOODPUT_FILE}") as source:
            return json.loads(source.read().decode())
    except (OSError, ValueError):
        return None


def attempts_directory(run_path: str) -> str:
    return f"{run_path.rstrip('/')}/{ATTEMPTS_DIR}"


def attempt_file_name(attempt: int) -> str:
    return f"attempt-{attempt:06d}.json"


def read_attempts(run: str) -> list[dict[str, Any]]:
    """The run's attempt records, in attempt order ([] when there are none)."""
    uri = run if "://" in run else f"file://{_absolute(run)}"
    if uri.rstrip("/").endswith(".parquet"):
        uri = uri.rstrip("/").rsplit("/", 1)[0]
    filesystem, path = filesystem_from_uri(uri)
    records = []
    for info in filesystem.get_file_info(pafs.FileSelector(attempts_directory(path), allow_not_found=True)):
        if info.type == pafs.FileType.File and re.match(r"^attempt-\d+\.json$", info.base_name):
            try:
                with filesystem.open_input_stream(info.path) as source:
                    records.append(json.loads(source.read().decode()))
            except (OSError, ValueError):
                continue  # a record is advice for plots: a damaged one is skipped
    return sorted(records, key=lambda record: record.get("attempt", 0))


# ---- reading ---------------------------------------------------------------------------------

def _unified(tables: list[pa.Table]) -> pa.Table:
    """One table from parts whose columns may differ ([Note: metrics in parts])."""
    if not tables:
        return pa.table({})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    kinds: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for field in table.schema:
            kinds.setdefault(field.name, set()).add(field.type)
    numeric = {name for name, types in kinds.items()
               if all(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t) for t in types)}
    fixed = []
    for table in tables:
        for index, field in enumerate(table.schema):
            if len(kinds[field.name] - {pa.null()}) <= 1:
                continue
            target = pa.float64() if field.name in numeric else pa.string()
            column = table.column(index)
            if target == pa.string() and not (pa.types.is_string(field.type) or pa.types.is_null(field.type)):
                column = pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()],
                                  type=pa.string())
            table = table.set_column(index, field.name, column.cast(target))
        fixed.append(table)
    return pa.concat_tables(fixed, promote_options="permissive")


def _newest_per_step(table: pa.Table) -> pa.Table:
    """Each (rank, step) once: the last row written for it, at the place the step first appeared."""
    if table.num_rows == 0 or "step" not in table.column_names or "rank" not in table.column_names:
        return table
    table = table.append_column("_order", pa.array(range(table.num_rows), type=pa.int64()))
    has_step = pc.is_valid(table.column("step"))
    stepped = table.filter(has_step)
    grouped = stepped.group_by(["rank", "step"], use_threads=False).aggregate(
        [("_order", "min"), ("_order", "max")])
    loose = table.filter(pc.invert(has_step)).column("_order").combine_chunks()  # rows without a step: all kept
    places = pa.concat_arrays([grouped.column("_order_min").combine_chunks(), loose])
    newest = pa.concat_arrays([grouped.column("_order_max").combine_chunks(), loose])
    placed = pc.take(newest, pc.sort_indices(places))
    return table.take(placed).drop_columns(["_order"])


def read_metrics(run: str, *, rank: int | None = None, columns: list[str] | None = None,
                 since_attempt: int = 0, raw: bool = False, goodput: bool = False) -> pa.Table:
    """The run's metrics as one table ([Note: metrics in parts]).

    `run`: a run directory or URI (`Result.path`) or its metrics.parquet. `rank`: only that rank's
    rows. `columns`: only these (plus what the replacement needs). `since_attempt`: only rows of
    that attempt and later. `raw=True`: every row as written (a re-run step once per attempt).
    `goodput=True`: the goodput rows instead of the reports (attempt, time, goodput_cause,
    goodput_seconds). Each part is read filtered, so memory holds what is asked for, not the whole run.
    """
    location = metrics_location(run)
    filesystem, directory = filesystem_from_uri(location)
    info = filesystem.get_file_info(directory)
    if info.type == pafs.FileType.NotFound:
        raise RayZeroValueError(f"no metrics log at {location}: give a run directory (<storage>/<name>, what "
                                "rayzero.fit reports as Result.path) or its metrics.parquet")
    if info.type == pafs.FileType.File:  # written by an earlier rayzero: one file
        sources = [(0, 0, directory)]
    else:
        sources = [part for part in list_parts(filesystem, directory) if part[0] >= since_attempt]
    wanted = None if columns is None else list(dict.fromkeys([*columns, "rank", "step", "attempt", GOODPUT_CAUSE]))
    tables = []
    for _, _, path in sources:
        with filesystem.open_input_file(path) as source:
            names = pq.read_schema(source).names
            selected = None if wanted is None else [name for name in wanted if name in names]
            table = pq.read_table(source, columns=selected)
        if rank is not None:  # a part without a rank column holds no rank's rows (goodput rows)
            table = (table.filter(pc.equal(table.column("rank"), rank)) if "rank" in table.column_names
                     else table.slice(0, 0))
        if since_attempt and "attempt" in table.column_names:
            table = table.filter(pc.greater_equal(table.column("attempt"), since_attempt))
        tables.append(_goodput_rows(table, goodput))
    table = _unified(tables)
    if goodput:
        return table
    if columns is not None and GOODPUT_CAUSE not in columns and GOODPUT_CAUSE in table.column_names:
        table = table.drop_columns([GOODPUT_CAUSE])
    return table if raw else _newest_per_step(table)


GOODPUT_CAUSE = "goodput_cause"


def _goodput_rows(table: pa.Table, goodput: bool) -> pa.Table:
    """Only the goodput rows (`goodput`), or only the reports, of one part."""
    if GOODPUT_CAUSE not in table.column_names:
        return table.slice(0, 0) if goodput else table
    is_goodput = pc.is_valid(table.column(GOODPUT_CAUSE))
    table = table.filter(is_goodput if goodput else pc.invert(is_goodput))
    if goodput:  # the report columns a goodput row never has
        return table.select([name for name in table.column_names
                             if name in ("attempt", "time", GOODPUT_CAUSE, "goodput_seconds")])
    return table.drop_columns([name for name in (GOODPUT_CAUSE, "goodput_seconds") if name in table.column_names])


def row_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """The dict a loop reported, from its stored row (runtime columns and unreported keys dropped)."""
    return {metric_key(column): value for column, value in row.items()
            if column not in REPORT_COLUMNS and value is not None}


class MetricsHistory(Sequence[dict[str, Any]]):
    """What one rank reported during one `fit` call, read from storage on first use (a rerun's
    history is its own: the attempts from `first_attempt` on). A re-run step appears once."""

    def __init__(self, run_uri: str, rank: int = 0, first_attempt: int = 0) -> None:
        self._run_uri, self._rank, self._first_attempt = run_uri, rank, first_attempt
        self._items: list[dict[str, Any]] | None = None

    def _load(self) -> list[dict[str, Any]]:
        if self._items is None:
            try:
                table = read_metrics(self._run_uri, rank=self._rank, since_attempt=self._first_attempt)
            except RayZeroValueError:  # nothing was reported
                table = pa.table({})
            self._items = [row_metrics(row) for row in table.to_pylist()]
        return self._items

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        return self._load()[index]

    def __len__(self) -> int:
        return len(self._load())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._load())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        loaded = f"{len(self._items)} reports" if self._items is not None else "not read yet"
        return f"MetricsHistory({self._run_uri!r}, rank={self._rank}, {loaded})"
