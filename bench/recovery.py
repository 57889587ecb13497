"""Time to recover, per fault kind, on a local Ray: rayzero's controller, and Ray Train v2 on the same
faults where it runs here. Prints JSON.

    python bench/recovery.py [--kinds kill,hang,sigterm,resize,node] [--ray-train] [--rounds 3] [--json out.json]

Each case trains a small model on 2 CPU workers (one loop, written once below, saving every
`--save-every` steps as a loop normally does) and injects one fault mid-run:

  kill     SIGKILL to rank 1's process (a crashed worker)
  hang     rank 1 sleeps forever after a step (rayzero: FailureConfig.hang_timeout_s=--hang-timeout)
  sigterm  SIGTERM to rank 1's process (a preempted pod / spot node)
  resize   rayzero only: a planned resize 2 -> 1 through the control seam (`scale`)
  node     the node under rank 1 removed (`ray.cluster_utils.Cluster`: a head with no CPU and three
           1-CPU nodes, so a spare node is there for both systems; checkpoints on shared storage)

Measured per case: `detect_s` from the fault to the controller's decision (rayzero: its state leaves
RUNNING, read through `status()`), `first_step_s` from the fault to the first step completed after
it, and `steps_lost` (newest step reached before the fault minus the step training resumed from).
Ray Train's decision is not observable from outside; only its first step after is. With `--rounds N`
every case runs N times (interleaved) and `summary` gives the median, min and max per system and kind.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS = 400  # the loop runs until the case stops it; this bounds a case that never recovers



_CLUSTER = None  # the ray.cluster_utils.Cluster of a `node` case


def _inject(kind: str, pids: Path, hang_flag: Path, node_id: str | None = None) -> bool:
    """The fault `kind` on rank 1 (kill, sigterm, hang, node); False for a kind that is not a fault."""
    if kind == "node":
        lost = next(node for node in _CLUSTER.worker_nodes if node.node_id == node_id)
        _CLUSTER.remove_node(lost)
    elif kind in ("kill", "sigterm"):
        os.kill(int((pids / "rank1.attempt0").read_text()), signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    elif kind == "hang":
        hang_flag.write_text("1")
    else:
        return False
    return True

def _model_and_data():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(512, 64, generator=generator)
    return model, inputs, inputs.sum(1, keepdim=True)


def rayzero_loop(config: dict) -> None:
    import torch

    import rayzero

    context = rayzero.get_context()
    model, inputs, targets = _model_and_data()
    engine, _, _, _ = rayzero.initialize(model=model)
    if context.resume_from:
        engine.load_checkpoint(context.resume_from)
    started_at = engine.global_steps
    Path(config["pids"], f"rank{context.rank}.attempt{context.attempt}").write_text(str(os.getpid()))
    while engine.global_steps < STEPS and not context.should_stop():
        index = torch.randint(0, 512, (8,), generator=torch.Generator().manual_seed(engine.global_steps * 7 + context.rank))
        loss = torch.nn.functional.mse_loss(engine(inputs[index]), targets[index])
        engine.backward(loss)
        engine.step()
        if engine.global_steps % config["save_every"] == 0:
            engine.save_checkpoint()
        rayzero.report({"step": engine.global_steps, "time": time.time(), "attempt": context.attempt,
                        "started_at": started_at})
        if config.get("hang") and context.rank == 1 and context.attempt == 0 and Path(config["hang"]).exists():
            time.sleep(3600)
        time.sleep(config["sleep"])


def _wait(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.05)


def rayzero_case(kind: str, args: argparse.Namespace, root: Path) -> dict:
    import ray

    import rayzero
    from rayzero.driver.fit import controller_actor_name

    pids = root / f"rz-{kind}-pids"
    pids.mkdir()
    hang_flag = root / f"rz-{kind}-hang"
    name = f"recovery-{kind}"
    box: dict = {}
    loop_config = {"pids": str(pids), "save_every": args.save_every, "sleep": args.sleep,
                   "hang": str(hang_flag) if kind == "hang" else None}

    def run() -> None:
        try:
            box["result"] = rayzero.fit(
                rayzero_loop, config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                      "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
                scaling=rayzero.ScalingConfig(num_workers=(1, 2) if kind == "resize" else 2,
                                              placement_strategy="SPREAD" if kind == "node" else "PACK"),
                run=rayzero.RunConfig(name=name, storage=(root / "runs").as_uri(), progress_interval_s=60),
                failure=rayzero.FailureConfig(max_failures=2, backoff_s=0, hang_timeout_s=args.hang_timeout),
                train_loop_config=loop_config)
        except BaseException as error:  # noqa: BLE001 - reported in the JSON
            box["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _wait(pids / "rank1.attempt0")
    controller = ray.get_actor(controller_actor_name(name))
    while ray.get(controller.status.remote()).step < args.warmup_steps:
        time.sleep(0.05)
    before = ray.get(controller.status.remote())
    rank1_node = next((r.node_id for r in before.ranks if r.rank == 1), None)
    fault_at = time.time()
    if not _inject(kind, pids, hang_flag, rank1_node) and kind == "resize":
        ray.get(controller.scale.remote(1))
    decided_at = None
    while decided_at is None and time.time() - fault_at < 300:
        status = ray.get(controller.status.remote())
        if status.state != "running" or status.attempt > before.attempt:
            decided_at = time.time()
        time.sleep(0.02)
    while not any(pids.glob("*.attempt1")) and time.time() - fault_at < 300:
        time.sleep(0.05)
    last_seen = ray.get(controller.status.remote()).step
    time.sleep(args.after_s)
    try:
        ray.get(controller.stop.remote(120.0))
    except ray.exceptions.RayActorError:
        pass  # the run ended as the reply was on its way
    thread.join(300)
    if "error" in box:
        return {"kind": kind, "system": "rayzero", "error": box["error"]}
    history = box["result"].metrics_history
    first = [m for m in history if "step" in m and m["attempt"] == 0]
    after = [m for m in history if "step" in m and m["attempt"] > 0]
    reached = max(m["step"] for m in first if m["time"] <= fault_at + 1e-3) if first else 0
    return {
        "kind": kind, "system": "rayzero",
        "detect_s": round(decided_at - fault_at, 3) if decided_at else None,
        "first_step_s": round(after[0]["time"] - fault_at, 3) if after else None,
        "steps_lost": max(0, max(reached, before.step) - after[0]["started_at"]) if after else None,
        "failures_charged": box["result"].failures,
        "hang_timeout_s": args.hang_timeout if kind == "hang" else None,
        "steps_seen_before_restart": last_seen,
    }


def ray_train_case(kind: str, args: argparse.Namespace, root: Path) -> dict:
    """The same loop shape under Ray Train v2's TorchTrainer (DDP, CPU), same fault, same clock."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import ray.train
    from ray.train.torch import TorchTrainer

    pids = root / f"rt-{kind}-pids"
    pids.mkdir()
    hang_flag = root / f"rt-{kind}-hang"
    times = root / f"rt-{kind}-times"
    times.mkdir()

    def loop(config: dict) -> None:
        import tempfile as temp

        import torch

        context = ray.train.get_context()
        model, inputs, targets = _model_and_data()
        model = ray.train.torch.prepare_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        step = 0
        checkpoint = ray.train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as directory:
                state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
                model.load_state_dict(state["model"])
                step = state["step"]
        started_at = step
        attempt = len(list(Path(config["pids"]).glob(f"rank{context.get_world_rank()}.*")))
        Path(config["pids"], f"rank{context.get_world_rank()}.attempt{attempt}").write_text(str(os.getpid()))
        Path(config["pids"], f"node{context.get_world_rank()}.attempt{attempt}").write_text(
            ray.get_runtime_context().get_node_id())
        while step < STEPS:
            index = torch.randint(0, 512, (8,), generator=torch.Generator().manual_seed(step * 7 + context.get_world_rank()))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs[index]), targets[index]).backward()
            optimizer.step()
            step += 1
            Path(config["times"], f"{attempt}.{step}.{started_at}").write_text(str(time.time()))
            if step % config["save_every"] == 0:
                with temp.TemporaryDirectory() as directory:
                    if context.get_world_rank() == 0:
                        torch.save({"model": model.state_dict(), "step": step}, os.path.join(directory, "state.pt"))
                    ray.train.report({"step": step},
                                     checkpoint=ray.train.Checkpoint.from_directory(directory)
                                     if context.get_world_rank() == 0 else None)
            if config.get("hang") and context.get_world_rank() == 1 and attempt == 0 and Path(config["hang"]).exists():
                time.sleep(3600)
            time.sleep(config["sleep"])

    trainer = TorchTrainer(
        loop, train_loop_config={"pids": str(pids), "times": str(times), "save_every": args.save_every,
                                 "sleep": args.sleep, "hang": str(hang_flag) if kind == "hang" else None},
        scaling_config=ray.train.ScalingConfig(num_workers=2,
                                               placement_strategy="SPREAD" if kind == "node" else "PACK"),
        run_config=ray.train.RunConfig(name=f"rt-{kind}", storage_path=str(root / "ray-train"),
                                       failure_config=ray.train.FailureConfig(max_failures=2)))
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=_try(trainer.fit)), daemon=True)
    thread.start()
    _wait(pids / "rank1.attempt0", 180)
    while len(list(times.glob("0.*"))) < args.warmup_steps:
        time.sleep(0.05)
    fault_at = time.time()
    reached = max(int(p.name.split(".")[1]) for p in times.glob("0.*"))
    node_file = pids / "node1.attempt0"
    _inject(kind, pids, hang_flag, node_file.read_text() if node_file.exists() else None)
    deadline = time.time() + args.ray_train_wait_s
    while not list(times.glob("1.*")) and time.time() < deadline:
        time.sleep(0.05)
    after = sorted((float(p.read_text()), int(p.name.split(".")[1]), int(p.name.split(".")[2]))
                   for p in times.glob("1.*"))
    import ray as ray_core

    ray_core.shutdown()  # ends the trainer (its controller and workers) whatever state it is in
    if not after:
        return {"kind": kind, "system": "ray-train-v2", "first_step_s": None,
                "note": f"no step after the fault within {args.ray_train_wait_s:g}s"}
    first_time, _, started_at = after[0]
    return {"kind": kind, "system": "ray-train-v2", "detect_s": None,
            "first_step_s": round(first_time - fault_at, 3), "steps_lost": max(0, reached - started_at)}


