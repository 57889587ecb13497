"""A chaos soak that loses nothing (issue 24 section 3): a real `rayzero.fit` run on a local 3-node Ray
cluster, faults one after another, and at the end the weights of a fault-free single process.

    python bench/chaos.py [--minutes 30] [--seed 0] [--json out.json]
    python bench/chaos.py --minutes 4 --intervals auto,10,50,200 --json forward.json
    python bench/chaos.py --minutes 4 --intervals 200,50,10,auto --json reversed.json
    python bench/chaos.py --merge forward.json reversed.json --json bench/results/chaos-intervals.json

The run: `ray.cluster_utils.Cluster` with a head without CPUs (the drivers and controllers live there)
and three 1-CPU worker nodes; elastic `(2, 3)` workers; checkpoints on the nodes' own disks
(`checkpoint.use_node_local_storage`, `replicas: 1`, `keep_last: 3`), every node's directory on one
small loop-mounted ext4 image (so it can be filled); the loop of bench/chaos_loop.py (a linear
regression whose data is a pure function of the step) saving every `--save-every` steps; the driver
is a subprocess (`python bench/chaos.py --driver spec.json`) so it can be killed and run again with
the same name. A fault comes every 30-90 s (`--gap`), never sooner than 5 s (`--settle`) after training
resumed from the previous one; the first faults are every kind once in a seeded order, then kinds are drawn
at random (seeded: `--seed`), and victims are drawn with the same generator:

  kill     SIGKILL to a worker process
  hang     SIGSTOP to a worker process (rayzero: FailureConfig.hang_timeout_s = --hang-timeout, 15 s,
           a bit over 100 steps here: long enough that a loaded machine's pauses are not hangs)
  node     the node under a worker removed (its node-local directory deleted with it), returned
           after 10-30 s (`--hold`) as a new node; the run should grow back to 3
  sigterm  SIGTERM to a worker (a preemption)
  enospc   the checkpoint disk filled (and kept full) for 10-30 s, then freed
  corrupt  every worker stopped (SIGSTOP), 16 bytes flipped in the middle of the newest committed
           checkpoint's shard of one rank on that rank's node, that rank SIGKILLed, the rest resumed:
           the restart has to load the damaged checkpoint (from the replica on another node)
  driver   the driver SIGKILLed and the same command run again
  scale    `rayzero scale NAME 2` through the control plane, then `rayzero scale NAME 3`
  stop     `rayzero stop NAME`, then the same command run again

Survived: training resumed within --recovery-timeout (a new invocation of the loop reported a step;
for `node` also grew back to 3 workers, for `scale` reached the asked size and came back, for
`corrupt` resumed from the damaged checkpoint itself, for `enospc` kept stepping while the disk was
full, restarted nothing, and committed a checkpoint once it was freed). Recovery time: the fault to
the first step after it (enospc: freeing the disk to the next commit).

Nothing lost: every checkpoint a `rayzero status` (the control plane, polled twice a second) listed
as committed must stay loadable from the disks that still exist (each of its files with a copy whose
checksum matches the manifest) until `keep_last` newer ones were committed; checked before every
fault and at the end. At the end the loop runs to a step the harness sets (`finish` file) and its
weights must equal plain SGD in one process (bench/chaos_loop.py `reference_weights`) within 1e-5.

Goodput two ways: rayzero's own (`Result.goodput` of the last driver call, which carries the
earlier calls' totals through goodput.json; time between a killed driver and its rerun is nobody's
there), and from outside, the same for both systems: the kept steps times the median step time
(steps of one invocation one after another), over the wall time from the first launch to the end.
Steps redone = step executions minus kept steps. Ray Train v2 gets the same schedule with the same
loop as DDP (rank 0 saves `{model, step}` every --save-every steps through `ray.train.report`,
`TorchConfig(timeout_s=--hang-timeout)` so a stopped rank surfaces as a collective timeout, elastic
(2, 3), `max_failures=-1`); `enospc` and `scale` are skipped on its side (see RAY_TRAIN_SKIPS), and
`stop` is SIGINT to its driver; its `corrupt` damages the newest checkpoint's state.pt (its one copy)
and counts as survived only if the restart did not load it (nothing checks it: torch.load reads
flipped float bytes as weights). Its cluster has a dashboard (Ray Train v2's PlacementGroupCleaner
asks the state API whether its controller lives). Measured here (Ray 2.60): a rerun after a killed
driver waits about 3 minutes for workers ("ready resources for 0 workers"), until the dead
controller's request in Ray Data's AutoscalingCoordinator expires (AUTOSCALING_REQUESTS_EXPIRE_TIME_S
= 180); that wait is its recovery time for `driver`.

`--intervals auto,10,50,200` runs rayzero alone once per setting on the same schedule, in the order
given (the machine's load drifts: run the reverse order too): `auto` is `checkpoint.interval: "auto"`
with a loop that never saves; a number is the loop saving every that many steps. For `auto` each
fault's record has `interval_before`, the interval and its inputs as `rayzero status` showed them
just before the fault.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_soak import Soak, SoakOptions
from chaos_world import KINDS, scratch_root


def run_soak(system: str, setting: str | int, options: SoakOptions, root: Path) -> dict:
    """One system through the schedule on a fresh cluster; returns its JSON section."""
    started = time.time()
    result = Soak(system, setting, options, root).run()
    result["harness_s"] = round(time.time() - started, 1)
    return result


def compare_intervals(settings: list[str], options: SoakOptions, root: Path) -> dict:
    runs = [run_soak("rayzero", setting, options, root) for setting in settings]
    rows = {str(run["setting"]): _goodputs(run) for run in runs}
    fixed = {key: row for key, row in rows.items() if key != "auto"}
    verdict = {}
    if "auto" in rows and fixed:
        for measure in ("goodput", "outside_goodput"):
            best = max(fixed, key=lambda key: fixed[key][measure] or 0)
            auto, top = rows["auto"][measure] or 0, fixed[best][measure] or 0
            verdict[measure] = {"best_fixed": best, "best_fixed_value": top, "auto": auto,
                                "auto_minus_best": round(auto - top, 4)}
    return {"rows": rows, "auto_vs_best_fixed": verdict, "runs": runs}


def merge_orders(paths: list[str]) -> dict:
    """Several `--intervals` results (e.g. one in each order, against the machine's load drift) in one
    file: each as it was, and per setting the mean of goodput, outside goodput and the badput the
    checkpoint setting itself decides (the outside view's redone steps plus rayzero's checkpoint stall)."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    rows = [result["intervals"]["rows"] for result in results]
    settings = [key for key in rows[0] if all(key in row for row in rows)]
    runs = {str(run["setting"]): [] for run in results[0]["intervals"]["runs"]}
    for result in results:
        for run in result["intervals"]["runs"]:
            runs.setdefault(str(run["setting"]), []).append(run)
    mean = {}
    for key in settings:
        policy = [run["outside"].get("redone_s", 0.0) + run["goodput"]["badput_s"]["checkpoint stall"]
                  for run in runs[key]]
        mean[key] = {"goodput": round(sum(row[key]["goodput"] for row in rows) / len(rows), 4),
                     "outside_goodput": round(sum(row[key]["outside_goodput"] for row in rows) / len(rows), 4),
                     "redone_plus_stall_s": round(sum(policy) / len(policy), 2),
                     "redone_plus_stall_s_each": [round(value, 2) for value in policy]}
    verdict = {}
    fixed = [key for key in settings if key != "auto"]
    if "auto" in mean and fixed:
        for measure in ("goodput", "outside_goodput"):
            best = max(fixed, key=lambda key: mean[key][measure])
            verdict[measure] = {"best_fixed": best, "best_fixed_value": mean[best][measure],
                                "auto": mean["auto"][measure],
                                "auto_minus_best": round(mean["auto"][measure] - mean[best][measure], 4)}
        best = min(fixed, key=lambda key: mean[key]["redone_plus_stall_s"])
        verdict["redone_plus_stall_s"] = {"best_fixed": best, "best_fixed_value": mean[best]["redone_plus_stall_s"],
                                          "auto": mean["auto"]["redone_plus_stall_s"]}
    return {"benchmark": "chaos", "merged": [{"file": path, "order": result["args"]["intervals"],
                                               "machine": result["machine"]} for path, result in zip(paths, results)],
            "mean_over_orders": mean, "auto_vs_best_fixed": verdict,
            "orders": [{"args": result["args"], "machine": result["machine"], "intervals": result["intervals"]}
                       for result in results]}


def _goodputs(run: dict) -> dict:
    goodput = run.get("goodput") or {}
    return {"goodput": goodput.get("goodput"), "badput_s": goodput.get("badput_s"),
            "outside_goodput": run["outside"].get("goodput"), "steps_redone": run["outside"]["steps_redone"],
            "kept_steps_per_s": run["outside"]["kept_steps_per_s"],
            "all_survived": all(r.get("survived") for r in run["faults"] if "skipped" not in r),
            "lost": len(run["lost_checkpoints"]),
            "weights_equal": bool(run["final_weights"] and run["final_weights"]["equal"])}


# ---- the driver subprocess ---------------------------------------------------------------------------

def driver_main(spec_path: str, launch: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    loop_config = {"dir": spec["dir"], "steps": 10 ** 9, "sleep": spec["sleep"], "save_every": spec["save_every"]}
    out = Path(spec["out"]) / f"result-{launch}.json"
    if spec["system"] == "rayzero":
        import chaos_loop

        import rayzero

        config = dict(chaos_loop.rayzero_config(), checkpoint={
            "use_node_local_storage": True, "replicas": 1, "keep_last": spec["keep_last"],
            **({"interval": spec["interval"]} if spec["interval"] else {})})
        result = rayzero.fit(chaos_loop.rayzero_loop, config=config,
                             scaling=rayzero.ScalingConfig(num_workers=(2, 3)),
                             run=rayzero.RunConfig(name=spec["name"], storage=Path(spec["storage"]).as_uri(),
                                                   progress_interval_s=30),
                             failure=rayzero.FailureConfig(hang_timeout_s=spec["hang_timeout_s"]),
                             train_loop_config=loop_config)
        out.write_text(json.dumps({"launch": launch, "goodput": result.goodput, "failures": result.failures,
                                   "stopped": result.stopped, "checkpoint_step": result.checkpoint_step}))
        return 0
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import chaos_loop
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        chaos_loop.ray_train_loop, train_loop_config=dict(loop_config, save_every=spec["save_every"] or 50),
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3)),
        torch_config=TorchConfig(backend="gloo", timeout_s=int(spec["hang_timeout_s"])),
        run_config=ray.train.RunConfig(name=spec["name"], storage_path=spec["storage"],
                                       failure_config=ray.train.FailureConfig(max_failures=-1),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec["keep_last"])))
    trainer.fit()
    out.write_text(json.dumps({"launch": launch}))
    return 0


