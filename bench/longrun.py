"""Long runs do not slow down (issue 25): a real `rayzero.fit` run reporting every step, and the
driver's metrics path fed 10^6 / 10^7 report rows from 64 / 1,024 ranks. Prints JSON.

    python bench/longrun.py real [--steps 200000] [--workers 2] [--json out.json]
    python bench/longrun.py simulate [--rows 1000000,10000000] [--ranks 64,1024] [--json out.json]
    python bench/longrun.py plot bench/results/longrun-real.json bench/results/longrun-sim.json -o out.png

`real`: 2 workers train a small MLP at ZeRO stage 1 and `rayzero.report` 8 keys every step, as the
README's loop does (the run that stalled near step 47,000). A sampler thread in the driver records the
resident memory of the driver, the controller actor and the workers every few seconds; afterwards the
samples are placed on the step axis with the run's own metrics (the report times). Reported: steps/s
over the first and the last 5 % of steps, memory against steps with the least-squares slope (MiB per
100,000 steps) per process, and the metrics parts written.

`simulate`: the driver's per-report path (Progress.observe + MetricsLog.add, what `_stream` does per
report) fed as fast as Python goes, in polls of one row per rank, with the writer thread flushing
parts. Reported per (rows, ranks): reports/s over the first and the last 10 %, each flush's write time
against the rows written so far (with its slope), driver memory against rows, rows dropped. "before"
rows time the previous code's flush (the whole table rebuilt with the quadratic rows_to_table, then
written) at 10k-80k rows, in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _rss(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as source:
            return int(source.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    denominator = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / denominator if denominator else None


# ---- the real run ---------------------------------------------------------------------------------

def long_loop(config: dict[str, Any]) -> None:
    import torch

    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    engine, _, _, _ = rayzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}})
    rank = rayzero.get_context().rank
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(64, 32, generator=generator), torch.randn(64, 1, generator=generator)
    started = time.time()
    for step in range(config["steps"]):
        index = (step * 8) % 64
        loss = torch.nn.functional.mse_loss(engine(inputs[index:index + 8]), targets[index:index + 8])
        engine.backward(loss)
        engine.step()
        metrics = {"step": step, "loss": loss.item(), "lr": 1e-3, "samples": 16 * (step + 1),
                   "tokens": 16 * 32 * (step + 1), "epoch": step // 1000, "elapsed_s": time.time() - started,
                   "phase": "train"}
        if step % 1000 == 0:  # the worker's own resident memory (other runs' workers share the machine)
            metrics["rss_mib"] = _rss() / 2**20
        rayzero.report(metrics)


def run_real(steps: int, workers: int, storage: str | None, sample_s: float) -> dict[str, Any]:
    import ray

    import rayzero
    from rayzero.driver.metrics_store import read_metrics

    storage = storage or tempfile.mkdtemp(prefix="rayzero-longrun-")
    ray.init(address="local", num_cpus=workers + 1, include_dashboard=False, logging_level="WARNING")
    samples: list[dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        controller_pid = None
        while not done.wait(sample_s):
            if controller_pid is None:  # this run's controller, not another session's on the machine
                try:
                    actor = ray.get_actor("rayzero-controller:longrun")
                    controller_pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=10)
                except Exception:  # noqa: BLE001 - not started yet: the next sample asks again
                    controller_pid = None
            samples.append({"time": time.time(), "driver": _rss(),
                            "controller": _rss(controller_pid) if controller_pid else 0})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.time()
    result = rayzero.fit(long_loop, scaling=rayzero.ScalingConfig(num_workers=workers),
                         run=rayzero.RunConfig(storage=Path(storage).resolve().as_uri(), name="longrun",
                                               progress_interval_s=60),
                         train_loop_config={"steps": steps})
    done.set()
    wall = time.time() - started
    table = read_metrics(result.path, rank=0, columns=["step", "time"])
    report_steps, report_times = table.column("step").to_pylist(), table.column("time").to_pylist()
    worker_rss = {}  # step -> [each rank's own resident MiB]
    for row in read_metrics(result.path, columns=["step", "rss_mib"]).to_pylist():
        if row.get("rss_mib") is not None:
            worker_rss.setdefault(row["step"], []).append(row["rss_mib"])
    ray.shutdown()

    def step_at(moment: float) -> int:
        import bisect

        return report_steps[max(0, bisect.bisect_right(report_times, moment) - 1)]

    def rate(first: int, last: int) -> float:
        return (report_steps[last] - report_steps[first]) / (report_times[last] - report_times[first])

    window = max(2, len(report_steps) // 20)
    points = [dict(sample_, step=step_at(sample_["time"])) for sample_ in samples
              if report_times and sample_["time"] >= report_times[0]]
    memory = {}
    worker_steps = sorted(worker_rss)
    for process in ("driver", "controller", "workers"):
        if process == "workers":
            xs, ys = [float(step) for step in worker_steps], [max(worker_rss[step]) * 2**20 for step in worker_steps]
        else:
            xs, ys = [float(p["step"]) for p in points], [float(p[process]) for p in points]
        slope = _slope(xs, ys)
        memory[process] = {"first_mib": ys[0] / 2**20 if ys else None, "last_mib": ys[-1] / 2**20 if ys else None,
                           "slope_mib_per_100k_steps": slope * 1e5 / 2**20 if slope is not None else None}
    parts = [name for name in os.listdir(Path(storage) / "longrun" / "metrics.parquet") if name.startswith("part-")]
    return {
        "kind": "real", "steps": steps, "workers": workers, "wall_s": wall, "reports": len(report_steps) * workers,
        "steps_per_s_first_5pct": rate(0, window - 1), "steps_per_s_last_5pct": rate(-window, -1),
        "memory": memory, "metrics_parts": len(parts),
        "samples": [{"step": p["step"], "driver_mib": p["driver"] / 2**20, "controller_mib": p["controller"] / 2**20}
                    for p in points],
        "worker_samples": [{"step": step, "worker_mib": worker_rss[step]} for step in worker_steps],
        "rate_series": [{"step": report_steps[i], "steps_per_s": rate(i - window, i)}
                        for i in range(window, len(report_steps), window)],
    }


# ---- the driver-side simulation ---------------------------------------------------------------------

def _legacy_rows_to_table(rows: list[dict[str, Any]]) -> Any:
    """The code that stalled (rayzero before issue 25), for the 'before' figures."""
    import pyarrow as pa

    columns: dict[str, list[Any]] = {}
    for index, row in enumerate(rows):
        for key in row:
            columns.setdefault(key, [None] * index)
        for key, values in columns.items():
            values.append(row.get(key))
    return pa.table({key: pa.array(values) for key, values in columns.items()})


def _row(rank: int, step: int) -> dict[str, Any]:
    return {"rank": rank, "seq": step, "time": 1e9 + step, "checkpoint": None, "peak_memory_bytes": 1 << 30,
            "placement": None, "step": step, "loss": 0.5, "lr": 1e-3, "samples": step * 8, "tokens": step * 8192,
            "epoch": step // 1000, "elapsed_s": 1.0 * step, "phase": "train", "attempt": 0}


def legacy_flush_times(sizes: list[int]) -> list[dict[str, float]]:
    import pyarrow.parquet as pq

    out = []
    with tempfile.TemporaryDirectory() as directory:
        for size in sizes:
            rows = [_row(index % 2, index // 2) for index in range(size)]
            started = time.perf_counter()
            pq.write_table(_legacy_rows_to_table(rows), f"{directory}/metrics.parquet")
            out.append({"rows": size, "flush_s": time.perf_counter() - started})
    return out


def simulate(rows: int, ranks: int) -> dict[str, Any]:
    from rayzero.driver.metrics_log import MetricsLog
    from rayzero.driver.progress import Progress
    from rayzero.workers.session import Report

    with tempfile.TemporaryDirectory() as directory:
        log = MetricsLog(Path(directory).as_uri(), emit=lambda line: None)
        progress = Progress(8 * ranks, 3600.0, False, emit=lambda line: None)
        steps = rows // ranks
        marks: list[tuple[int, float, int, int]] = []  # (rows added, time, rss, rows written)
        started = time.perf_counter()
        every = max(1, steps // 50)
        for step in range(steps):
            for rank in range(ranks):
                item = Report(rank, step, 1e9 + step, {"step": step, "loss": 0.5, "lr": 1e-3, "samples": 8 * ranks * step,
                                                        "tokens": 8192 * ranks * step, "epoch": step // 1000,
                                                        "elapsed_s": 1.0 * step, "phase": "train"},
                              None, 1 << 30)
                progress.observe(item)
                log.add(item)
            if step % every == 0 or step == steps - 1:
                marks.append(((step + 1) * ranks, time.perf_counter() - started, _rss(), log.rows_written))
        fed_s = time.perf_counter() - started
        log.close(timeout_s=600)
        flushes = list(log.flush_log)
    tenth = max(1, len(marks) // 10)

    def rate(first: int, last: int) -> float:
        return (marks[last][0] - marks[first][0]) / (marks[last][1] - marks[first][1])

    flush_rows = [f["rows_before"] for f in flushes]
    flush_times = [f["seconds"] for f in flushes]
    slope = _slope([float(r) for r in flush_rows], flush_times)
    rss_slope = _slope([float(m[0]) for m in marks], [float(m[2]) for m in marks])
    return {
        "kind": "simulate", "rows": rows, "ranks": ranks, "fed_s": fed_s,
        "reports_per_s_first_10pct": rate(0, tenth), "reports_per_s_last_10pct": rate(-tenth - 1, -1),
        "flushes": len(flushes), "flush_s_median": statistics.median(flush_times) if flush_times else None,
        "flush_s_max": max(flush_times) if flush_times else None,
        "flush_s_first": flush_times[0] if flush_times else None, "flush_s_last": flush_times[-1] if flush_times else None,
        "flush_s_slope_per_million_rows": slope * 1e6 if slope is not None else None,
        "driver_mib_first": marks[0][2] / 2**20, "driver_mib_last": marks[-1][2] / 2**20,
        "driver_mib_peak": max(m[2] for m in marks) / 2**20,
        "driver_mib_slope_per_million_rows": rss_slope * 1e6 / 2**20 if rss_slope is not None else None,
        "rows_written": log.rows_written, "rows_dropped": log.dropped,
        "flush_series": [{"rows_before": r, "seconds": s} for r, s in zip(flush_rows, flush_times)][:: max(1, len(flushes) // 200)],
        "memory_series": [{"rows": m[0], "driver_mib": m[2] / 2**20} for m in marks],
    }


# ---- the picture -----------------------------------------------------------------------------------

def plot(inputs: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(path).read_text()) for path in inputs]
    figure, axes = plt.subplots(3, 1, figsize=(9, 11))
    for result in results:
        for item in result.get("runs", [result]):
            if item.get("kind") == "real":
                axes[0].plot([p["step"] for p in item["rate_series"]], [p["steps_per_s"] for p in item["rate_series"]],
                             label=f"real run, {item['workers']} workers")
                for key in ("driver_mib", "controller_mib"):
                    axes[1].plot([p["step"] for p in item["samples"]], [p[key] for p in item["samples"]],
                                 label=key.replace("_mib", ""))
                axes[1].plot([p["step"] for p in item["worker_samples"]], [max(p["worker_mib"]) for p in item["worker_samples"]],
                             label="largest worker")
            elif item.get("kind") == "simulate":
                axes[2].plot([f["rows_before"] for f in item["flush_series"]], [f["seconds"] for f in item["flush_series"]],
                             ".", markersize=3, label=f"after: {item['rows']:.0e} rows, {item['ranks']} ranks")
        for before in result.get("before", []):
            axes[2].plot([b["rows"] for b in before], [b["flush_s"] for b in before], "o-", color="red",
                         label="before (whole table rebuilt each flush)")
    axes[0].set(title="steps/s against step", xlabel="step", ylabel="steps/s")
    axes[1].set(title="resident memory against step", xlabel="step", ylabel="MiB")
    axes[2].set(title="one flush's time against rows already written", xlabel="rows written before the flush",
                ylabel="seconds", xscale="log", yscale="log")
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    real = sub.add_parser("real")
    real.add_argument("--steps", type=int, default=200_000)
    real.add_argument("--workers", type=int, default=2)
    real.add_argument("--storage", default=None)
    real.add_argument("--sample-s", type=float, default=5.0)
    real.add_argument("--json", default=None)
    sim = sub.add_parser("simulate")
    sim.add_argument("--rows", default="1000000,10000000")
    sim.add_argument("--ranks", default="64,1024")
    sim.add_argument("--before", default="10000,20000,40000,80000")
    sim.add_argument("--json", default=None)
    picture = sub.add_parser("plot")
    picture.add_argument("inputs", nargs="+")
    picture.add_argument("-o", "--output", default="longrun.png")
    args = parser.parse_args(argv)
    if args.command == "plot":
        plot(args.inputs, args.output)
        return 0
    if args.command == "real":
        result: dict[str, Any] = run_real(args.steps, args.workers, args.storage, args.sample_s)
    else:
        result = {"before": [legacy_flush_times([int(n) for n in args.before.split(",") if n])], "runs": [
            simulate(int(rows), int(ranks)) for rows in args.rows.split(",") for ranks in args.ranks.split(",")]}
    text = json.dumps(result, indent=1)
    print(text if args.command != "real" else json.dumps({k: v for k, v in result.items()
                                                           if k not in ("samples", "worker_samples", "rate_series")},
                                                          indent=1))
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
