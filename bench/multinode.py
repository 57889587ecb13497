"""ZeRO-3 and its hierarchical variants across emulated nodes: step time, bytes per link class,
loss curve; rayzero and DeepSpeed 0.19.8 side by side on the same emulated cluster.

    python bench/multinode.py                      # 2 nodes x 2 ranks, 1 Gbit/s, 3 rounds
    python bench/multinode.py --rate-mbit 100 --rounds 1 --rows zero3,hpz --deepspeed-rows ""

The cluster (bench/netcluster.py): one network namespace per node, `tc`-shaped links between
them, a Ray node in each (bench/netcluster_ray.py). rayzero's rows run through `rayzero.fit` from a
driver in node 0's namespace (bench/multinode_driver.py, bench/multinode_loop.py); DeepSpeed's as
torchrun would launch them, one process per rank in its node's namespace (bench/multinode_deepspeed.py).
Rows run interleaved, round after round; per row the median step time over rounds, the rounds'
spread, the bytes per step on the links between nodes (tc's counters) and on each node's loopback,
the engine's own comm counts, the loss curve. rayzero rows whose keys the config layer still
reports as "recognised but not implemented" say so (`status`): they run and measure what the
engine does with them today. Where network namespaces are refused, the bench says why and falls
back to an alpha-beta model fed with byte counts measured on one machine (`mode` says which).
JSON on stdout and in --json (default bench/results/multinode.json).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # `python bench/multinode.py` from the checkout

from bench.models import spec
from bench.multinode_model import alpha_beta_step_s, link_bytes_from_comm_stats

RAYZERO_ROWS = {
    "zero3": {},
    "hpz": {"zero_hpz_partition_size": "K"},
    "mics": {"mics_shard_size": "K"},
    "hpz+qwz+qgz": {"zero_hpz_partition_size": "K", "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
"""rayzero's rows: zero_optimization keys over flat ZeRO-3; "K" stands for the ranks per node."""
DEEPSPEED_ROWS = {f"deepspeed-{name}": keys for name, keys in RAYZERO_ROWS.items()}


