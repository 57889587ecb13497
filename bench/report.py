"""Turns bench/engine.py's raw rows into the figures the engine issue targets, and prints them.

Formulas (ZeRO paper, section 5, adapted to fp32 training — see FORMULA_ASSUMPTIONS):
model-state bytes per rank, with P = G = 4 bytes (fp32 parameters and gradients) and K = 8 bytes
(Adam's two fp32 moments) per trainable parameter Ψ, on N ranks:
    stage 0: (P + G + K)Ψ          stage 1: (P + G)Ψ + KΨ/N
    stage 2: PΨ + (G + K)Ψ/N        stage 3: (P + G + K)Ψ/N
communication per step: 2Ψ elements for stages 0–2 (reduce-scatter + all-gather, or an all-reduce),
3Ψ for stage 3 (parameters all-gathered in forward and again in backward, gradients reduce-scattered).
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
from typing import Any

PARAMETER_BYTES = 4  # fp32 parameters
GRADIENT_BYTES = 4  # fp32 gradients
OPTIMIZER_BYTES = 8  # Adam exp_avg + exp_avg_sq in fp32; no separate master copy (see below)

FORMULA_ASSUMPTIONS = (
    "fp32 training with torch Adam: per trainable parameter 4 bytes of parameter, 4 of gradient and 8 of "
    "optimizer state (two fp32 moments), so the paper's (2+2+K) becomes (4+4+8) with K=8, not 12. The "
    "paper's K=12 counts a 4-byte fp32 master copy because its compute copy is fp16; with fp32 compute "
    "the parameters ARE the fp32 master weights, so a separate master copy is redundant and is counted "
    "against the engine (it shows as model_state_bytes_ratio > 1). Bucket buffers are not model state: "
    "they are reported by the engine separately where it exposes them, never added to the formula."
)

# Speed targets from the engine issue: (rayzero system, reference system, minimum throughput ratio).
SPEED_TARGETS = (
    [("rayzero-stage0", "ddp", 1.00)]
    + [(f"rayzero-stage{s}", f"deepspeed-stage{s}", 1.00) for s in range(4)]
    + [("rayzero-stage3", "fsdp2", 1.10)]
)
COMM_TOLERANCE = 0.01  # "communication = 1.00× ideal": met within ±1 %
MEMORY_TARGET = 1.05  # model-state bytes ≤ 1.05× the formula
LOSS_TOLERANCE = 1e-4  # sanity only: fp32 losses should match DDP's up to reduction order


def stage_of(system: str) -> int | None:
    return int(system.rsplit("stage", 1)[1]) if "stage" in system else None


def model_state_formula(stage: int, parameters: int, world_size: int) -> float:
    psi, n = parameters, world_size
    return {
        0: (PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES) * psi,
        1: (PARAMETER_BYTES + GRADIENT_BYTES) * psi + OPTIMIZER_BYTES * psi / n,
        2: PARAMETER_BYTES * psi + (GRADIENT_BYTES + OPTIMIZER_BYTES) * psi / n,
        3: (PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES) * psi / n,
    }[stage]


def communication_ideal(stage: int, parameters: int) -> int:
    return (3 if stage == 3 else 2) * parameters


def paper_elements(comm_stats: dict[str, Any] | None) -> int | None:
    """Elements moved per rank per step in the paper's unit, from `engine.comm_stats()`.

    rayzero's comm layer already counts in that unit ([Note: communication accounting] in
    rayzero/engine/comm.py): `total.volume_elements` sums every data-moving collective of the last
    step, an all-reduce of n elements as 2n (a reduce-scatter plus an all-gather), a reduce-scatter
    as its full input n, an all-gather as its full output n; one-element control syncs (overflow flag,
    gradient norm) are excluded.
    """
    if not isinstance(comm_stats, dict):
        return None
    total = comm_stats.get("total")
    if isinstance(total, dict) and isinstance(total.get("volume_elements"), (int, float)):
        return int(total["volume_elements"])
    return None


def annotate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the formula, ideal and ratio fields to each row (rayzero rows get all of them)."""
    for row in rows:
        stage = stage_of(row["system"])
        parameters = row.get("trainable_parameters")
        if row["system"].startswith("rayzero"):  # the issue's required fields, null when not measured
            for key in ("comm_elements_per_step", "comm_elements_ideal", "model_state_bytes_per_rank",
                        "model_state_bytes_formula"):
                row.setdefault(key, None)
        if "error" in row or parameters is None:
            continue
        formula_stage = stage if stage is not None else (0 if row["system"] == "ddp" else 3)
        row["model_state_bytes_formula"] = model_state_formula(formula_stage, parameters, row["world_size"])
        if row.get("model_state_bytes_per_rank") is not None:
            row["model_state_bytes_ratio"] = row["model_state_bytes_per_rank"] / row["model_state_bytes_formula"]
        if row["system"].startswith("rayzero"):
            row["comm_elements_ideal"] = communication_ideal(stage, parameters) if row["world_size"] > 1 else 0
            row["comm_elements_per_step"] = paper_elements(row.get("comm_stats"))
            if row["comm_elements_per_step"] is not None and row["comm_elements_ideal"]:
                row["comm_ratio"] = row["comm_elements_per_step"] / row["comm_elements_ideal"]
    return rows