# ---- the report -------------------------------------------------------------------------------------

def table(run: dict) -> str:
    lines = [f"{run['system']} ({'auto interval' if run['setting'] == 'auto' else 'saves every ' + str(run['setting']) + ' steps'})"]
    lines.append(f"{'fault':<9}{'injected':>9}{'survived':>9}{'skipped':>8}  recovery s (each)")
    for kind, row in run["per_kind"].items():
        lines.append(f"{kind:<9}{row['injected']:>9}{row['survived']:>9}{row['skipped']:>8}  "
                     + ", ".join(f"{value:g}" for value in row["recovery_s"]))
    goodput, outside = run.get("goodput") or {}, run["outside"]
    if goodput:
        causes = ", ".join(f"{cause} {seconds:.0f}s" for cause, seconds in goodput["badput_s"].items() if seconds)
        lines.append(f"rayzero's goodput {goodput['goodput']:.1%} of {goodput['wall_s']:.0f}s ({causes})")
    lines.append(f"outside goodput {outside.get('goodput') or 0:.1%} of {outside['wall_s']:.0f}s: "
                 f"{outside['final_step']} kept steps x {outside['median_step_s']}s, "
                 f"{outside['steps_redone']} redone")
    weights = run["final_weights"]
    lines.append(f"final weights {'equal the reference' if weights and weights['equal'] else 'DIFFER'}"
                 + (f" (step {weights['step']}, max |diff| {weights['max_abs_diff']:.2e})" if weights else ""))
    lines.append(f"committed checkpoints lost: {len(run['lost_checkpoints'])} "
                 f"({run['committed_seen']} seen committed, {run['checkpoint_checks']} checks)")
    return "\n".join(lines)