def base_config(micro_batch: int) -> dict[str, Any]:
    """bench/engine_systems.py's ZeRO-3 settings: every parameter partitioned and gathered again for
    backward (the paper's 3Ψ), no clipping; the optimizer is the loops' own torch Adam."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def row_config(keys: dict[str, Any], ranks_per_node: int, micro_batch: int) -> dict[str, Any]:
    config = base_config(micro_batch)
    config["zero_optimization"].update({k: ranks_per_node if v == "K" else v for k, v in keys.items()})
    return config


def implementation_status(config: dict[str, Any], world: int) -> tuple[str, list[str]]:
    """("implemented" | "not implemented yet", the config layer's notes on the row's keys)."""
    from rayzero.config import load_config

    notes = [note for note in load_config(copy.deepcopy(config), world_size=world, allow_unresolved=True).notes
             if "not implemented" in note]
    return ("not implemented yet" if notes else "implemented"), notes


def main() -> None:
    args = _parse()
    from bench.netcluster import probe

    support = probe()
    started = time.monotonic()
    meta = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "model": f"gpt/{args.size}",
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "link": {"rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms},
            "load_average_start": os.getloadavg(), "support": support.__dict__}
    if support.namespaces and args.mode != "model":
        result = _emulated(args, support)
    elif args.mode == "emulated":
        raise SystemExit(f"--mode emulated, but network namespaces are refused here: {support.reason}")
    else:
        reason = support.reason or "--mode model"
        print(f"[multinode] not emulating ({reason}); the alpha-beta model instead", file=sys.stderr, flush=True)
        result = _modelled(args, reason)
    meta.update(load_average_end=os.getloadavg(), wall_s=time.monotonic() - started)
    result = {"meta": meta, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="each node's link, each direction")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="one-way, where the kernel has netem")
    parser.add_argument("--size", default="quick", choices=("quick", "full"), help="bench/models.py GPT size")
    parser.add_argument("--steps", type=int, default=24, help="measured steps per row and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(RAYZERO_ROWS))
    parser.add_argument("--deepspeed-rows", default=",".join(DEEPSPEED_ROWS), help="'' for none")
    parser.add_argument("--calibrate-mb", type=float, default=16.0, help="plain gloo link check; 0 skips it")
    parser.add_argument("--mode", choices=("auto", "emulated", "model"), default="auto",
                        help="auto: emulated where namespaces work, else the model; model: the fallback anyway")
    parser.add_argument("--json", default=str(BENCH / "results" / "multinode.json"))
    return parser.parse_args()


def _job_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    micro = spec("gpt", args.size).batch_per_rank
    world = args.nodes * args.ranks_per_node
    rows = []
    for name in filter(None, args.rows.split(",")):
        config = row_config(RAYZERO_ROWS[name], args.ranks_per_node, micro)
        status, notes = implementation_status(config, world)
        rows.append({"name": name, "config": config, "status": status, "notes": notes})
    return rows


def _emulated(args: argparse.Namespace, support) -> dict[str, Any]:
    from bench import multinode_deepspeed
    from bench.netcluster import Link, NetCluster
    from bench.netcluster_gloo import measure
    from bench.netcluster_ray import RayOnNet

    rows = _job_rows(args)
    micro = spec("gpt", args.size).batch_per_rank
    ds_rows = {name: row_config(DEEPSPEED_ROWS[name], args.ranks_per_node, micro)
               for name in filter(None, args.deepspeed_rows.split(","))}
    loop = {"size": args.size, "warmup": args.warmup, "steps": args.steps}
    link = Link(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms)
    runs: dict[str, list[dict[str, Any]]] = {row["name"]: [] for row in rows} | {name: [] for name in ds_rows}
    calibration: dict[str, Any] = {}
    with NetCluster(args.nodes, link) as cluster:
        if args.calibrate_mb > 0:  # plain gloo, no Ray yet: the link's rate across nodes and within one
            calibration["across_nodes"] = measure(cluster, [1, 1] + [0] * (args.nodes - 2), args.calibrate_mb,
                                                  ops=("broadcast", "all_reduce"))
            calibration["within_a_node"] = measure(cluster, [2] + [0] * (args.nodes - 1), args.calibrate_mb,
                                                   ops=("broadcast", "all_reduce"))
        with RayOnNet(cluster, workers_per_node=args.ranks_per_node) as ray_cluster:
            job_path = Path(ray_cluster.temp_dir) / "job.json"
            for round_index in range(args.rounds):
                job = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "round": round_index,
                       "rows": [{"name": r["name"], "config": r["config"]} for r in rows], "loop": loop,
                       "cluster": cluster.describe(), "storage": f"{ray_cluster.temp_dir}/runs"}
                job_path.write_text(json.dumps(job))
                for entry in _drive(ray_cluster, job_path):
                    runs[entry["row"]].append(entry)
                for name, config in ds_rows.items():
                    if round_index > 0 and all("error" in run for run in runs[name]):
                        continue  # refused in round 0 (MiCS, quantizers): once is enough
                    port = 29600 + round_index
                    runs[name].append({"row": name, "round": round_index,
                                       **multinode_deepspeed.run(cluster, args.ranks_per_node, config, loop,
                                                                 master_port=port)})
                print(f"[multinode] round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        facts = {"ray_nodes_start_s": ray_cluster.timings, "ray_nodes_cpu_s": ray_cluster.cpu_s}
    summaries = [_summary(row["name"], runs[row["name"]], args, row) for row in rows]
    summaries += [_summary(name, runs[name], args, {"config": config, "status": "deepspeed 0.19.8"})
                  for name, config in ds_rows.items()]
    return {"mode": "emulated", "delay_emulated": support.delay, "delay_note": support.delay_reason,
            "calibration": calibration, "cluster": facts, "rows": summaries, "comparisons": _comparisons(summaries)}


def _drive(ray_cluster, job_path: Path) -> list[dict[str, Any]]:
    done = ray_cluster.driver([sys.executable, "-m", "bench.multinode_driver", str(job_path)], timeout_s=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[{")]
    if done.returncode != 0 or not lines:
        job = json.loads(job_path.read_text())
        error = f"driver exit {done.returncode}: {done.stderr.strip()[-2000:]}"
        return [{"row": row["name"], "round": job["round"], "error": error} for row in job["rows"]]
    return json.loads(lines[-1])


def _modelled(args: argparse.Namespace, reason: str) -> dict[str, Any]:
    """No namespaces: run the rows on one machine's loopback (a local Ray), then estimate the
    step across nodes from the engine's byte counts ([Note: gloo's traffic across nodes])."""
    import ray

    from bench.multinode_driver import run_rows

    rows = _job_rows(args)
    world = args.nodes * args.ranks_per_node
    loop = {"size": args.size, "warmup": args.warmup, "steps": args.steps}
    runs: dict[str, list[dict[str, Any]]] = {row["name"]: [] for row in rows}
    ray.init(num_cpus=world, include_dashboard=False, logging_level="WARNING")
    try:
        for round_index in range(args.rounds):
            job = {"nodes": 1, "ranks_per_node": world, "round": round_index, "loop": loop,
                   "rows": [{"name": r["name"], "config": r["config"]} for r in rows],
                   "storage": tempfile.mkdtemp(prefix="rz-multinode-runs-")}
            for entry in run_rows(job):
                runs[entry["row"]].append(entry)
    finally:
        ray.shutdown()
    summaries = []
    for row in rows:
        summary = _summary(row["name"], runs[row["name"]], args, row)
        if "comm_stats" in summary and summary.get("step_time_median_s"):
            link_bytes = link_bytes_from_comm_stats(summary["comm_stats"], [args.ranks_per_node] * args.nodes)
            calls = summary["comm_stats"].get("total", {}).get("calls", 0)
            summary["model"] = {"label": "alpha-beta MODEL, not a measurement across nodes",
                                "link_bytes_per_step": link_bytes,
                                **alpha_beta_step_s(summary["step_time_median_s"], link_bytes, args.nodes,
                                                    args.rate_mbit, args.delay_ms, calls, world)}
        summaries.append(summary)
    return {"mode": f"alpha-beta model: not emulated ({reason}); step times measured with all "
                    f"{world} ranks on this machine's loopback, the link's share modelled",
            "rows": summaries, "comparisons": _comparisons(summaries)}


def _summary(name: str, runs: list[dict[str, Any]], args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    from bench.multinode_loop import rank_links

    good = [run for run in runs if "error" not in run]
    out: dict[str, Any] = {"row": name, "status": row.get("status"), "notes": row.get("notes", []),
                           "config": row.get("config"), "rounds": len(good)}
    if not good:
        out["error"] = runs[0]["error"] if runs else "not run"
        return out
    if len(good) < len(runs):
        out["rounds_failed"] = [run["error"] for run in runs if "error" in run]
    medians = [statistics.median(run["step_times_s"]) for run in good]
    last = good[-1]
    psi = last["trainable_parameters"]
    out.update(trainable_parameters=psi, step_time_median_s=statistics.median(medians),
               step_time_round_medians_s=medians, step_time_min_s=min(min(run["step_times_s"]) for run in good),
               losses=last["losses"])
    if "link_bytes" in last:
        per_step = [run["link_bytes"]["total"]["up_bytes"] / run["steps"] for run in good]
        out.update(link_bytes_per_step=statistics.median(per_step), link_bytes_per_step_rounds=per_step,
                   link_bytes_per_4psi=statistics.median(per_step) / (4 * psi),
                   link_drops=sum(run["link_bytes"]["total"]["up_drops"] + run["link_bytes"]["total"]["down_drops"]
                                  for run in good),
                   link_bytes_per_node_last_round={node: {k: v / last["steps"] for k, v in counts.items()
                                                          if k.endswith("bytes")}
                                                   for node, counts in last["link_bytes"].items() if node != "total"})
    if "loopback_bytes" in last:
        out["loopback_bytes_per_step"] = {node: value / last["steps"] for node, value in last["loopback_bytes"].items()}
    if "comm_stats" in last:
        out["comm_stats"] = last["comm_stats"]
        modelled = link_bytes_from_comm_stats(last["comm_stats"], [args.ranks_per_node] * args.nodes,
                                              counted_in_two_stages="link_bytes" in last)
        out["link_bytes_modelled_from_comm_stats"] = modelled
    if "collectives_last_step" in last:
        out["collectives_last_step"] = last["collectives_last_step"]
    if "placement" in last:
        placement = last["placement"]
        out["placement"] = [{"rank": p["rank"], "node_ip": p["node_ip"], **{k: p["env"][k] for k in
                                                                          ("LOCAL_RANK", "GROUP_RANK")}}
                            for p in placement]
        out["rank_connections_use_node_addresses"] = all(
            tuple(link["addresses"]) == tuple(link["node_ips"]) for link in rank_links(placement))
    return out


def _comparisons(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row against its system's flat ZeRO-3: step time and link bytes, per round and overall."""
    by_name = {row["row"]: row for row in summaries}
    out = []
    for row in summaries:
        base_name = "deepspeed-zero3" if row["row"].startswith("deepspeed-") else "zero3"
        base = by_name.get(base_name)
        if row["row"] == base_name or not base or "error" in row or "error" in base:
            continue
        per_round = [a / b for a, b in zip(row["step_time_round_medians_s"], base["step_time_round_medians_s"])]
        entry = {"row": row["row"], "against": base_name,
                 "step_time_ratio": row["step_time_median_s"] / base["step_time_median_s"],
                 "step_time_ratio_rounds": per_round}
        if "link_bytes_per_step" in row and "link_bytes_per_step" in base:
            entry["link_bytes_ratio"] = row["link_bytes_per_step"] / base["link_bytes_per_step"]
        out.append(entry)
    if "zero3" in by_name and "deepspeed-zero3" in by_name and "error" not in by_name["deepspeed-zero3"] \
            and "error" not in by_name["zero3"]:
        ours, theirs = by_name["zero3"], by_name["deepspeed-zero3"]
        entry = {"row": "zero3", "against": "deepspeed-zero3",
                 "step_time_ratio": ours["step_time_median_s"] / theirs["step_time_median_s"],
                 "step_time_ratio_rounds": [a / b for a, b in zip(ours["step_time_round_medians_s"],
                                                                  theirs["step_time_round_medians_s"])]}
        if "link_bytes_per_step" in ours and "link_bytes_per_step" in theirs:
            entry["link_bytes_ratio"] = ours["link_bytes_per_step"] / theirs["link_bytes_per_step"]
        out.append(entry)
    return out


if __name__ == "__main__":
    main()
