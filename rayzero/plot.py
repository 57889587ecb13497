"""`rayzero plot RUN [--storage URI] [-o run.png]`: a picture of a run from its metrics.parquet.

Four panels against step: loss, throughput (samples/s and tokens/s from the cumulative `samples` /
`tokens` a loop reports, else steps/s), learning rate (`lr` or `learning_rate`), and peak memory per
rank. Restarts (a new `attempt` in the log) are drawn as dashed vertical lines, resizes (an attempt
with a different number of ranks) as solid ones, labelled. Needs matplotlib (`pip install
rayzero[plot]`); no cluster.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.errors import RayZeroValueError

METRICS_FILE = "metrics.parquet"


@dataclass
class Marker:
    step: float
    kind: str  # "restart" or "resize"
    label: str


@dataclass
class RunPicture:
    """What was drawn, for the caller (and tests): the series per panel and the markers."""

    path: str
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = field(default_factory=dict)
    markers: list[Marker] = field(default_factory=list)


def metrics_uri(run: str, storage: str | None) -> str:
    """The metrics.parquet of RUN: a run directory or URI, a metrics.parquet, or a name under --storage."""
    if storage:
        root = storage if "://" in storage else os.path.abspath(storage)
        run = f"{root.rstrip('/')}/{run}"
    if run.endswith(".parquet"):
        return run
    return f"{run.rstrip('/')}/{METRICS_FILE}"


def read_rows(uri: str) -> dict[str, list[Any]]:
    """The run's rows, a re-run step once (its newest attempt), as columns ([Note: metrics in parts])."""
    from rayzero.driver.metrics_store import read_metrics

    return read_metrics(uri).to_pydict()


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _series(rows: dict[str, list[Any]], rank: int, key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for index, row_rank in enumerate(rows.get("rank", [])):
        step, value = rows["step"][index], rows.get(key, [None] * (index + 1))[index]
        if row_rank == rank and _numeric(step) and _numeric(value):
            steps.append(float(step))
            values.append(float(value))
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [steps[i] for i in order], [values[i] for i in order]


def _rate(rows: dict[str, list[Any]], key: str | None) -> tuple[list[float], list[float]]:
    """Per-interval rate of a cumulative counter (or of steps) between rank 0's successive reports,
    within one attempt (a restart's pause is not throughput)."""
    points = sorted(
        (rows["step"][i], rows["time"][i], rows[key][i] if key else rows["step"][i], rows.get("attempt", [0] * len(rows["rank"]))[i])
        for i, rank in enumerate(rows["rank"])
        if rank == 0 and _numeric(rows["step"][i]) and (key is None or _numeric(rows[key][i])))
    steps, rates = [], []
    for (_, t0, c0, a0), (s1, t1, c1, a1) in itertools.pairwise(points):
        if a0 == a1 and t1 > t0:
            steps.append(float(s1))
            rates.append((c1 - c0) / (t1 - t0))
    return steps, rates


def _markers(rows: dict[str, list[Any]]) -> list[Marker]:
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
    ordered = sorted(first_step)
    for previous, attempt in itertools.pairwise(ordered):
        before, after = len(ranks[previous]), len(ranks[attempt])
        if before != after:
            markers.append(Marker(first_step[attempt], "resize", f"resize {before}->{after}"))
        else:
            markers.append(Marker(first_step[attempt], "restart", f"restart {attempt}"))
    return markers


def plot_run(run: str, output: str, storage: str | None = None) -> RunPicture:
    """Draw the run's metrics to `output` (PNG, SVG or PDF by extension)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RayZeroValueError("rayzero plot needs matplotlib: pip install 'rayzero[plot]'") from None
    uri = metrics_uri(run, storage)
    rows = read_rows(uri)
    if "step" not in rows or "rank" not in rows:
        raise RayZeroValueError(f"{uri} has no `step` column: the loop must report {{'step': ...}} to be plotted")
    picture = RunPicture(path=output, markers=_markers(rows))
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
    for key in ("lr", "learning_rate"):
        if key in rows:
            panels["learning rate"][key] = _series(rows, 0, key)
    if "peak_memory_bytes" in rows:
        for rank in ranks:
            steps, values = _series(rows, rank, "peak_memory_bytes")
            panels["peak memory (GiB)"][f"rank {rank}"] = (steps, [v / 2**30 for v in values])
    picture.series = panels

    figure, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for axis, (title, lines) in zip(axes, panels.items()):
        axis.set_title(title, loc="left", fontsize=10)
        drawn = False
        for label, (steps, values) in lines.items():
            if steps:
                axis.plot(steps, values, label=label, linewidth=1.2)
                drawn = True
        if not drawn:
            axis.text(0.5, 0.5, "not reported", transform=axis.transAxes, ha="center", va="center", color="grey")
        elif len(lines) > 1:
            axis.legend(fontsize=8, loc="best")
        for marker in picture.markers:
            axis.axvline(marker.step, color="red" if marker.kind == "restart" else "purple",
                         linestyle="--" if marker.kind == "restart" else "-", linewidth=0.9)
        axis.grid(alpha=0.3)
    for marker in picture.markers:
        axes[0].annotate(marker.label, (marker.step, 1.0), xycoords=("data", "axes fraction"),
                         fontsize=8, color="red" if marker.kind == "restart" else "purple",
                         xytext=(3, -10), textcoords="offset points")
    axes[-1].set_xlabel("step")
    figure.suptitle(f"rayzero run {run.rstrip('/').rsplit('/', 1)[-1]}")
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return picture


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
