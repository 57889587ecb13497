"""rayzero on CUDA against torch DDP, torch FSDP2 and DeepSpeed ZeRO 0–3, side by side in one run.

    python bench/gpu.py --json bench/results/gpu.json        # ~12 min on one H100 / H200 (2 rounds)
    python bench/gpu.py --device cpu --rounds 1 --quick      # the same code path on a CPU (a dry run)

One NCCL process group over every GPU of the machine (world size = GPUs; one GPU is a group of
one), spawned afresh for each job; the ranks are bench/engine_systems.py's, so every system trains
the same model on the same batches with the same torch Adam kernel (fused, on the device), timed
the same way, with the clock stopped only once the device is idle. fp32 is strict (TF32 off).

Sections (`--sections`), each job repeated in `--rounds` interleaved rounds:
- `engine`: fp32, the GPT (~0.18 B parameters) and the MLP (~0.13 B) of bench/models.py's `GPU`
  sizes: DDP, FSDP2, DeepSpeed and rayzero stages 0–3; then bf16 (`"bf16": {"enabled": true}`), GPT
  only, DeepSpeed and rayzero stages 0–3 on the same config. Per row: step time, peak CUDA memory
  (`torch.cuda.max_memory_allocated` from the model's build to the end of its probe step), losses.
- `offload`: the GPT, fp32, ZeRO-Offload as DeepSpeed users write it: `offload_optimizer` cpu
  (pinned) at stages 1–3, with `offload_param` cpu too at stage 3, DeepSpeed and rayzero on the same
  config; rayzero's optimizer step overlapped with backward against the same step after backward
  (`RAYZERO_OFFLOAD_OVERLAP_STEP=0`) at stages 1–2; rayzero stage 3 with optimizer state on NVMe
  (the machine's disk; DeepSpeed's NVMe path needs libaio, absent there). Both use torch's Adam on the
  host (`torch_adam`, `zero_force_ds_cpu_optimizer: false`); DeepSpeedCPUAdam would need a JIT build.
- `transformers`: transformers' GPT2LMHeadModel at GPT-2 medium and XL, bf16, fused AdamW: rayzero
  against FSDP2 and DeepSpeed at stage 3, DeepSpeed at stage 2 and at stage 3 with CPU offload, each
  row in its own process, on DeepSpeed's default ZeRO knobs (bench/gpu_transformers.py says which).

Comparisons: throughput ratio = reference median step time / rayzero's (> 1: rayzero faster), from
the median over rounds of each round's median step; peak memory ratio rayzero / reference; the
largest relative loss difference over the steps against DDP (fp32) or DeepSpeed's same stage (bf16,
offload). Rows that fail carry `error`; the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # `bench` as a package

from bench.engine import FORK_SERVER_PRELOAD, merge_rounds, run_job
from bench.gpu_transformers import transformers_jobs

STAGES = (0, 1, 2, 3)
SECTIONS = ("engine", "offload", "transformers")
MINIMUM_JOB_S = 20.0  # a job started with less left than this would only be cut off
SKIPPED = "skipped"  # how a row that --budget-s left unrun begins its error
PINNED_CPU = {"device": "cpu", "pin_memory": True}
# DeepSpeed refuses a client optimizer under offload unless told; torch's Adam on the host for both.
HOST_ADAM = {"zero_force_ds_cpu_optimizer": False}


def _variant(system: str, label: str | None = None, extra: dict | None = None, env: dict | None = None,
             models: list[str] | None = None) -> dict[str, Any]:
    variant: dict[str, Any] = {"system": system, "label": label or system, "extra": extra or {}, "env": env or {}}
    if models:
        variant["models"] = models
    return variant


def engine_jobs(precision: str) -> list[dict[str, Any]]:
    """fp32: every system on both models; bf16: DeepSpeed and rayzero stages on the GPT (the MLP's
    float inputs would need a cast DeepSpeed's bf16 engine does not make)."""
    if precision == "fp32":
        systems = ["ddp", "fsdp2"] + [f"{family}-stage{s}" for s in STAGES for family in ("deepspeed", "rayzero")]
        return [{"variants": [_variant(system) for system in systems], "models": ["gpt", "mlp"], "section": "engine",
                 "precision": "fp32"}]
    bf16 = {"bf16": {"enabled": True}}
    variants = [_variant(f"{family}-stage{s}", f"{family}-stage{s}-bf16", bf16)
                for s in STAGES for family in ("deepspeed", "rayzero")]
    return [{"variants": variants, "models": ["gpt"], "section": "engine", "precision": "bf16"}]


def offload_jobs(nvme_directory: str) -> list[dict[str, Any]]:
    variants = []
    for stage in (1, 2, 3):
        zero: dict[str, Any] = {"offload_optimizer": PINNED_CPU}
        if stage == 3:
            zero["offload_param"] = PINNED_CPU
        extra = {**HOST_ADAM, "zero_optimization": zero}
        name = f"stage{stage}-offload-cpu"
        variants += [_variant(f"deepspeed-stage{stage}", f"deepspeed-{name}", extra),
                     _variant(f"rayzero-stage{stage}", f"rayzero-{name}", extra)]
        if stage < 3:  # the overlapped step's own figure: the same step run after backward
            variants.append(_variant(f"rayzero-stage{stage}", f"rayzero-{name}-after-backward", extra,
                                     {"RAYZERO_OFFLOAD_OVERLAP_STEP": "0"}))
    nvme = {"device": "nvme", "nvme_path": nvme_directory, "pipeline_read": True, "pipeline_write": True}
    variants.append(_variant("rayzero-stage3", "rayzero-stage3-offload-nvme",
                             {**HOST_ADAM, "zero_optimization": {"offload_optimizer": nvme}}))
    return [{"variants": variants, "models": ["gpt"], "section": "offload", "precision": "fp32"}]


def plan(args: argparse.Namespace, scratch: pathlib.Path) -> list[dict[str, Any]]:
    import torch

    world_size = max(1, torch.cuda.device_count()) if args.device == "cuda" else 1
    templates: list[dict[str, Any]] = []
    if "engine" in args.sections:
        templates += engine_jobs("fp32") + engine_jobs("bf16")
    if "offload" in args.sections:
        (scratch / "nvme").mkdir()
        templates += offload_jobs(str(scratch / "nvme"))
    if "transformers" in args.sections:
        templates += transformers_jobs()
    jobs = []
    for round_index in range(args.rounds):
        for template in templates:
            offload = template["section"] == "offload"
            steps = template.get("steps", 4 if offload else 10)
            jobs.append({"name": f"{template['section']}-{template['precision']}", **template,
                         "systems": [v["label"] for v in template["variants"]],
                         "world_size": world_size, "round": round_index, "device": args.device,
                         "quick": "quick" if args.quick else "gpu", "optimizer_impl": "fused",
                         "warmup": template.get("warmup", 2 if offload else 3), "steps": 3 if args.quick else steps,
                         "collective_timeout_s": 300})
    return jobs


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, model): bench/engine.py's merge (the median over rounds of each round's
    median step), with the largest peak memory of the rounds and the spread of the timed steps of
    every round around the median ((max - min) / median: what one round already shows)."""
    merged = merge_rounds(rows)
    for row in merged:
        good = [r for r in rows if (r["system"], r["model"]) == (row["system"], row["model"]) and "error" not in r]
        row["peak_gpu_memory_bytes"] = max((r.get("peak_gpu_memory_bytes") or 0 for r in good), default=0) or None
        steps = [t for r in good for t in r.get("step_times_s", [])]
        if steps and row.get("step_time_median_s"):
            row["step_time_step_spread"] = round((max(steps) - min(steps)) / row["step_time_median_s"], 4)
    return merged


def _loss_gap(mine: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, theirs, strict=True))


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """rayzero's rows against their references: throughput, peak memory, loss agreement."""
    index = {(row["system"], row["model"]): row for row in rows}
    pairs = []
    for (system, model), row in index.items():
        if not system.startswith("rayzero") or system.endswith("-after-backward") \
                or row.get("step_time_median_s") is None:
            continue
        suffix = system.removeprefix("rayzero-")
        references = [f"deepspeed-{suffix}", f"{system}-after-backward"]  # the second: offload only
        if suffix == "stage0":
            references.append("ddp")
        if suffix == "stage3":
            references.append("fsdp2")
        for reference in references:
            other = index.get((reference, model))
            if not other or other.get("step_time_median_s") is None:
                continue
            pair: dict[str, Any] = {
                "rayzero": system, "reference": reference, "model": model,
                "throughput_ratio": other["step_time_median_s"] / row["step_time_median_s"],
                "throughput_ratio_per_round": [theirs / mine for mine, theirs in zip(
                    row["step_time_round_medians_s"], other["step_time_round_medians_s"], strict=False)],
            }
            if row.get("peak_gpu_memory_bytes") and other.get("peak_gpu_memory_bytes"):
                pair["peak_memory_ratio"] = row["peak_gpu_memory_bytes"] / other["peak_gpu_memory_bytes"]
            loss_reference = index.get(("ddp", model)) if row["precision"] == "fp32" and row["section"] == "engine" \
                else other
            if loss_reference and loss_reference.get("losses"):
                pair["loss_max_relative_gap"] = _loss_gap(row["losses"], loss_reference["losses"])
                pair["loss_reference"] = loss_reference["system"]
            pairs.append(pair)
    return pairs


