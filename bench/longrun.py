"""Long runs do not slow down or grow (issues 25, 35): a real `rayzero.fit` run reporting every step,
the driver's metrics path fed 10^6 / 10^7 report rows from 64 / 1,024 ranks, and a relay actor
passing a long run's reports. Prints JSON.

    python bench/longrun.py real [--steps 200000] [--workers 2] [--loop train|report] [--json out.json]
    python bench/longrun.py simulate [--rows 1000000,10000000] [--ranks 64,1024] [--json out.json]
    python bench/longrun.py relay [--steps 1000000] [--ranks 2] [--rate 2000] [--json out.json]
    python bench/longrun.py plot bench/results/longrun-real.json bench/results/longrun-sim.json -o out.png

`real`: 2 workers `rayzero.report` 8 keys every step, as the README's loop does (the run that stalled
near step 47,000): `--loop train` trains a small MLP at ZeRO stage 1 each step; `--loop report` only
reports, `--rate` steps a second (the driver's and the controller's per-report work over 10^6 steps
in minutes, without the training step's cost on a shared machine). A sampler thread in the driver records, every few
seconds, the memory of the driver, the controller actor and any relay actor (bench/longrun_memory.py:
RSS, malloc's chunks in use and free over all arenas, Python's live blocks, pyarrow's pool), the
controller's and the relays' through `__ray_call__`; afterwards the samples are placed on the step
axis with the run's own metrics (the report times). Reported: steps/s over the first and the last
5 % of steps, and per process and figure the least-squares slope after the warm-up (the first 10 % of
the steps, at least 20,000: the 20,000-row buffer and the allocators' first growth) per 100,000 steps
and per hour, and over the whole run; the metrics parts written.

`simulate`: the driver's per-report path (Progress.observe + MetricsLog.add, what `_stream` does per
report) fed as fast as Python goes, in polls of one row per rank, with the writer thread flushing
parts. Reported per (rows, ranks): reports/s over the first and the last 10 %, each flush's write time
against the rows written so far (with its slope), driver memory against rows (measured after each
flush, with its figures as above), rows dropped. "before" rows time the previous code's flush (the
whole table rebuilt with the quadratic rows_to_table, then written) at 10k-80k rows, in the same run.

`relay`: a real `NodeRelay` actor gathering `--ranks` simulated ranks (in one async actor, reporting
the real loop's 8 keys `--rate` steps a second) for the controller, a collect a second as the
controller's heartbeat rounds make them; the relay's memory sampled as above, against its ranks' steps.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import longrun_memory  # beside this script, which is run by path


def _rss(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as source:
            return int(source.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _slope(xs: list[float], ys: list[float]) -> float | None:
    return longrun_memory.slope(xs, ys)


def _start_ray(cpus: int) -> None:
    """A Ray of our own; tried again a few times: on a loaded shared machine its raylet can miss the
    30 s it is given to register."""
    import ray

    for attempt in range(5):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="WARNING")
            return
        except Exception as error:  # "The current node timed out during startup"
            if attempt == 4:
                raise
            print(f"[longrun] ray.init failed ({error}); again in 10 s", file=sys.stderr, flush=True)
            ray.shutdown()
            time.sleep(10)


def _warm_up(steps: int) -> int:
    """Steps left out of the steady slopes: the first 10 %, at least 20,000 (the driver's 20,000-row
    buffer and the allocators' first growth)."""
    return max(20_000, steps // 10)


# ---- the real run ---------------------------------------------------------------------------------

def _metrics(step: int, loss: float, started: float) -> dict[str, Any]:
    metrics = {"step": step, "loss": loss, "lr": 1e-3, "samples": 16 * (step + 1), "tokens": 16 * 32 * (step + 1),
               "epoch": step // 1000, "elapsed_s": time.time() - started, "phase": "train"}
    if step % 1000 == 0:  # the worker's own resident memory (other runs' workers share the machine)
        metrics["rss_mib"] = _rss() / 2**20
    return metrics


def long_loop(config: dict[str, Any]) -> None:
    import rayzero

    started = time.time()
    if config.get("loop") == "report":  # the report path alone: no training step between reports
        rate = config.get("rate") or 0.0  # steps a second (0: as fast as it goes)
        for step in range(config["steps"]):
            rayzero.report(_metrics(step, 1.0 / (step + 1), started))
            if rate and step % 100 == 99:  # paced, so the driver keeps up and drops nothing
                time.sleep(max(0.0, started + (step + 1) / rate - time.time()))
        return
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    engine, _, _, _ = rayzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}})
    rank = rayzero.get_context().rank
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(64, 32, generator=generator), torch.randn(64, 1, generator=generator)
    for step in range(config["steps"]):
        index = (step * 8) % 64
        loss = torch.nn.functional.mse_loss(engine(inputs[index:index + 8]), targets[index:index + 8])
        engine.backward(loss)
        engine.step()
        rayzero.report(_metrics(step, loss.item(), started))


