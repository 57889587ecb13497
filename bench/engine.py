"""rayzero's engine against torch DDP, torch FSDP2 and DeepSpeed ZeRO 0–3, in one run.

    python bench/engine.py --quick --json bench/engine-quick.json    # < 4 min on 2 cores
    python bench/engine.py --json bench/engine-full.json             # larger models, more steps, repeats

Each (system, world size) runs in its own spawned gloo process group on CPU, fp32, on the same models and
batches (bench/models.py); what runs inside a rank is bench/engine_systems.py. The JSON holds one row per
system, world size and model, and a list of comparisons against the targets of the engine issue; the
README (bench/README.md) explains every field. Rows of a system that fails carry `error` instead of
figures; the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
if str(REPOSITORY) not in sys.path:  # `python bench/engine.py` puts bench/, not the repository, on the path
    sys.path.insert(0, str(REPOSITORY))

from bench import report
from bench.engine_systems import deepspeed_config
from rayzero.ports import server_port

STAGES = (0, 1, 2, 3)
# Each DeepSpeed stage right before the same rayzero stage: compared systems run close together in
# time, so load from elsewhere on a shared machine drifts less between them.
SPEED_SYSTEMS = ["ddp", "ddp-default", "fsdp2"] + [f"{family}-stage{s}" for s in STAGES for family in ("deepspeed", "rayzero")]
MODELS = ("gpt", "mlp")


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The process groups to start, in order.

    Speed rows (world size 2): one process group per system, repeated in interleaved rounds without
    --quick. Memory rows at the other world sizes: with --quick, one process group per world size runs
    the four rayzero stages one after another (model-state bytes are per engine, and spawning eight
    more groups would not fit the time budget); without --quick, one group per system, DeepSpeed too.
    """
    systems = [s for s in SPEED_SYSTEMS if not args.systems or s in args.systems]
    models = [m for m in MODELS if not args.models or m in args.models]
    common = {
        "quick": args.quick,
        "optimizer_impl": args.optimizer_impl,
        "models": models,
        "collective_timeout_s": 30 if args.quick else 120,
    }
    jobs = []
    for round_index in range(args.repeats):
        for system in systems:
            jobs.append({**common, "systems": [system], "world_size": 2, "round": round_index,
                         "warmup": args.warmup, "steps": args.steps})
    memory_systems = [s for s in systems if s.startswith("rayzero")]
    if not args.quick:
        memory_systems += [s for s in systems if s.startswith("deepspeed")]
    for world_size in args.memory_world_sizes:
        if world_size == 2 or not memory_systems:
            continue  # the speed rows already measure world size 2
        groups = [memory_systems] if args.quick else [[system] for system in memory_systems]
        for group in groups:
            # Memory needs only a couple of steps: state is allocated by the first optimizer step.
            jobs.append({**common, "systems": group, "world_size": world_size, "round": 0,
                         "warmup": 1, "steps": 2})
    return jobs


# Ranks start from a fork server that has imported torch once (~1.5 s of CPU per process saved, times
# 2 ranks times ~14 groups). Each rank is still a fresh process with its own process group; only
# torch's modules are shared, not any system's (DeepSpeed and rayzero are imported inside the rank).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
                       "bench.models", "bench.engine_systems"]


def run_job(job: dict[str, Any], deadline_s: float, scratch: pathlib.Path) -> list[dict[str, Any]]:
    """Start `job`'s ranks, wait at most `deadline_s`, and return its rows (error rows if it failed)."""
    import torch.multiprocessing as mp

    from bench.engine_systems import worker

    name = f"{job.get('name') or '+'.join(job['systems'])}-ws{job['world_size']}-r{job['round']}"
    result_path = scratch / f"{name}.json"
    log_directory = scratch / name
    log_directory.mkdir()
    job = {**job, "log_directory": str(log_directory)}
    context = mp.start_processes(
        worker, args=(job, server_port(), str(result_path)), nprocs=job["world_size"], join=False,
        start_method="forkserver",
    )
    failure = None
    started = time.monotonic()
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() - started > deadline_s:
                failure = f"timed out after {deadline_s:.0f} s (process group hung or too slow)"
                break
    except Exception as error:  # noqa: BLE001 - a rank that died is reported in its rows
        failure = f"a rank exited abnormally: {type(error).__name__}: {str(error)[:500]}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    rows = json.loads(result_path.read_text()) if result_path.exists() else []
    finished = {(row["system"], row["model"]) for row in rows}
    for system in job["systems"]:
        for model in job["models"]:
            if (system, model) not in finished:
                rows.append({"system": system, "world_size": job["world_size"], "model": model,
                             "error": failure or "no result written", "log_tail": _log_tail(log_directory)})
    for row in rows:
        row["round"] = job["round"]
        row["wall_s"] = round(time.monotonic() - started, 2)
    return rows


