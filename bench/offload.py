"""Offload benchmarks (issue 9), side by side in one run, printed as JSON:

    python bench/offload.py [--quick] [--sections cpu_step,swap,step,overlap,rss] [--json out.json]

- `cpu_step`: the optimizer step on the CPU — rayzero's (the CPU backend stepping torch's fused AdamW,
  as the engine builds it), DeepSpeed's `DeepSpeedCPUAdam` (JIT-built once, ~1 min), torch fused,
  foreach and for-loop AdamW: same elements, same threads; parameters/s and GB/s of state touched
  (AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 B/element),
  with a STREAM-like triad of the same run for context.
- `swap`: rayzero's swap files (swap_io: thread-pooled pread/pwrite on O_DIRECT) against
  `dd iflag/oflag=direct` on the same filesystem, read and write GB/s.
- `step`: step time of one model at stages 1-3 with offload none / cpu / nvme, rayzero against
  DeepSpeed's same config (2 gloo ranks; DeepSpeed has no NVMe offload below stage 3).
- `overlap`: CPU offload at stages 1-2 with the optimizer step overlapped with backward (bucket by
  bucket, [Note: step overlapped with backward]) against the same step after backward
  (RAYZERO_OFFLOAD_OVERLAP_STEP=0) and DeepSpeed's CPU offload; the share of the CPU step hidden.
- `rss`: peak process RSS of one rank with NVMe optimizer offload against CPU offload and none; the
  saving as a fraction of the optimizer-state bytes.
Every figure is the median of `--rounds` rounds with min and max beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench` as a package

from bench import report


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


# ---- cpu_step ------------------------------------------------------------------------------------
def _adamw_step_timer(kind: str, numel: int):
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    if kind == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        return optimizer.step
    if kind == "rayzero":
        from types import SimpleNamespace

        from rayzero.engine.offload.host import HostOffload

        zero = SimpleNamespace(offload_optimizer=SimpleNamespace(pin_memory=False, ratio=1.0), offload_param=None,
                               offload_optimizer_device="cpu", offload_param_device="none")
        backend = HostOffload(SimpleNamespace(zero_optimization=zero), "cpu")
        optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **backend.fused_optimizer_kwargs())
        return lambda: backend.step(optimizer)
    flags = {"torch_fused": {"fused": True}, "torch_foreach": {"foreach": True},
             "torch_for_loop": {"foreach": False, "fused": False}}[kind]
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **flags)
    return optimizer.step


def bench_cpu_step(numel: int, threads: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"elements": numel, "threads": threads}
    steps = {}
    for kind in ("rayzero", "deepspeed_cpu_adam", "torch_fused", "torch_foreach", "torch_for_loop"):
        try:
            steps[kind] = _adamw_step_timer(kind, numel)
        except Exception as error:  # noqa: BLE001 - a system that cannot run here gets an error row
            out[kind] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        steps[kind]()  # state allocation and first-touch are not part of the steady step
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(rounds):  # interleaved: drifts of clock and memory hit every system alike
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - start)
    for kind, values in times.items():
        seconds = statistics.median(values)
        out[kind] = {"seconds": _spread(values), "params_per_s": numel / seconds, "gb_per_s": 28 * numel / seconds / 1e9}
    a, b, c = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    triad = []
    for _ in range(rounds):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        triad.append(time.perf_counter() - start)
    out["stream_triad_gb_per_s"] = 12 * numel / statistics.median(triad) / 1e9
    ds = out.get("deepspeed_cpu_adam", {}).get("params_per_s")
    if ds:
        out["ratio_rayzero_vs_deepspeed"] = out["rayzero"]["params_per_s"] / ds
        out["ratio_torch_fused_vs_deepspeed"] = out["torch_fused"]["params_per_s"] / ds
    return out


# ---- swap ------------------------------------------------------------------------------------------
def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def bench_swap(directory: str, mib: int, rounds: int) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from rayzero.engine.offload.swap_io import AlignedBuffer, IOKnobs, SwapFile, io_layer_name

    nbytes = mib << 20
    os.makedirs(directory, exist_ok=True)
    knobs = IOKnobs()  # DeepSpeed's aio defaults: block 1 MiB, queue depth 8, 1 thread
    buffer = AlignedBuffer(nbytes)
    buffer.view(0, nbytes // 4, torch.float32).copy_(torch.randn(nbytes // 4))
    results: dict[str, list[float]] = {"rayzero_write": [], "rayzero_read": [], "dd_write": [], "dd_read": []}
    with ThreadPoolExecutor(knobs.in_flight) as pool:
        swap = SwapFile(os.path.join(directory, "bench.swp"), pool, knobs)
        dd_file = os.path.join(directory, "dd.bin")
        for _ in range(rounds):  # interleaved, so drifts of the disk hit both sides alike
            start = time.perf_counter()
            swap.write(buffer, nbytes)
            os.fsync(swap.fd)
            results["rayzero_write"].append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            swap.read(buffer, nbytes)
            results["rayzero_read"].append(nbytes / (time.perf_counter() - start) / 1e9)
            seconds = _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
            results["dd_write"].append(nbytes / seconds / 1e9)
            seconds = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M", "iflag=direct"])
            results["dd_read"].append(nbytes / seconds / 1e9)
        layer = io_layer_name(swap.direct)
        swap.close()
    os.unlink(dd_file)
    buffer.close()
    out: dict[str, Any] = {"bytes": nbytes, "io_layer": layer, "knobs": knobs.__dict__}
    out.update({key: _spread(values) for key, values in results.items()})
    for kind in ("write", "read"):
        out[f"ratio_{kind}_vs_dd"] = out[f"rayzero_{kind}"]["median"] / out[f"dd_{kind}"]["median"]
    return out


# ---- step ------------------------------------------------------------------------------------------
def _config(stage: int, offload: str, nvme: str, width: int) -> dict[str, Any]:
    """`offload`: none / cpu / nvme (optimizer state) / nvme-params (optimizer state and, at
    stage 3, parameter shards on NVMe, max_in_cpu 0: every shard read from disk for each gather)."""
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload.split("-")[0], "nvme_path": nvme, "pipeline_read": True,
                                     "pipeline_write": True}
        zero["sub_group_size"] = width * width
    if offload == "nvme-params":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0,
                                 "buffer_count": 5, "buffer_size": width * width}
    return {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1_000_000}


def _step_worker(rank: int, job: dict[str, Any], port: int, out: str) -> None:
    import collections

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2",
                      RAYZERO_OFFLOAD_OVERLAP_STEP="0" if job.get("after_backward") else "1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    width = job["width"]
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    config = _config(job["stage"], job["offload"], f"{job['nvme']}/{job['system']}", width)
    if job.get("bucket"):  # the same reduce bucket for both systems: one per layer
        config["zero_optimization"]["reduce_bucket_size"] = job["bucket"]
    if job["system"] == "deepspeed":
        import deepspeed
        import deepspeed.ops

        if not job["offload"].startswith("nvme"):  # NVMe needs DeepSpeed's async_io op (libaio, JIT-built)
            deepspeed.ops.__dict__.setdefault("__compatible_ops__", collections.defaultdict(bool))
        else:
            config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        import rayzero

        engine, *_ = rayzero.initialize(model=model, config=config)
    times = []
    for step in range(job["warmup"] + job["steps"]):
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(step * 2 + rank))
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if step >= job["warmup"]:
            times.append(float(elapsed))
    if rank == 0:
        row: dict[str, Any] = {"seconds": _spread(times)}
        if job["system"] == "rayzero":
            row["breakdown"] = engine.offload_breakdown()
        Path(out).write_text(json.dumps(row))
    torch.distributed.destroy_process_group()


def _run_step_job(job: dict[str, Any], scratch: str, timeout_s: float) -> dict[str, Any]:
    """Run `_step_worker` on 2 gloo ranks in fresh processes; rank 0's row or an error."""
    from rayzero.ports import server_port

    port = server_port()  # MASTER_PORT: [Note: ports below the ephemeral range]
    out = os.path.join(scratch, f"{job['system']}-{job['stage']}-{job['offload']}-{time.monotonic_ns()}.json")
    code = ("import sys, json; sys.path.insert(0, %r); import offload as b; "
            "b._step_worker(int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])"
            % str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), json.dumps(job), str(port), out],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errors = [p.communicate(timeout=timeout_s)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errors = ["timed out"]
    if os.path.exists(out):
        return json.loads(Path(out).read_text())
    return {"error": (errors[0] or "no result").strip().splitlines()[-1][:300]}


def bench_overlap(width: int, warmup: int, steps: int, scratch: str, rounds: int) -> list[dict[str, Any]]:
    """CPU offload at stages 1-2: the step overlapped with backward against the same step after
    backward and DeepSpeed's CPU offload, rounds interleaved; the share of the CPU step hidden.
    reduce_bucket_size is one layer for every system (with DeepSpeed's default of 5e8 elements a
    model this small is one bucket, which completes only when backward does: nothing to overlap)."""
    rows = []
    for stage in (1, 2):
        variants = {"rayzero_overlapped": ("rayzero", False), "rayzero_after_backward": ("rayzero", True),
                    "deepspeed": ("deepspeed", False)}
        per: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (system, after) in variants.items():
                job = {"system": system, "stage": stage, "offload": "cpu", "width": width, "warmup": warmup,
                       "steps": steps, "nvme": os.path.join(scratch, "nvme"), "after_backward": after,
                       "bucket": width * width}
                per[name].append(_run_step_job(job, scratch, 600))
        row: dict[str, Any] = {"stage": stage, "offload": "cpu", "width": width}
        for name, results in per.items():
            ok = [r for r in results if "seconds" in r]
            if not ok:
                row[name] = {"error": results[0].get("error")}
                continue
            row[name] = {"step_seconds": _spread([r["seconds"]["median"] for r in ok])}
            if name.startswith("rayzero"):
                row[name]["cpu_step_seconds"] = _spread([r["breakdown"].get("cpu_step", 0.0) for r in ok])
                exposed = [r["breakdown"]["cpu_step_exposed"] for r in ok if "cpu_step_exposed" in r["breakdown"]]
                if exposed:
                    row[name]["cpu_step_exposed_seconds"] = _spread(exposed)
                    row[name]["hidden_share"] = 1 - statistics.median(exposed) / statistics.median(
                        [r["breakdown"]["cpu_step"] for r in ok])
        medians = {n: row[n]["step_seconds"]["median"] for n in variants if "step_seconds" in row[n]}
        if {"rayzero_overlapped", "rayzero_after_backward"} <= medians.keys():
            row["ratio_overlapped_vs_after_backward"] = medians["rayzero_overlapped"] / medians["rayzero_after_backward"]
        if {"rayzero_overlapped", "deepspeed"} <= medians.keys():
            row["ratio_overlapped_vs_deepspeed"] = medians["rayzero_overlapped"] / medians["deepspeed"]
        rows.append(row)
    return rows


def bench_step(width: int, warmup: int, steps: int, scratch: str, timeout_s: float,
               rounds: int = 1) -> list[dict[str, Any]]:
    """Every (stage, offload, system) once per round, rounds interleaved; a row's `seconds` spreads
    over its rounds' medians, `ratio_step_time_vs_deepspeed` is the ratio of those medians, and
    `ratio_per_round` each round's own."""
    combos = []
    for stage in (1, 2, 3):
        for offload in ("none", "cpu", "nvme") + (("nvme-params",) if stage == 3 else ()):
            combos += [(system, stage, offload) for system in ("rayzero", "deepspeed")]
    results: dict[tuple, list[dict[str, Any]]] = {combo: [] for combo in combos}
    for _ in range(rounds):
        for system, stage, offload in combos:
            if system == "deepspeed" and offload == "nvme" and stage < 3:
                continue
            job = {"system": system, "stage": stage, "offload": offload, "width": width, "warmup": warmup,
                   "steps": steps, "nvme": os.path.join(scratch, "nvme")}
            results[(system, stage, offload)].append(_run_step_job(job, scratch, timeout_s))
    rows = []
    for (system, stage, offload), runs in results.items():
        row: dict[str, Any] = {"system": system, "stage": stage, "offload": offload}
        if system == "deepspeed" and offload == "nvme" and stage < 3:
            row["error"] = "DeepSpeed 0.19.8 offers NVMe optimizer offload at stage 3 only"
        ok = [run for run in runs if "seconds" in run]
        if ok:
            row["seconds"] = _spread([run["seconds"]["median"] for run in ok])
            if "breakdown" in ok[-1]:
                row["breakdown"] = ok[-1]["breakdown"]
        errors = [run["error"] for run in runs if "error" in run]
        if errors:
            row["error"] = errors[0]
        rows.append(row)
    index = {(r["system"], r["stage"], r["offload"]): r for r in rows}
    for (system, stage, offload), row in index.items():
        other = index.get(("deepspeed", stage, offload))
        if system == "rayzero" and other and "seconds" in row and "seconds" in other:
            row["ratio_step_time_vs_deepspeed"] = row["seconds"]["median"] / other["seconds"]["median"]
            pairs = zip(results[(system, stage, offload)], results[("deepspeed", stage, offload)])
            row["ratio_per_round"] = [mine["seconds"]["median"] / theirs["seconds"]["median"]
                                      for mine, theirs in pairs if "seconds" in mine and "seconds" in theirs]
    return rows


# ---- rss -------------------------------------------------------------------------------------------
def _rss_worker(offload: str, numel_side: int, nvme: str) -> None:
    import rayzero

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(numel_side, numel_side, bias=False))
    zero: dict[str, Any] = {"stage": 1}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme, "pipeline_read": True, "pipeline_write": True}
        zero["sub_group_size"] = numel_side * numel_side // 16
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = rayzero.initialize(model=model, config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, numel_side)).pow(2).mean())
        engine.step()
    stats = engine.memory_stats()
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "optimizer_state_bytes": stats["optimizer_state"], "nvme_bytes": stats["nvme_bytes"]}))
    engine.close()