def run_real(steps: int, workers: int, storage: str | None, sample_s: float, loop: str = "train",
             rate: float = 0.0) -> dict[str, Any]:
    import ray
    from ray import cloudpickle

    import rayzero
    from rayzero.driver.metrics_store import read_metrics

    cloudpickle.register_pickle_by_value(longrun_memory)  # runs in the controller, which cannot import it
    storage = storage or tempfile.mkdtemp(prefix="rayzero-longrun-")
    _start_ray(workers + 1)
    samples: list[dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        actor = None
        while not done.wait(sample_s):
            record: dict[str, Any] = {"time": time.time(), "driver": longrun_memory.probe()}
            try:  # this run's controller (not another session's on the machine) and its relays
                actor = actor or ray.get_actor("rayzero-controller:longrun")
                record.update(ray.get(actor.__ray_call__.remote(longrun_memory.controller_side), timeout=30))
            except Exception as error:  # noqa: BLE001 - not started yet, or ending: the next sample asks again
                record["controller_error"] = f"{type(error).__name__}: {error}"[:200]
            # kept as JSON text (a malloc'd string), not dicts: objects kept for the run, made among the
            # driver's reports, pin arenas of Python's allocator and would be measured as the driver's
            # growth ([Note: the driver's long-lived objects])
            samples.append(json.dumps(record))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.time()
    result = rayzero.fit(long_loop, scaling=rayzero.ScalingConfig(num_workers=workers),
                         run=rayzero.RunConfig(storage=Path(storage).resolve().as_uri(), name="longrun",
                                               progress_interval_s=60),
                         train_loop_config={"steps": steps, "loop": loop, "rate": rate})
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

    def steps_per_s(first: int, last: int) -> float:
        return (report_steps[last] - report_steps[first]) / (report_times[last] - report_times[first])

    window = max(2, len(report_steps) // 20)
    placed = [dict(sample_, step=step_at(sample_["time"])) for sample_ in map(json.loads, samples)
              if report_times and sample_["time"] >= report_times[0]]
    warm_up = _warm_up(steps)
    memory: dict[str, Any] = {}
    for process in ("driver", "controller", "relays"):
        points = []
        for point in placed:
            probes = point.get(process)
            if process == "relays":  # the largest relay actor of the sample (none: a group on one node)
                probes = max([probed for probed in probes or [] if "rss" in probed], key=lambda probed: probed["rss"],
                             default=None)
            if probes:
                points.append((float(point["step"]), point["time"] - started, probes))
        memory[process] = {"steady": longrun_memory.growth(points, warm_up),
                           "whole_run": longrun_memory.growth(points, 0.0)} if points else None
    worker_steps = sorted(worker_rss)
    worker_points = [(float(step), 0.0, {"rss": max(worker_rss[step]) * 2**20}) for step in worker_steps]
    memory["workers"] = {"steady": longrun_memory.growth(worker_points, warm_up),
                         "whole_run": longrun_memory.growth(worker_points, 0.0)}
    parts = [name for name in os.listdir(Path(storage) / "longrun" / "metrics.parquet") if name.startswith("part-")]
    return {
        "kind": "real", "loop": loop, **({"rate": rate} if loop == "report" else {}), "steps": steps,
        "workers": workers, "wall_s": wall, "reports": len(report_steps) * workers,
        "rank0_steps_missing": steps - len(set(report_steps)), "warm_up_steps": warm_up,
        "steps_per_s_first_5pct": steps_per_s(0, window - 1), "steps_per_s_last_5pct": steps_per_s(-window, -1),
        "load_average_end": os.getloadavg()[0],
        "memory": memory, "metrics_parts": len(parts),
        "samples": [{"step": p["step"], "seconds": p["time"] - started,
                     **{process: p[process] for process in ("driver", "controller", "relays") if process in p}}
                    for p in placed],
        "worker_samples": [{"step": step, "worker_mib": worker_rss[step]} for step in worker_steps],
        "rate_series": [{"step": report_steps[i], "steps_per_s": steps_per_s(i - window, i)}
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
        # per mark: rows added, feeding seconds, the driver's memory (before and after writing what
        # is queued: after, the bounded buffer is empty, so what is left is what the driver keeps)
        marks: list[str] = []
        fed_s = 0.0
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
                fed_s += time.perf_counter() - started
                before = longrun_memory.probe()
                log.flush(timeout_s=600)
                # as JSON text, as run_real's samples ([Note: the driver's long-lived objects])
                marks.append(json.dumps(((step + 1) * ranks, fed_s, before, longrun_memory.probe())))
                started = time.perf_counter()
        log.close(timeout_s=600)
        flushes = list(log.flush_log)
    marks = [json.loads(mark) for mark in marks]
    tenth = max(1, len(marks) // 10)

    def rate(first: int, last: int) -> float:
        return (marks[last][0] - marks[first][0]) / (marks[last][1] - marks[first][1])

    flush_rows = [f["rows_before"] for f in flushes]
    flush_times = [f["seconds"] for f in flushes]
    slope = _slope([float(r) for r in flush_rows], flush_times)
    # x = steps of the simulated run (rows / ranks): the same axis as the real run's slopes
    kept = [(mark[0] / ranks, 0.0, mark[3]) for mark in marks]
    warm_up = max(20_000 / ranks, steps / 10)  # the first 10 % of the rows, at least the 20,000-row buffer
    return {
        "kind": "simulate", "rows": rows, "ranks": ranks, "fed_s": fed_s,
        "reports_per_s_first_10pct": rate(0, tenth), "reports_per_s_last_10pct": rate(-tenth - 1, -1),
        "flushes": len(flushes), "flush_s_median": statistics.median(flush_times) if flush_times else None,
        "flush_s_max": max(flush_times) if flush_times else None,
        "flush_s_first": flush_times[0] if flush_times else None, "flush_s_last": flush_times[-1] if flush_times else None,
        "flush_s_slope_per_million_rows": slope * 1e6 if slope is not None else None,
        "driver_mib_first": marks[0][3]["rss"] / 2**20, "driver_mib_last": marks[-1][3]["rss"] / 2**20,
        "driver_mib_peak": max(mark[2]["rss"] for mark in marks) / 2**20,
        "driver_memory": {"steady": longrun_memory.growth(kept, warm_up), "whole_run": longrun_memory.growth(kept, 0.0)},
        "rows_written": log.rows_written, "rows_dropped": log.dropped,
        "flush_series": [{"rows_before": r, "seconds": s} for r, s in zip(flush_rows, flush_times)][:: max(1, len(flushes) // 200)],
        "memory_series": [{"rows": m[0], "driver_mib": m[3]["rss"] / 2**20, "driver_mib_before_flush": m[2]["rss"] / 2**20,
                           "heap_in_use_mib": m[3].get("heap_in_use", 0) / 2**20, "python_blocks": m[3]["python_blocks"]}
                          for m in marks],
    }


# ---- a relay actor over a long run -------------------------------------------------------------------

class ReportingRanks:
    """`ranks` simulated ranks in one async actor, each reporting the real loop's 8 keys `rate` steps a
    second; `collect(rank)` answers as `TrainWorker.collect` does (a heartbeat, the queued reports)."""

    def __init__(self, ranks: int, rate: float) -> None:
        self.ranks, self.rate = ranks, rate
        self.step = 0
        self.queues: dict[int, list[Any]] = {rank: [] for rank in range(ranks)}
        self._ticker: Any = None

    async def begin(self) -> int:
        import asyncio

        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return os.getpid()

    async def _tick(self) -> None:
        import asyncio

        from rayzero.workers.session import Report

        started = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            # at most 50 steps a tick: behind on a loaded machine, the host still answers its collects
            due = min(self.step + 50, int((time.monotonic() - started) * self.rate))
            now = time.time()
            for step in range(self.step, due):
                for rank, queue in self.queues.items():
                    queue.append(Report(rank, step, now, {
                        "step": step, "loss": 1.0 / (step + 1), "lr": 1e-3, "samples": 16 * (step + 1),
                        "tokens": 512 * (step + 1), "epoch": step // 1000, "elapsed_s": now, "phase": "train"},
                        None, 1 << 30, None, 0, 1e-3))
            self.step = max(self.step, due)

    async def steps(self) -> int:
        return self.step

    async def collect(self, rank: int, grace_s: float = 0.0) -> tuple[Any, list[Any]]:
        from rayzero.workers.boundary import Heartbeat

        reports, self.queues[rank] = self.queues[rank], []
        return Heartbeat(rank=rank, node_id="node0", step=self.step, micro_step=self.step, progress_age_s=0.0,
                         stepped=True, saving=False, step_time_s=1.0 / self.rate, memory_bytes=1 << 30,
                         host_memory_bytes=1 << 30, handled=None, finished=False, in_step=False), reports


class _RankCall:
    def __init__(self, host: Any, rank: int) -> None:
        self._host, self._rank = host, rank

    def remote(self, *args: Any) -> Any:
        return self._host.collect.remote(self._rank, *args)


class RankHandle:
    """Looks like a TrainWorker actor handle to a NodeRelay: `collect.remote(grace)` asks the host."""

    def __init__(self, host: Any, rank: int) -> None:
        self.collect = _RankCall(host, rank)


def run_relay(steps: int, ranks: int, rate: float, sample_s: float) -> dict[str, Any]:
    import ray
    from ray import cloudpickle

    from rayzero.workers.relay import RELAY_WAIT_S, NodeRelay

    cloudpickle.register_pickle_by_value(longrun_memory)
    _start_ray(2)
    try:
        host = ray.remote(ReportingRanks).options(num_cpus=0).remote(ranks, rate)
        relay = ray.remote(NodeRelay).options(num_cpus=0).remote("node0", {rank: RankHandle(host, rank)
                                                                         for rank in range(ranks)})
        ray.get([host.begin.remote(), relay.ready.remote()], timeout=120)
        started = time.time()
        points: list[tuple[float, float, dict[str, Any]]] = []
        reports = rounds = 0
        next_sample = started
        step = 0
        while step < steps:
            # a heartbeat round, as the controller makes one a second through RelayRounds
            node_round = ray.get(relay.collect.remote(RELAY_WAIT_S, False, 0.0), timeout=60)
            reports += len(node_round.reports)
            rounds += 1
            step = ray.get(host.steps.remote(), timeout=60)
            if time.time() >= next_sample:
                points.append((float(step), time.time() - started,
                               ray.get(relay.__ray_call__.remote(longrun_memory.relay_side), timeout=60)))
                next_sample += sample_s
            time.sleep(max(0.0, started + rounds - time.time()))
        wall = time.time() - started
    finally:
        ray.shutdown()
    warm_up = _warm_up(steps)
    return {"kind": "relay", "steps": step, "ranks": ranks, "rate": rate, "wall_s": wall, "rounds": rounds,
            "reports": reports, "warm_up_steps": warm_up, "load_average_end": os.getloadavg()[0],
            "memory": {"relay": {"steady": longrun_memory.growth(points, warm_up),
                                 "whole_run": longrun_memory.growth(points, 0.0)}},
            "samples": [{"step": point[0], "seconds": point[1], "relay": point[2]} for point in points]}


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
                name = f"{item['loop']} loop" if "loop" in item else "real run"
                axes[0].plot([p["step"] for p in item["rate_series"]], [p["steps_per_s"] for p in item["rate_series"]],
                             label=f"{name}, {item['workers']} workers")
                for process in ("driver", "controller"):
                    shown = [(p["step"], p[process]["rss"] / 2**20) for p in item["samples"] if p.get(process)]
                    axes[1].plot([x for x, _ in shown], [y for _, y in shown], label=f"{process} ({name})")
                axes[1].plot([p["step"] for p in item["worker_samples"]], [max(p["worker_mib"]) for p in item["worker_samples"]],
                             label=f"largest worker ({name})")
            elif item.get("kind") == "relay":
                shown = [(p["step"], p["relay"]["rss"] / 2**20) for p in item["samples"]]
                axes[1].plot([x for x, _ in shown], [y for _, y in shown], label=f"relay actor ({item['ranks']} ranks)")
            elif item.get("kind") == "simulate":
                axes[2].plot([f["rows_before"] for f in item["flush_series"]], [f["seconds"] for f in item["flush_series"]],
                             ".", markersize=3, label=f"after: {item['rows']:.0e} rows, {item['ranks']} ranks")
        for before in result.get("before", []):
            axes[2].plot([b["rows"] for b in before], [b["flush_s"] for b in before], "o-", color="red",
                         label="before (whole table rebuilt each flush)")
    axes[0].set(title="steps/s against step", xlabel="step", ylabel="steps/s")
    axes[1].set(title="resident memory against step", xlabel="step", ylabel="MiB")
    axes[2].set(title="one flush's time against rows already written (simulated driver)",
                xlabel="rows written before the flush",
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
    real.add_argument("--loop", choices=("train", "report"), default="train")
    real.add_argument("--rate", type=float, default=1000.0, help="with --loop report: steps a second (0: unpaced)")
    real.add_argument("--json", default=None)
    relay = sub.add_parser("relay")
    relay.add_argument("--steps", type=int, default=1_000_000)
    relay.add_argument("--ranks", type=int, default=2)
    relay.add_argument("--rate", type=float, default=2000.0, help="steps per second of each simulated rank")
    relay.add_argument("--sample-s", type=float, default=5.0)
    relay.add_argument("--json", default=None)
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
        result: dict[str, Any] = run_real(args.steps, args.workers, args.storage, args.sample_s, args.loop, args.rate)
    elif args.command == "relay":
        result = run_relay(args.steps, args.ranks, args.rate, args.sample_s)
    else:
        result = {"before": [legacy_flush_times([int(n) for n in args.before.split(",") if n])], "runs": [
            simulate(int(rows), int(ranks)) for rows in args.rows.split(",") for ranks in args.ranks.split(",")]}
    text = json.dumps(result, indent=1)
    print(text if args.command == "simulate" else json.dumps(
        {k: v for k, v in result.items() if k not in ("samples", "worker_samples", "rate_series")}, indent=1))
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