def _log_tail(log_directory: pathlib.Path, characters: int = 1500) -> str:
    tails = []
    for log in sorted(log_directory.glob("rank*.log")):
        tails.append(f"[{log.stem}] " + log.read_text(errors="replace")[-characters:])
    return "\n".join(tails)


def merge_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, world size, model): the median over rounds of each round's median step."""
    grouped: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["system"], row["world_size"], row["model"]), []).append(row)
    merged = []
    for group in grouped.values():
        good = [row for row in group if "error" not in row]
        if not good:
            merged.append(group[0])
            continue
        row = dict(good[-1])
        row.pop("round", None)
        row["rounds"] = len(good)
        if len(good) < len(group):
            row["rounds_failed"] = [r["error"] for r in group if "error" in r]
        row["step_time_round_medians_s"] = [r["step_time_median_s"] for r in good]
        row["step_time_median_s"] = statistics.median(row["step_time_round_medians_s"])
        # spread of the round medians around their median: how far one round's figure can be trusted
        medians = row["step_time_round_medians_s"]
        row["step_time_round_spread"] = round((max(medians) - min(medians)) / row["step_time_median_s"], 4) \
            if row["step_time_median_s"] else None
        row["step_time_min_s"] = min(r["step_time_min_s"] for r in good)
        row["step_cpu_time_median_s"] = statistics.median(r["step_cpu_time_median_s"] for r in good)
        merged.append(row)
    return merged


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, few steps: < 4 min on 2 cores")
    parser.add_argument("--json", type=pathlib.Path, help="write {results, comparisons, meta} here")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated subset of {','.join(SPEED_SYSTEMS)}")
    parser.add_argument("--models", type=lambda s: s.split(","), default=None, help="subset of gpt,mlp")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per row")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before measuring")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds of the speed rows")
    parser.add_argument("--optimizer-impl", choices=["fused", "for-loop"], default="fused",
                        help="the torch Adam kernel every system runs (one implementation for all)")
    parser.add_argument("--memory-world-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4], help="world sizes of the memory rows (default 1,2,4)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new process groups after this long (default 220 quick)")
    args = parser.parse_args(argv)
    defaults = {"steps": 10, "warmup": 3, "repeats": 1, "budget_s": 220.0} if args.quick else \
        {"steps": 20, "warmup": 3, "repeats": 3, "budget_s": float("inf")}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.systems or ()) - set(SPEED_SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from {SPEED_SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    jobs = plan(args)
    import multiprocessing

    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)
    began = time.monotonic()
    load_at_start = os.getloadavg()  # timings are only as good as the machine was quiet: recorded
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rayzero-bench-") as scratch:
        for job in jobs:
            spent = time.monotonic() - began
            if spent > args.budget_s:
                rows += [{"system": system, "world_size": job["world_size"], "model": model,
                          "round": job["round"], "error": f"skipped: time budget of {args.budget_s:.0f} s spent"}
                         for system in job["systems"] for model in job["models"]]
                continue
            per_group = (60.0 + 30.0 * len(job["systems"])) if args.quick else 600.0 * len(job["systems"])
            deadline = min(per_group, max(args.budget_s - spent, 30.0))
            job_rows = run_job(job, deadline, pathlib.Path(scratch))
            rows += job_rows
            print(report.progress_line(job, job_rows, time.monotonic() - began), flush=True)
    results = report.annotate(merge_rounds(rows))
    comparisons = report.comparisons(results)
    document = {
        "results": results,
        "comparisons": comparisons,
        "meta": {
            "quick": args.quick,
            "total_wall_s": round(time.monotonic() - began, 1),
            "load_average_1_5_15_min_at_start": [round(x, 2) for x in load_at_start],
            "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()],
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "dtype": "float32", "backend": "gloo", "device": "cpu", "threads_per_rank": 1,
            "machine": report.machine_description(),
            "python": platform.python_version(),
            "versions": report.versions(),
            "formula_assumptions": report.FORMULA_ASSUMPTIONS,
            # What DeepSpeed and rayzero were given (stage and micro-batch vary per row).
            "deepspeed_config_template": deepspeed_config(stage=3, micro_batch=0),
        },
    }
    print(report.table(results, comparisons))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
        print(f"wrote {args.json}")
    # A failed rayzero row fails the run (its error is still in the JSON); other systems only report.
    failed = [row for row in results if row["system"].startswith("rayzero") and "error" in row
              and not str(row["error"]).startswith("skipped: time budget")]
    for row in failed:
        print(f"FAILED {row['system']} ({row['model']}, world size {row['world_size']}): {row['error']}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