def table(rows: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> str:
    lines = [f"{'system':40} {'model':11} {'step ms':>9} {'rounds':>7} {'steps':>7} {'peak GiB':>9}"
             "   (spreads: (max - min) / median of the round medians, of every timed step)"]
    for row in rows:
        if row.get("step_time_median_s") is None:
            lines.append(f"{row['system']:40} {row['model']:11} ERROR {str(row.get('error'))[:80]}")
            continue
        peak = row.get("peak_gpu_memory_bytes")
        lines.append(f"{row['system']:40} {row['model']:11} {row['step_time_median_s'] * 1e3:9.2f} "
                     f"{row['step_time_round_spread']:7.3f} {row.get('step_time_step_spread', float('nan')):7.3f} "
                     f"{peak / 2**30 if peak else float('nan'):9.2f}")
    lines.append("")
    for pair in pairs:
        memory = f"{pair['peak_memory_ratio']:.3f}" if pair.get("peak_memory_ratio") else "-"
        lines.append(f"{pair['rayzero']:40} vs {pair['reference']:34} {pair['model']:11} "
                     f"throughput {pair['throughput_ratio']:.3f}x  memory "
                     f"{memory:>5}x  loss gap "
                     f"{pair.get('loss_max_relative_gap', float('nan')):.2e}")
    return "\n".join(lines)


def _machine(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                           "device": device}
    if device == "cuda" and torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["cuda"] = torch.version.cuda
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in ("deepspeed", "rayzero"):
        try:
            out[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - a version is context, not a requirement
            out[name] = f"unavailable: {type(error).__name__}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="bench/models.py's quick sizes (a dry run)")
    parser.add_argument("--job-timeout-s", type=float, default=600.0)
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no job after this many seconds (each job's deadline is cut to what is left); "
                             "the jobs not run are error rows, and the table is still printed")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    import multiprocessing

    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    merged: list[dict[str, Any]] = []  # stays empty if the plan has no job
    with tempfile.TemporaryDirectory(prefix="rayzero-bench-gpu-") as scratch:
        for job in plan(args, pathlib.Path(scratch)):
            left = args.budget_s - (time.monotonic() - began)
            if left < MINIMUM_JOB_S:
                job_rows = [{"system": system, "world_size": job["world_size"], "model": model, "round": job["round"],
                             "error": f"{SKIPPED}: --budget-s {args.budget_s:.0f} spent"}
                            for system in job["systems"] for model in job["models"]]
            else:
                job_rows = run_job(job, min(args.job_timeout_s, left), pathlib.Path(scratch))
            for row in job_rows:
                row.update(section=job["section"], precision=job["precision"], job=job["name"])
            rows += job_rows
            errors = sum("error" in row for row in job_rows)
            print(f"[{time.monotonic() - began:6.1f} s] {job['name']} round {job['round']}: "
                  f"{len(job_rows)} rows, {errors} errors", flush=True)
            # Written after every job, so a run cut off by a lease's time limit keeps what it measured.
            merged = _write(args, rows, began)
    print(table(merged, comparisons(merged)))
    if args.json:
        print(f"wrote {args.json}")
    failed = [row for row in merged if row["system"].startswith("rayzero") and row.get("step_time_median_s") is None
              and not str(row.get("error")).startswith(SKIPPED)]
    return 1 if failed else 0


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], began: float) -> list[dict[str, Any]]:
    merged = merge(rows)
    document = {"results": merged, "comparisons": comparisons(merged), "rows": rows,
                "meta": {"machine": _machine(args.device), "rounds": args.rounds, "sections": args.sections,
                         "jobs_done": len({(row["job"], row["round"]) for row in rows
                                           if not str(row.get("error")).startswith(SKIPPED)}),
                         "total_wall_s": round(time.monotonic() - began, 1), "fp32": "strict (TF32 off)",
                         "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
    return merged


if __name__ == "__main__":
    sys.exit(main())
