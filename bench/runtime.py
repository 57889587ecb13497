"""The runtime's cost: time from `rayzero.fit` to the first step, and the demo's throughput under
rayzero (Ray actors) vs the same loop under torchrun on this machine. Prints JSON.

    python bench/runtime.py [--steps 60] [--workers 2] [--repeats 2] [--json out.json]

Both sides run `rayzero.demo.train.train_loop` with the same DeepSpeed config (ZeRO stage 3 by
default), the same seeds and no checkpoint. Throughput is measured identically on both sides: tokens
between rank 0's first and last report over the time between them, so start-up is excluded and
`ratio` compares steady-state training only. Start-up is reported separately.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayzero.ports import server_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` as a package
from bench import report


def _rate(reports: list[dict]) -> dict[str, float]:
    first, last = reports[0], reports[-1]
    elapsed = last["time"] - first["time"]
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / elapsed,
        "samples_per_s": (last["samples"] - first["samples"]) / elapsed,
        "steps_measured": last["step"] - first["step"],
    }


def torchrun_worker(steps: int, out: str, started_at: float) -> None:
    """Runs inside torchrun: the demo loop, then rank 0 writes its reports."""
    import rayzero
    from rayzero.demo.train import train_loop
    from rayzero.workers.session import local_reports

    train_loop({"steps": steps, "save_checkpoint": False})
    if rayzero.get_context().rank == 0:
        reports = [dict(r.metrics, time=r.time) for r in local_reports()]
        Path(out).write_text(json.dumps({"reports": reports, "started_at": started_at}))


def run_torchrun(steps: int, workers: int) -> dict:
    port = server_port()  # MASTER_PORT: [Note: ports below the ephemeral range]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/reports.json"
        started = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1")  # what Ray gives a 1-CPU actor
        launched = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
             f"--master-port={port}", "--master-addr=127.0.0.1", __file__, "--torchrun-worker",
             "--steps", str(steps), "--out", out, "--started-at", repr(started)],
            check=False, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        if launched.returncode != 0:
            raise RuntimeError(f"torchrun failed ({launched.returncode}):\n{launched.stdout[-4000:]}")
        total = time.time() - started
        data = json.loads(Path(out).read_text())
    reports = data["reports"]
    return dict(_rate(reports), launch_to_first_step_s=reports[0]["time"] - started, total_s=total,
                initial_loss=reports[0]["loss"], final_loss=reports[-1]["loss"])


def _fit(steps: int, workers: int, storage: str):
    import rayzero
    from rayzero.demo.train import DEFAULT_DS_CONFIG, train_loop

    return rayzero.fit(
        train_loop, config=DEFAULT_DS_CONFIG,
        scaling=rayzero.ScalingConfig(num_workers=workers),
        run=rayzero.RunConfig(storage=storage, progress_interval_s=3600),
        train_loop_config={"steps": steps, "save_checkpoint": False},
    )


def run_rayzero_cold(workers: int, storage: str) -> dict:
    """`rayzero.fit` with no Ray running: it starts a local Ray, then the workers (3 steps)."""
    result = _fit(3, workers, storage)
    return {k: round(v, 3) for k, v in result.timings.items() if k.endswith("_s") and "total" not in k}


def run_rayzero(steps: int, workers: int, storage: str) -> dict:
    """`rayzero.fit` with Ray already running (the usual case on a cluster)."""
    import pyarrow.parquet as pq

    started = time.monotonic()
    result = _fit(steps, workers, storage)
    rows = pq.read_table(result.metrics_path.removeprefix("file://")).to_pylist()
    reports = [r for r in rows if r["rank"] == 0 and r.get("tokens") is not None]
    phases = {k: round(v, 3) for k, v in result.timings.items() if k.endswith("_s") and "total" not in k}
    return dict(_rate(reports), fit_to_first_step_s=result.timings["fit_to_first_report_s"],
                startup_phases=phases, total_s=time.monotonic() - started,
                initial_loss=reports[0]["loss"], final_loss=reports[-1]["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (best is used)")
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--started-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args.steps, args.out, args.started_at)
        return
    import ray

    # Alternate the two sides so that load from other processes on this machine hits both alike;
    # compare the best run of each.
    torchrun_runs, rayzero_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cold = run_rayzero_cold(args.workers, Path(tmp).as_uri())
        for _ in range(args.repeats):
            torchrun_runs.append(run_torchrun(args.steps, args.workers))
            rayzero_runs.append(run_rayzero(args.steps, args.workers, Path(tmp).as_uri()))
    ray.shutdown()
    best_torchrun = max(torchrun_runs, key=lambda r: r["tokens_per_s"])
    best_rayzero = max(rayzero_runs, key=lambda r: r["tokens_per_s"])
    result = {
        "benchmark": "runtime",
        "steps": args.steps,
        "workers": args.workers,
        "repeats": args.repeats,
        "config": "demo DEFAULT_DS_CONFIG (ZeRO stage 3, AdamW, micro batch 16, block 64)",
        "throughput_ratio_rayzero_over_torchrun": best_rayzero["tokens_per_s"] / best_torchrun["tokens_per_s"],
        "rayzero_tokens_per_s": best_rayzero["tokens_per_s"],
        "torchrun_tokens_per_s": best_torchrun["tokens_per_s"],
        "fit_to_first_step_cold_s": cold["fit_to_first_report_s"],
        "fit_to_first_step_warm_s": min(r["fit_to_first_step_s"] for r in rayzero_runs),
        "torchrun_launch_to_first_step_s": min(r["launch_to_first_step_s"] for r in torchrun_runs),
        "same_losses": all(r["final_loss"] == torchrun_runs[0]["final_loss"] for r in rayzero_runs + torchrun_runs),
        "startup_phases_cold": cold,
        "rayzero_runs": rayzero_runs,
        "torchrun_runs": torchrun_runs,
    }
    report.emit(result, args.json)


if __name__ == "__main__":
    main()