def _index(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    return {(row["system"], row["world_size"], row["model"]): row for row in rows}


def speed_ratio(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, list[float]]:
    """rayzero's throughput over the reference: THE one method of every ratio this bench reports.

    With interleaved rounds (`--repeats`), the median of the per-round ratios (reference's round
    median step time / rayzero's of the same round): each round's pair shares the machine's load, so
    a busy round moves both and its ratio still counts once. With one round, the ratio of the medians.
    Returns (ratio, per-round ratios)."""
    ours, reference = mine.get("step_time_round_medians_s") or [], theirs.get("step_time_round_medians_s") or []
    if len(ours) > 1 and len(ours) == len(reference):
        per_round = [their / our for our, their in zip(ours, reference)]
        return statistics.median(per_round), per_round
    return theirs["step_time_median_s"] / mine["step_time_median_s"], []


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratio rows named as targets in the engine issue, each with target, value and met."""
    index = _index(rows)
    models = sorted({row["model"] for row in rows})
    found: list[dict[str, Any]] = []

    def add(kind: str, target: str, value: float | None, met: bool, **extra: Any) -> None:
        found.append({"kind": kind, "target": target, "value": value, "met": bool(met), **extra})

    for model in models:
        for system, reference, minimum in SPEED_TARGETS:
            mine, theirs = index.get((system, 2, model)), index.get((reference, 2, model))
            target = f"{system} throughput >= {minimum:.2f}x {reference} ({model}, world size 2)"
            if not mine or not theirs or "error" in mine or "error" in theirs:
                missing = [r["system"] for r in (mine, theirs) if r and "error" in r]
                add("speed", target, None, False, note=f"not measured: {missing or 'row missing'} failed")
                continue
            value, per_round = speed_ratio(mine, theirs)
            # The ratio of fastest steps is less sensitive to load from other processes; `met` is
            # decided on the medians, as the issue's target states, the other is a noise check.
            fastest = theirs["step_time_min_s"] / mine["step_time_min_s"]
            cpu = theirs["step_cpu_time_median_s"] / mine["step_cpu_time_median_s"]
            add("speed", target, round(value, 3), value >= minimum, value_from_fastest_steps=round(fastest, 3),
                value_from_cpu_time=round(cpu, 3), ratio_per_round=[round(r, 3) for r in per_round])
    for row in rows:
        if not row["system"].startswith("rayzero") or "error" in row:
            continue
        where = f"{row['system']} ({row['model']}, world size {row['world_size']})"
        if row["world_size"] > 1:
            ratio = row.get("comm_ratio")
            add("communication", f"{where} comm elements = 1.00x ideal", None if ratio is None else round(ratio, 4),
                ratio is not None and abs(ratio - 1.0) <= COMM_TOLERANCE)
        ratio = row.get("model_state_bytes_ratio")
        add("memory", f"{where} model-state bytes <= {MEMORY_TARGET:.2f}x formula",
            None if ratio is None else round(ratio, 4), ratio is not None and ratio <= MEMORY_TARGET)
    reference_losses = {model: (index.get(("ddp", 2, model)) or {}).get("losses") for model in models}
    for row in rows:
        losses, reference = row.get("losses"), reference_losses.get(row["model"])
        if row["world_size"] != 2 or row["system"] == "ddp" or not losses or not reference:
            continue
        difference = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
        add("sanity", f"{row['system']} loss trajectory matches ddp within {LOSS_TOLERANCE:g} ({row['model']})",
            float(f"{difference:.3g}"), difference <= LOSS_TOLERANCE)
    return found


def progress_line(job: dict[str, Any], rows: list[dict[str, Any]], elapsed: float) -> str:
    parts = []
    for row in rows:
        if "error" in row:
            parts.append(f"{row['system']}/{row['model']}: ERROR {row['error'][:80]}")
        else:
            parts.append(f"{row['system']}/{row['model']}: {row['step_time_median_s'] * 1e3:.1f} ms")
    return (f"[{elapsed:6.1f} s] {'+'.join(job['systems'])} ws={job['world_size']} round={job['round']}: "
            + "; ".join(parts))


def table(rows: list[dict[str, Any]], found: list[dict[str, Any]]) -> str:
    def number(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [(f"{'system':18} {'ws':>2} {'model':5} {'step ms':>8} {'cpu ms':>7} {'state MB':>9} "
              f"{'state/formula':>13} {'comm/ideal':>10}  note")]
    for row in sorted(rows, key=lambda r: (r["world_size"] != 2, r["world_size"], r["model"], r["system"])):
        median, cpu = row.get("step_time_median_s"), row.get("step_cpu_time_median_s")
        state = row.get("model_state_bytes_per_rank")
        lines.append(
            f"{row['system']:18} {row['world_size']:>2} {row['model']:5} "
            f"{number(None if median is None else median * 1e3, '8.1f'):>8} "
            f"{number(None if cpu is None else cpu * 1e3, '7.1f'):>7} "
            f"{number(None if state is None else state / 2**20, '9.2f'):>9} "
            f"{number(row.get('model_state_bytes_ratio'), '13.3f'):>13} {number(row.get('comm_ratio'), '10.3f'):>10}  "
            + (("ERROR " + row["error"][:70]) if "error" in row else "")
        )
    lines.append("")
    lines.append("targets:")
    for comparison in found:
        mark = "met" if comparison["met"] else "NOT met"
        value = "-" if comparison["value"] is None else comparison["value"]
        fastest, cpu = comparison.get("value_from_fastest_steps"), comparison.get("value_from_cpu_time")
        note = comparison.get("note", "") + (f"(fastest steps: {fastest}, cpu time: {cpu})" if fastest else "")
        lines.append(f"  [{mark:7}] {comparison['target']}: {value} {note}".rstrip())
    return "\n".join(lines)


def machine_description() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {model}".strip(", ")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    from importlib import metadata

    for name in ("torch", "deepspeed", "rayzero"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def emit(result: dict[str, Any], path: str | None, indent: int = 2) -> None:
    """A benchmark's JSON result on stdout, and in `path` when one was given (`--json`)."""
    text = json.dumps(result, indent=indent)
    print(text)
    if path:
        pathlib.Path(path).write_text(text)
