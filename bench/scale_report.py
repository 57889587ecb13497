"""bench/scale.py's analysis: growth exponents (least-squares log-log slopes), the targets at 4,096
workers, and the log-log plot."""
from __future__ import annotations

import math
import statistics
from typing import Any

from rayzero.config.run_settings import FailureConfig

TARGETS_AT = 4096
HANG_LIMIT_S = FailureConfig().hang_timeout_s  # the default a user gets (55 s)
EXPONENT_TOLERANCE = 0.1  # a fitted exponent up to 1.1 counts as linear: see pickle_reference_cpu_s


# (section, key) -> what the plot and the exponent table call it; every one should grow at most linearly
GROWING = {
    ("logic", "heartbeat_round_cpu_s"): "controller CPU per heartbeat round",
    ("logic", "reports_poll_cpu_s"): "controller CPU per poll of N reports",
    ("logic", "driver_update_cpu_s"): "controller CPU per driver poll (pickled)",
    ("logic", "status_cpu_s"): "status, first call of a round",
    ("logic", "status_again_cpu_s"): "status, later calls of the round",
    ("logic", "dead_decide_cpu_s"): "decide on a dead rank",
    ("logic", "restart_plan_cpu_s"): "plan the restart (registry scans)",
    ("logic", "hang_decide_cpu_s"): "decide on a hang (stacks, message)",
    ("logic", "resize_plan_cpu_s"): "resize through the planned stop",
    ("logic", "pickle_reference_cpu_s"): "reference: pickling N reports (linear by construction)",
    ("grpc", "status_p50_s"): "GetStatus p50 under load",
    ("grpc", "status_p99_s"): "GetStatus p99 under load",
    ("metrics", "write_s_per_step"): "metrics.parquet write per step of N rows",
    ("checkpoint", "commit_s"): "commit of N shards (leader), wall",
    ("checkpoint", "save_cpu_s"): "commit of N shards (leader), CPU",
    ("checkpoint", "manifest_bytes"): "manifest bytes",
    ("checkpoint", "registry_scan_cpu_s"): "registry scan, cold (2 checkpoints), CPU",
    ("checkpoint", "tracker_failure_scans_s"): "registry scans per failure, warm",
    ("checkpoint", "load_inventory_per_rank_bytes"): "a load's inventory, bytes each rank receives (node-local)",
    ("checkpoint", "shared_load_inventory_per_rank_bytes"): "a load's inventory, bytes each rank receives (shared storage)",
    ("ray", "cpu_per_wall_s_at_real_rate"): "controller process CPU/s, a round a second (b)",
    ("ray", "dead_detect_s"): "dead rank detected, wall (b)",
    ("ray", "hang_detect_s"): "hang detected (limit 30 s), wall (b)",
    ("ray", "resize_s"): "resize, wall (b)",
    ("small_nodes", "cpu_per_wall_s_at_real_rate"): "controller process CPU/s, single-rank nodes, relays of 8 nodes (b)",
    ("small_nodes", "per_node_cpu_per_wall_s_at_real_rate"): "the same with a relay per node (before)",
}


def exponent(sizes: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) on log(N); None with fewer than two positive points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v is not None and v > 0]
    if len(points) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    denominator = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / denominator if denominator else None


def series(rows: list[dict[str, Any]], section: str, key: str) -> tuple[list[int], list[float]]:
    found = [(row["n"], row[section][key]) for row in rows
             if isinstance(row.get(section), dict) and isinstance(row[section].get(key), (int, float))]
    return [n for n, _ in found], [value for _, value in found]