def _try(function):
    try:
        return function()
    except BaseException as error:  # noqa: BLE001 - the case is measured from outside
        return error


@contextlib.contextmanager
def _ray_for(kind: str):
    """A local Ray, or for `node` a Cluster: a head without CPUs (driver, controllers) and 3 1-CPU nodes."""
    global _CLUSTER
    import ray

    if kind != "node":
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        try:
            yield
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    _CLUSTER = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(3):
            _CLUSTER.add_node(num_cpus=1)
        _CLUSTER.wait_for_nodes()
        ray.init(address=_CLUSTER.address, logging_level="ERROR")
        yield
    finally:
        ray.shutdown()
        _CLUSTER.shutdown()
        _CLUSTER = None


def summarize(results: list[dict]) -> list[dict]:
    """Median, min and max of each figure per (system, kind) over the rounds."""
    summary = []
    for system, kind in sorted({(r["system"], r["kind"]) for r in results}):
        rows = [r for r in results if (r["system"], r["kind"]) == (system, kind)]
        entry: dict = {"system": system, "kind": kind, "rounds": len(rows)}
        for key in ("detect_s", "first_step_s", "steps_lost"):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if values:
                entry[key] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
        failed = [r.get("note") or r.get("error") for r in rows if r.get("first_step_s") is None]
        if failed:
            entry["no_recovery"] = f"{len(failed)} of {len(rows)}: {failed[0]}"
        summary.append(entry)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="kill,hang,sigterm,resize,node")
    parser.add_argument("--ray-train", action="store_true", help="also measure Ray Train v2 on every kind but resize")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case, interleaved")
    parser.add_argument("--ray-train-hang-rounds", type=int, default=1,
                        help="Ray Train's hang case waits --ray-train-wait-s for nothing each round")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds between steps (stands for compute)")
    parser.add_argument("--warmup-steps", type=int, default=15)
    parser.add_argument("--after-s", type=float, default=2.0, help="training after the recovery before stopping")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--ray-train-wait-s", type=float, default=120.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    results = []
    kinds = args.kinds.split(",")
    for round_index in range(args.rounds):
        for kind in kinds:
            cases = [("rayzero", rayzero_case)]
            if args.ray_train and kind != "resize" and (kind != "hang" or round_index < args.ray_train_hang_rounds):
                cases.append(("ray-train-v2", ray_train_case))
            for system, case in cases:
                with tempfile.TemporaryDirectory() as tmp, _ray_for(kind):
                    result = dict(case(kind, args, Path(tmp)), round=round_index)
                results.append(result)
                print(json.dumps(result), file=sys.stderr, flush=True)
    out = {"benchmark": "recovery", "machine": f"{os.cpu_count()} CPUs, local Ray, 2 workers",
           "args": {k: v for k, v in vars(args).items() if k != "json"},
           "summary": summarize(results), "results": results}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
