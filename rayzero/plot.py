"""`rayzero plot RUN [--storage URI] [-o run.png]`: a picture of a run from its metrics.parquet.

Against step: the loss (log scale when positive), throughput (samples/s and tokens/s, each on its own
axis, from the cumulative `samples` / `tokens` a loop reports, else steps/s), the learning rate (`lr`
or `learning_rate` the loop reports, else the engine's own), peak memory per rank. Against wall time:
where the time went, per attempt (start-up, training, the pause before the next attempt). Each
restart, resize and rerun is marked at the step it resumed from and labelled with why it happened
(worker died, hang, preemption, resize, rerun: the run's attempt records, [Note: attempts on record]
in rayzero/driver/metrics_store.py). Lines break where steps are missing instead of bridging the gap.
Needs matplotlib (`pip install rayzero[plot]`); no cluster.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.errors import RayZeroValueError

METRICS_FILE = "metrics.parquet"


@dataclass
class Marker:
    step: float
    kind: str  # "restart", "resize" or "rerun"
    label: str


@dataclass
class Segment:
    """A stretch of wall time in the wall-clock panel."""

    attempt: int
    kind: str  # "start-up", "training" or "pause"
    start: float  # seconds since the run's first attempt began
    end: float
    label: str = ""


@dataclass
class RunPicture:
    """What was drawn, for the caller (and tests): the series per panel and the markers."""

    path: str
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = field(default_factory=dict)
    markers: list[Marker] = field(default_factory=list)
    timeline: list[Segment] = field(default_factory=list)
    goodput: dict[str, Any] = field(default_factory=dict)
    """The run's goodput totals (`<run>/goodput.json`, [Note: goodput accounting])."""


def metrics_uri(run: str, storage: str | None) -> str:
    """The metrics.parquet of RUN: a run directory or URI, a metrics.parquet, or a name under --storage."""
    if storage:
        root = storage if "://" in storage else os.path.abspath(storage)
        run = f"{root.rstrip('/')}/{run}"
    if run.endswith(".parquet"):
        return run
    return f"{run.rstrip('/')}/{METRICS_FILE}"