def options_from(args: argparse.Namespace) -> SoakOptions:
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {','.join(KINDS)}")
    return SoakOptions(minutes=args.minutes, seed=args.seed, kinds=kinds, gap=_pair(args.gap), hold=_pair(args.hold),
                       min_faults=args.min_faults, hang_timeout_s=args.hang_timeout, sleep_s=args.sleep,
                       settle_s=args.settle)


def _pair(text: str) -> tuple[float, float]:
    low, high = (float(part) for part in text.split(":"))
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--gap", default="30:90", help="seconds between faults, low:high")
    parser.add_argument("--hold", default="10:30", help="seconds a node stays away / the disk stays full")
    parser.add_argument("--min-faults", type=int, default=0)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="least seconds of training after a recovery before the next fault")
    parser.add_argument("--hang-timeout", type=float, default=15.0)
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds per step standing for compute")
    parser.add_argument("--save-every", type=int, default=50, help="the loop's own saves (both systems)")
    parser.add_argument("--systems", default="rayzero,ray-train", help="rayzero, ray-train or both")
    parser.add_argument("--intervals", default=None, help="e.g. auto,10,50,200: rayzero once per setting")
    parser.add_argument("--scratch", default=None, help="where the runs' files go (default: a new temp dir)")
    parser.add_argument("--merge", nargs="+", default=None,
                        help="--intervals result files to put in one (with --json): each, and the means")
    parser.add_argument("--json", default=None)
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver:
        return driver_main(args.driver, args.launch)
    if args.merge:
        merged = merge_orders(args.merge)
        print(json.dumps({"mean_over_orders": merged["mean_over_orders"], "auto_vs_best_fixed": merged["auto_vs_best_fixed"]},
                         indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(merged, indent=1))
        return 0
    options = options_from(args)
    root = scratch_root(args.scratch)
    out: dict = {"benchmark": "chaos", "machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start",
                 "args": {k: v for k, v in vars(args).items() if k not in ("json", "driver", "launch")},
                 "scratch": str(root)}
    if args.intervals:
        out["intervals"] = compare_intervals(args.intervals.split(","), options, root)
        for run in out["intervals"]["runs"]:
            print(table(run), flush=True)
        print(json.dumps(out["intervals"]["rows"], indent=1))
    else:
        for system in args.systems.split(","):
            out[system.replace("-", "_")] = run_soak(system, args.save_every, options, root)
            print(table(out[system.replace("-", "_")]), flush=True)
    out["machine"] += f", {os.getloadavg()[0]:.1f} at the end"
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