def exponents(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    return {f"{section}.{key}": exponent(*series(rows, section, key)) for section, key in GROWING}


def targets(rows: list[dict[str, Any]], slopes: dict[str, float | None]) -> list[dict[str, Any]]:
    at = next((row for row in rows if row["n"] == TARGETS_AT), None)

    def value(section: str, key: str) -> float | None:
        return at.get(section, {}).get(key) if at is not None and isinstance(at.get(section), dict) else None

    def check(name: str, figure: float | None, limit: float, note: str = "") -> dict[str, Any]:
        return {"target": name, "value": figure, "limit": limit, "met": figure is not None and figure <= limit,
                **({"note": note} if note else {})}

    # a stopped process is counted silent from its last answer, up to one round before it stopped, so
    # the overhead can be negative: counted as 0 here (the design bound is one heartbeat interval)
    overhead = value("ray", "hang_detect_overhead_s")
    overhead = None if overhead is None else max(0.0, overhead)
    out = [
        check(f"dead worker detected <= 10 s at {TARGETS_AT}", value("ray", "dead_detect_s"), 10.0),
        check(f"hang detected <= 60 s at {TARGETS_AT} (default hang_timeout_s {HANG_LIMIT_S:g} + the measured "
              "overhead past the limit)", None if overhead is None else HANG_LIMIT_S + overhead, 60.0,
              "detection is hang_timeout_s plus the overhead; met at the default only if hang_timeout_s leaves room"),
        check(f"hang reported (every rank's stacks read) and the restart begun <= 60 s at {TARGETS_AT} (the same, "
              "+ the report)", None if overhead is None or value("ray", "hang_report_s") is None
              else HANG_LIMIT_S + overhead + value("ray", "hang_report_s"), 60.0),
        check(f"GetStatus p99 <= 100 ms at {TARGETS_AT}", value("grpc", "status_p99_s"), 0.100),
        check(f"controller <= 1 core at {TARGETS_AT} (its process in (b) at one round a second, + two "
              "status watchers from (a))",
              None if value("ray", "cpu_per_wall_s_at_real_rate") is None
              or value("logic", "status_cpu_per_wall_s") is None
              else value("ray", "cpu_per_wall_s_at_real_rate") + value("logic", "status_cpu_per_wall_s"), 1.0),
        check(f"checkpoint commit <= 2 s at {TARGETS_AT}", value("checkpoint", "commit_s"), 2.0),
        check(f"controller <= 1 core at {TARGETS_AT} single-rank nodes (its process in (b) at one round a "
              "second, relays of 8 nodes, + two status watchers from (a))",
              None if value("small_nodes", "cpu_per_wall_s_at_real_rate") is None
              or value("logic", "status_cpu_per_wall_s") is None
              else value("small_nodes", "cpu_per_wall_s_at_real_rate") + value("logic", "status_cpu_per_wall_s"), 1.0),
    ]
    reference = slopes.get("logic.pickle_reference_cpu_s")
    note = (f"linear within {EXPONENT_TOLERANCE}: pickling N reports, linear by construction, fits "
            f"N^{reference:.2f} on this machine (the memory hierarchy)" if reference is not None else "")
    out += [{**check(f"exponent of {name} <= 1", slopes.get(f"{section}.{key}"), 1.0 + EXPONENT_TOLERANCE, note),
             "limit": 1.0, "tolerance": EXPONENT_TOLERANCE} for (section, key), name in GROWING.items()
            if slopes.get(f"{section}.{key}") is not None and not key.startswith(("pickle_reference", "per_node"))]
    return out


def plot(document: dict[str, Any], path: str) -> None:
    """Two log-log panels (the controller's CPU per operation; wall clock, Ray and checkpoints), each
    series labelled with its fitted exponent, and a dashed line of slope 1 for comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(15, 8))
    panels = {0: "controller CPU per operation, (a) and the reference", 1: "wall clock, Ray calls (b), checkpoints"}
    styles = ["-o", "-s", "-^", "-D", "-v", "-P", "-X", "-*", "-<", "->"]
    drawn = [0, 0]
    for (section, key), name in GROWING.items():
        sizes, values = series(document["rows"], section, key)
        if len([v for v in values if v > 0]) < 2:
            continue
        panel = 0 if section == "logic" else 1
        slope = document["exponents"].get(f"{section}.{key}")
        shown = [v / 1e6 for v in values] if key.endswith("bytes") else values
        unit = "MB" if key.endswith("bytes") else "cores" if "per_wall" in key else "s"
        color = plt.get_cmap("tab20")(drawn[panel] % 20)
        axes[panel].plot(sizes, shown, styles[drawn[panel] % len(styles)], color=color, markersize=5,
                         label=f"{name} ({unit}): N^{slope:.2f}")
        drawn[panel] += 1
    for panel, axis in enumerate(axes):
        sizes = [row["n"] for row in document["rows"]]
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        low = axis.get_ylim()[0]
        axis.plot(sizes, [low * 2 * n / sizes[0] for n in sizes], "k--", linewidth=0.8, label="slope 1 (linear)")
        axis.set_xlabel("simulated workers N")
        axis.set_title(panels[panel], fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1, frameon=False)
    figure.suptitle("rayzero's control path against N (bench/scale.py); exponent = least-squares log-log slope")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