def read_rows(uri: str) -> dict[str, list[Any]]:
    """The run's reports, a re-run step once (its newest attempt), as columns ([Note: metrics in parts])."""
    from rayzero.driver.metrics_store import read_metrics

    return read_metrics(uri).to_pydict()


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _series(rows: dict[str, list[Any]], rank: int, key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    column = rows.get(key)
    if column is None:
        return steps, values
    for index, row_rank in enumerate(rows.get("rank", [])):
        step, value = rows["step"][index], column[index]
        if row_rank == rank and _numeric(step) and _numeric(value):
            steps.append(float(step))
            values.append(float(value))
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [steps[i] for i in order], [values[i] for i in order]


def _rate(rows: dict[str, list[Any]], key: str | None) -> tuple[list[float], list[float]]:
    """Per-interval rate of a cumulative counter (or of steps) between rank 0's successive reports,
    within one attempt (a restart's pause is not throughput)."""
    attempts = rows.get("attempt") or [0] * len(rows["rank"])
    points = sorted(
        (rows["step"][i], rows["time"][i], rows[key][i] if key else rows["step"][i], attempts[i])
        for i, rank in enumerate(rows["rank"])
        if rank == 0 and _numeric(rows["step"][i]) and (key is None or _numeric(rows[key][i])))
    steps, rates = [], []
    for (_, t0, c0, a0), (s1, t1, c1, a1) in itertools.pairwise(points):
        if a0 == a1 and t1 > t0:
            steps.append(float(s1))
            rates.append((c1 - c0) / (t1 - t0))
    return steps, rates


def _with_breaks(steps: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """NaN where steps are missing (a gap wider than twice the usual stride), so no line bridges it."""
    if len(steps) < 3:
        return steps, values
    stride = statistics.median(b - a for a, b in itertools.pairwise(steps)) or 1.0
    out_steps, out_values = [steps[0]], [values[0]]
    for (previous, _), (step, value) in itertools.pairwise(zip(steps, values)):
        if step - previous > 2 * stride:
            out_steps.append((previous + step) / 2)
            out_values.append(math.nan)
        out_steps.append(step)
        out_values.append(value)
    return out_steps, out_values


def _markers(rows: dict[str, list[Any]], records: dict[int, dict[str, Any]]) -> list[Marker]:
    attempts = rows.get("attempt")
    if not attempts:
        return []
    first_step: dict[int, float] = {}
    ranks: dict[int, set[int]] = {}
    for index, attempt in enumerate(attempts):
        step = rows["step"][index]
        ranks.setdefault(attempt, set()).add(rows["rank"][index])
        if _numeric(step):
            first_step[attempt] = min(first_step.get(attempt, float(step)), float(step))
    markers = []
    for previous, attempt in itertools.pairwise(sorted(first_step)):
        cause = str(records.get(attempt, {}).get("cause", ""))
        before, after = len(ranks[previous]), len(ranks[attempt])
        if cause.startswith("resize") or before != after:
            markers.append(Marker(first_step[attempt], "resize", f"{cause or 'resize'} {before}->{after}"))
        elif cause == "rerun":
            markers.append(Marker(first_step[attempt], "rerun", f"rerun (attempt {attempt})"))
        else:
            markers.append(Marker(first_step[attempt], "restart", f"restart {attempt}: {cause or 'cause unknown'}"))
    return markers


def _timeline(rows: dict[str, list[Any]], records: dict[int, dict[str, Any]]) -> list[Segment]:
    """Per attempt: start-up (begin to first report), training (to its last report), and the pause
    until the next attempt began, labelled with that attempt's cause."""
    times: dict[int, list[float]] = {}
    for index, attempt in enumerate(rows.get("attempt") or []):
        if _numeric(rows["time"][index]):
            times.setdefault(attempt, []).append(float(rows["time"][index]))
    attempts = sorted(set(times) | set(records))
    if not attempts:
        return []
    begins = {a: float(records[a]["time"]) if a in records else min(times[a]) for a in attempts}
    origin = min(begins.values())
    segments = []
    for index, attempt in enumerate(attempts):
        begin = begins[attempt] - origin
        reported = times.get(attempt)
        if reported:
            first, last = min(reported) - origin, max(reported) - origin
            if first > begin:
                segments.append(Segment(attempt, "start-up", begin, first))
            segments.append(Segment(attempt, "training", first, last))
            end = last
        else:
            end = begin
        if index + 1 < len(attempts):
            following = attempts[index + 1]
            cause = str(records.get(following, {}).get("cause", "restart"))
            if begins[following] - origin > end:
                segments.append(Segment(attempt, "pause", end, begins[following] - origin, cause))
    return segments


_COLOURS = {"start-up": "tab:orange", "training": "tab:green", "pause": "tab:red"}


def plot_run(run: str, output: str, storage: str | None = None) -> RunPicture:
    """Draw the run's metrics to `output` (PNG, SVG or PDF by extension)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RayZeroValueError("rayzero plot needs matplotlib: pip install 'rayzero[plot]'") from None
    from rayzero.driver.metrics_store import read_attempts, read_goodput

    uri = metrics_uri(run, storage)
    rows = read_rows(uri)  # the reports (goodput rows are read apart)
    if "step" not in rows or "rank" not in rows:
        raise RayZeroValueError(f"{uri} has no `step` column: the loop must report {{'step': ...}} to be plotted")
    records = {int(record["attempt"]): record for record in read_attempts(uri)}
    picture = RunPicture(path=output, markers=_markers(rows, records), timeline=_timeline(rows, records),
                         goodput=read_goodput(uri.rstrip("/").rsplit("/", 1)[0]) or {})
    ranks = sorted(set(rows["rank"]))
    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {
        "loss": {"loss": _series(rows, 0, "loss")} if "loss" in rows else {},
        "throughput": {},
        "learning rate": {},
        "peak memory (GiB)": {},
    }
    for key, label in (("samples", "samples/s"), ("tokens", "tokens/s")):
        if key in rows:
            panels["throughput"][label] = _rate(rows, key)
    if not panels["throughput"] and "time" in rows:
        panels["throughput"]["steps/s"] = _rate(rows, None)
    for key in ("lr", "learning_rate", "engine_lr"):  # what the loop reports, else the engine's own
        if key in rows and _series(rows, 0, key)[0]:
            panels["learning rate"][key if key != "engine_lr" else "engine lr"] = _series(rows, 0, key)
            break
    if "peak_memory_bytes" in rows:
        for rank in ranks:
            steps, values = _series(rows, rank, "peak_memory_bytes")
            panels["peak memory (GiB)"][f"rank {rank}"] = (steps, [v / 2**30 for v in values])
    picture.series = panels

    figure, axes = plt.subplots(5, 1, figsize=(9, 14), gridspec_kw={"height_ratios": [3, 2, 2, 2, 1.2]})
    for axis, (title, lines) in zip(axes[:4], panels.items()):
        _draw_panel(axis, title, lines, picture.markers)
    axes[3].set_xlabel("step")
    for axis in axes[1:4]:
        axis.sharex(axes[0])
    _draw_timeline(axes[4], picture.timeline, picture.goodput)
    figure.suptitle(f"rayzero run {run.rstrip('/').rsplit('/', 1)[-1]}")
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return picture


def _draw_panel(axis: Any, title: str, lines: dict[str, tuple[list[float], list[float]]],
                markers: list[Marker]) -> None:
    axis.set_title(title, loc="left", fontsize=10)
    drawn = [(label, steps, values) for label, (steps, values) in lines.items() if steps]
    if not drawn:
        axis.text(0.5, 0.5, "not reported", transform=axis.transAxes, ha="center", va="center", color="grey")
    for index, (label, steps, values) in enumerate(drawn):
        # samples/s and tokens/s differ by orders of magnitude: the second throughput gets its own axis
        target = axis.twinx() if title == "throughput" and index == 1 else axis
        colour = f"C{index}"
        target.plot(*_with_breaks(steps, values), label=label, linewidth=1.2, color=colour)
        if target is not axis:
            target.set_ylabel(label, color=colour, fontsize=8)
            axis.set_ylabel(drawn[0][0], color="C0", fontsize=8)
    if title == "loss" and drawn and all(v > 0 for _, _, values in drawn for v in values):
        axis.set_yscale("log")
    if len(drawn) > 1 and title != "throughput":
        axis.legend(fontsize=8, loc="best")
    for marker in markers:
        colour = {"restart": "red", "resize": "purple", "rerun": "grey"}[marker.kind]
        axis.axvline(marker.step, color=colour, linestyle="-" if marker.kind == "resize" else "--", linewidth=0.9)
        if title == "loss":
            axis.annotate(marker.label, (marker.step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                          color=colour, xytext=(3, -10), textcoords="offset points", rotation=0)
    axis.grid(alpha=0.3)


def _draw_timeline(axis: Any, segments: list[Segment], goodput: dict[str, Any]) -> None:
    """Row 0: per attempt, start-up / training / pause on the wall clock. Row 1: the run's goodput,
    its productive time and each cause of badput stacked ([Note: goodput accounting])."""
    share = goodput.get("goodput")
    axis.set_title("where the wall time went" + (f": goodput {100 * share:.1f}%" if share is not None else ""),
                   loc="left", fontsize=10)
    if not segments and not goodput:
        axis.text(0.5, 0.5, "no timing recorded", transform=axis.transAxes, ha="center", va="center", color="grey")
        return
    for segment in segments:
        axis.barh(0, segment.end - segment.start, left=segment.start, color=_COLOURS[segment.kind], height=0.6)
        if segment.kind == "pause" and segment.label:
            axis.text((segment.start + segment.end) / 2, 0.45, segment.label, ha="center", fontsize=7, color="red")
    for kind, colour in _COLOURS.items():
        axis.barh(0, 0, color=colour, label=kind)
    left = 0.0
    parts = [("productive", goodput.get("productive_s", 0.0))] + sorted((goodput.get("badput_s") or {}).items())
    for index, (cause, seconds) in enumerate(parts):
        if seconds and seconds > 0:
            axis.barh(1, seconds, left=left, height=0.6, color="tab:green" if cause == "productive" else f"C{index + 3}",
                      label=cause if cause != "productive" else None, hatch="" if cause == "productive" else "//")
            left += seconds
    axis.set_yticks([0, 1] if goodput else [0], ["attempts", "goodput"] if goodput else ["attempts"], fontsize=8)
    axis.set_xlabel("seconds (the attempts since the first began; goodput over every call of the run)")
    axis.legend(fontsize=7, loc="lower right", ncol=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayzero plot", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory or URI (<storage>/<name>), its metrics.parquet, or a "
                                    "run name with --storage")
    parser.add_argument("--storage", default=None, help="root URI the run name is under")
    parser.add_argument("-o", "--output", default="run.png", help="picture file (default run.png)")
    args = parser.parse_args(argv)
    try:
        picture = plot_run(args.run, args.output, args.storage)
    except (RayZeroValueError, OSError) as error:
        print(f"rayzero plot: {error}", file=sys.stderr)
        return 1
    marks = f", {len(picture.markers)} restart/resize mark(s)" if picture.markers else ""
    print(f"wrote {args.output}{marks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