def bench_rss(side: int, scratch: str, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"params": side * side}
    code = "import sys; sys.path.insert(0, %r); import offload as b; b._rss_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])"
    runs: dict[str, list[dict]] = {"none": [], "cpu": [], "nvme": []}
    for _ in range(rounds):
        for offload in runs:
            done = subprocess.run([sys.executable, "-c", code % str(Path(__file__).parent), offload, str(side),
                                   os.path.join(scratch, "rss-nvme")], capture_output=True, text=True, check=True)
            runs[offload].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for offload, values in runs.items():
        out[offload] = {"peak_rss": _spread([v["peak_rss"] for v in values]),
                        "optimizer_state_bytes": values[0]["optimizer_state_bytes"], "nvme_bytes": values[0]["nvme_bytes"]}
    # Against CPU offload: both keep fp32 masters apart from the parameters (on a GPU those would
    # be host bytes either way); what differs is only where the optimizer state lives. Against
    # `none` on a CPU-only machine the masters alias the parameters, so offload adds them back.
    for base in ("cpu", "none"):
        saved = out[base]["peak_rss"]["median"] - out["nvme"]["peak_rss"]["median"]
        out[f"rss_saved_vs_{base}_bytes"] = saved
        out[f"saved_vs_{base}_fraction_of_optimizer_state"] = saved / out["none"]["optimizer_state_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="cpu_step,swap,step,overlap,rss")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--scratch", default=None, help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    scratch = args.scratch or tempfile.mkdtemp(prefix="rayzero-bench-offload-")
    for name in ("nvme", "rss-nvme"):  # nvme_path must exist: rayzero does not create it
        os.makedirs(os.path.join(scratch, name), exist_ok=True)
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "rounds": rounds}
    try:
        if "cpu_step" in sections:
            result["cpu_step"] = bench_cpu_step(5_000_000 if args.quick else 20_000_000, args.threads, rounds)
        if "swap" in sections:
            result["swap"] = bench_swap(os.path.join(scratch, "swap"), 256 if args.quick else 1024, rounds)
        if "step" in sections:
            result["step"] = bench_step(256 if args.quick else 1024, 2 if args.quick else 3,
                                        5 if args.quick else 10, scratch, 600, rounds)
        if "overlap" in sections:
            result["overlap"] = bench_overlap(512 if args.quick else 1024, 2 if args.quick else 3,
                                              5 if args.quick else 10, scratch, rounds)
        if "rss" in sections:
            result["rss"] = bench_rss(6144 if args.quick else 8192, scratch, max(1, rounds // 2))
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    report.emit(result, args.json_path)


if __name__ == "__main__":
    main()
