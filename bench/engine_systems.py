"""What runs inside each spawned rank of bench/engine.py: one system, every model, timed the same way.

Every system gets the same model (bench/models.py, fixed seed), the same per-rank batches, the same
optimizer — one torch Adam object (lr 1e-3, no weight decay, no clipping) built the same way for
every system and handed to DeepSpeed and rayzero as their client optimizer, so the same kernel runs
everywhere (`optimizer_impl`: torch's fused CPU kernel, or its default for-loop) — and the same
timing loop: a barrier, then
forward + backward + optimizer step under one clock; per step the slowest rank's time counts, and the
median over the measured steps is reported. Batches are built before timing, so data generation is not
in the figure.

A system that raises on every rank records an `error` for that model and the rank moves on; a rank that
hangs is bounded by the process-group timeout and by the parent's deadline (bench/engine.py).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from bench import models

LEARNING_RATE = 1e-3
# One step: (inputs, targets) -> loss tensor, after backward and optimizer step.
StepFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def deepspeed_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config given unchanged to both DeepSpeed and rayzero for stage `stage`.

    - torch Adam (`torch_adam`), in Adam rather than AdamW mode: DeepSpeed's "Adam" silently means
      AdamW unless `adam_w_mode` is false, and its fused/CPU Adam would compile for ~55 s here.
    - `gradient_clipping: 0.0`: DeepSpeed 0.19.8 otherwise clips at 1.0, which DDP/FSDP2 do not.
    - `stage3_param_persistence_threshold: 0`: every parameter is partitioned under stage 3, like
      FSDP2 and like the ZeRO paper's (4+K)Ψ/N; DeepSpeed's default (1e5 elements) would keep most of
      these small models' parameters whole on every rank.
    - `stage3_max_reuse_distance: 0`: parameters are released after use in forward and gathered again
      in backward, as FSDP2 does by default (reshard_after_forward) and as the paper's 3Ψ assumes;
      DeepSpeed's default (1e9) keeps every gathered parameter of a model this small until backward.
    - everything else at DeepSpeed's defaults (bucket sizes, overlap_comm, contiguous_gradients).
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LEARNING_RATE,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "torch_adam": True,
                "adam_w_mode": False,
            },
        },
        "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


OPTIMIZER_IMPLS = {"fused": {"fused": True}, "for-loop": {"fused": False, "foreach": False}}
"""torch Adam implementations the bench can give every system (`--optimizer-impl`)."""

# DeepSpeed's default reduce bucket (5e8 elements), which rayzero shares: DDP's like-for-like bucket cap.
REDUCE_BUCKET_ELEMENTS = 500_000_000


def _torch_optimizer(parameters, impl: str, extra: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """The client optimizer every system gets, in implementation `impl`: the config's optimizer
    section read as torch would run it, `extra`'s if it has one (`"type": "AdamW"` -> torch's AdamW,
    bench/gpu_transformers.py), else deepspeed_config's torch Adam."""
    section = (extra or {}).get("optimizer") or deepspeed_config(0, 0)["optimizer"]
    kind = torch.optim.AdamW if section["type"].lower() == "adamw" else torch.optim.Adam
    params = section["params"]
    return kind(parameters, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                weight_decay=params["weight_decay"], **OPTIMIZER_IMPLS[impl])


def _bf16(extra: dict[str, Any] | None) -> bool:
    return bool((extra or {}).get("bf16", {}).get("enabled"))


def _without_optimizer(config: dict[str, Any]) -> dict[str, Any]:
    """The config for an engine given the client optimizer: everything but the optimizer section."""
    return {key: value for key, value in config.items() if key != "optimizer"}


def engine_config(stage: int, micro_batch: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    """`deepspeed_config` with `extra` on top (its `zero_optimization` merged key by key), less the
    optimizer section: the config both DeepSpeed and rayzero get beside the client optimizer."""
    config = deepspeed_config(stage, micro_batch)
    for key, value in (extra or {}).items():
        config[key] = {**config[key], **value} if key == "zero_optimization" else value
    return _without_optimizer(config)


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor -> own shard
    return local.numel() * local.element_size()


def _torch_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (DDP / FSDP2).

    Measured while gradients are still held (after backward, before zero_grad). Master weights are
    the fp32 parameters themselves in fp32 training, so they are not counted twice.
    """
    parameters = sum(_tensor_bytes(p) for p in model.parameters())
    gradients = sum(_tensor_bytes(p.grad) for p in model.parameters())
    optimizer_state = sum(
        _tensor_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1  # skip the scalar `step` counters
    )
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state}


class _Run:
    """One system training one model on this rank: the timed `step`, then one untimed `probe` step
    that returns the extra row fields (memory breakdown, communication counts)."""

    def __init__(self, step: StepFunction, probe: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]) -> None:
        self.step = step
        self.probe = probe


def _torch_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, counted: torch.nn.Module) -> _Run:
    """DDP and FSDP2 share one loop; the probe counts model state while gradients are still held."""

    def train(inputs: torch.Tensor, targets: torch.Tensor, probe: bool) -> Any:
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        state = _torch_model_state(counted, optimizer) if probe else None
        optimizer.zero_grad(set_to_none=True)
        return {"memory_breakdown": state} if probe else loss

    return _Run(lambda inputs, targets: train(inputs, targets, False),
                lambda inputs, targets: train(inputs, targets, True))


def _build_ddp(model: torch.nn.Module, world_size: int, stage: int, micro_batch: int, impl: str,
                 extra: dict[str, Any] | None = None) -> _Run:
    """Like for like with rayzero's stage 0: DDP's bucket cap set to the same bytes as the reduce
    bucket (fp32), its 1 MiB first bucket as it comes (stage 0 has one of the same size)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, bucket_cap_mb=REDUCE_BUCKET_ELEMENTS * 4 / 2**20,
                                      device_ids=_device_ids(model))
    return _torch_run(wrapped, _torch_optimizer(wrapped.parameters(), impl, extra), model)


def _build_ddp_default(model: torch.nn.Module, world_size: int, stage: int, micro_batch: int, impl: str,
                 extra: dict[str, Any] | None = None) -> _Run:
    """DDP as it comes (25 MiB buckets), reported beside the like-for-like row."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, device_ids=_device_ids(model))
    return _torch_run(wrapped, _torch_optimizer(wrapped.parameters(), impl, extra), model)


def _build_fsdp2(model: torch.nn.Module, world_size: int, stage: int, micro_batch: int, impl: str,
                 extra: dict[str, Any] | None = None) -> _Run:
    """Each sharding unit, then the root. With `"bf16": {"enabled": true}` in the config the others
    get, FSDP2's mixed precision as its users write it: bf16 compute, fp32 gradient reduction (the
    sharded parameters and the optimizer stay fp32, as DeepSpeed's and rayzero's masters do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if _bf16(extra) \
        else MixedPrecisionPolicy()
    mesh = init_device_mesh(_device_of(model).type, (world_size,))
    for unit in models.sharding_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return _torch_run(model, _torch_optimizer(model.parameters(), impl, extra), model)


def _build_deepspeed(model: torch.nn.Module, world_size: int, stage: int, micro_batch: int, impl: str,
                 extra: dict[str, Any] | None = None) -> _Run:
    import collections

    import deepspeed
    import deepspeed.ops

    # DeepSpeed probes every native op (compiler subprocesses, seconds) on first use of its comm
    # backend and then JIT-compiles its shared-memory all-reduce (~40 s here). That op serves only
    # `inference_all_reduce`; training collectives go through torch.distributed (gloo) either way, and
    # with `torch_adam` no other op is needed. Marking the ops unavailable skips both, so the benchmark
    # does not depend on a compile cache; it changes no collective DeepSpeed's training step makes.
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", collections.defaultdict(bool))

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=_torch_optimizer(model.parameters(), impl, extra),
        config=engine_config(stage, micro_batch, extra),
    )

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return _Run(step, lambda inputs, targets: (step(inputs, targets), {})[1])


def _build_rayzero(model: torch.nn.Module, world_size: int, stage: int, micro_batch: int, impl: str,
                 extra: dict[str, Any] | None = None) -> _Run:
    import rayzero

    engine, _, _, _ = rayzero.initialize(model=model, optimizer=_torch_optimizer(model.parameters(), impl, extra),
                                         config=engine_config(stage, micro_batch, extra))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss

    def probe(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        # Gradients are held between backward and step, optimizer state after step: read both and
        # keep the larger figure per kind, so no kind is missed whichever the engine frees when.
        loss = engine(inputs, targets)
        engine.backward(loss)
        before = engine.memory_stats()
        engine.step()
        after = engine.memory_stats()
        kinds = ("params", "grads", "master_weights", "optimizer_state")
        return {
            "memory_breakdown": {kind: max(before.get(kind, 0), after.get(kind, 0)) for kind in kinds},
            "memory_stats": _plain(after),
            # Fixed-size reduce/gather buckets: not model state, stated beside it (issue's target).
            "bucket_buffer_bytes": int(after.get("bucket_buffers", 0)),
            "comm_stats": _plain(engine.comm_stats()),
            "offload_breakdown": _plain(engine.offload_breakdown()),
        }

    return _Run(step, probe)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _device_ids(model: torch.nn.Module) -> list[int] | None:
    """DDP's device_ids: the model's one CUDA device, none on the CPU."""
    device = _device_of(model)
    return [device.index] if device.type == "cuda" else None


BUILDERS = {"ddp": _build_ddp, "ddp-default": _build_ddp_default, "fsdp2": _build_fsdp2,
            "deepspeed": _build_deepspeed, "rayzero": _build_rayzero}


def _plain(value: Any) -> Any:
    """JSON-ready copy of a stats object (dict, dataclass or pydantic model; tensors become numbers)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    elif hasattr(value, "__dataclass_fields__"):
        import dataclasses

        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return value.value
    return value


def _measure(run: _Run, model_name: str, quick: bool | str, rank: int, warmup: int, steps: int,
             device: torch.device | None = None) -> dict[str, Any]:
    """Per-step wall and CPU time of `run`; on a GPU the clock stops once the device is idle."""
    device = device or torch.device("cpu")
    batches = [tuple(t.to(device) for t in models.batch(model_name, quick, step, rank))
               for step in range(warmup + steps)]
    step_times, cpu_times, losses = [], [], []
    for index, (inputs, targets) in enumerate(batches):
        dist.barrier()  # start every rank's step together, so the slowest rank's time is the step's
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = run.step(inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        losses.append(float(loss.detach()))
        if index >= warmup:
            step_times.append(elapsed)
            cpu_times.append(cpu)
    # One collective after the loop (not inside it): the slowest rank per step, the mean loss.
    times = _all_reduce(torch.tensor([step_times, cpu_times], dtype=torch.float64), dist.ReduceOp.MAX)
    mean_losses = _all_reduce(torch.tensor(losses, dtype=torch.float64), dist.ReduceOp.SUM)
    mean_losses /= dist.get_world_size()
    wall, cpu = times.tolist()
    return {
        "step_time_median_s": statistics.median(wall),
        "step_time_min_s": min(wall),
        # CPU seconds the rank's process (all its threads, gloo's included) spent per step: barely
        # moved by other processes competing for the cores, but blind to time saved by overlap.
        "step_cpu_time_median_s": statistics.median(cpu),
        "step_times_s": [round(t, 6) for t in wall],
        "losses": [round(x, 7) for x in mean_losses.tolist()],
    }


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """`tensor` all-reduced, on the CPU: NCCL reduces only CUDA tensors, so it travels there and back."""
    if dist.get_backend() == "nccl":
        on_device = tensor.cuda()
        dist.all_reduce(on_device, op=op)
        return on_device.cpu()
    dist.all_reduce(tensor, op=op)
    return tensor


def _max_over_ranks(value: int) -> int:
    return int(_all_reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MAX).item())


def worker(rank: int, job: dict[str, Any], port: int, result_path: str) -> None:
    """Entry point of one spawned rank: run each of `job["systems"]` on each model, rank 0 writes the rows."""
    world_size = job["world_size"]
    # DeepSpeed and gloo log a lot; keep it per rank in the scratch folder, quoted in error rows.
    log = os.open(os.path.join(job["log_directory"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    device = _rank_device(job, rank)
    if device.type == "cpu":
        # One thread per rank: 2 ranks on the 2 cores, and no system gets more threads than another.
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=job["collective_timeout_s"]),
    )
    rows: list[dict[str, Any]] = []
    for variant in variants(job):
        for model_name in variant.get("models", job["models"]):
            rows.append(_run_one(variant, model_name, job, rank, device))
            if len(job["systems"]) > 1:
                rows[-1]["peak_rss_bytes"] = None  # cumulative over the systems this process ran
            if rank == 0:  # written after every row, so a later hang keeps the finished rows
                with open(result_path, "w") as handle:
                    json.dump(rows, handle)
            gc.collect()  # engines hold reference cycles: free this row's device memory before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()


def variants(job: dict[str, Any]) -> list[dict[str, Any]]:
    """What one job runs, in order: `job["variants"]` ({label, system, extra, env, models}: one system
    with config keys on top of the shared DeepSpeed config and environment variables set while it is
    built) or, plainly, `job["systems"]`. A row's `system` is the variant's label."""
    return job.get("variants") or [{"label": system, "system": system} for system in job["systems"]]


def _rank_device(job: dict[str, Any], rank: int) -> torch.device:
    """The rank's compute device: its own GPU with `job["device"] == "cuda"` (TF32 off, so fp32 means
    fp32 for every system), else the CPU."""
    if job.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", rank)


def _run_one(variant: dict[str, Any], model_name: str, job: dict[str, Any], rank: int,
             device: torch.device) -> dict[str, Any]:
    """Build the variant's system around a fresh `model_name`, time it, probe it: one row (or its error)."""
    family, _, stage_text = variant["system"].partition("-stage")
    world_size = dist.get_world_size()
    row: dict[str, Any] = {"system": variant["label"], "world_size": world_size, "model": model_name}
    held_before = 0
    if device.type == "cuda":
        # An earlier row's engine may still hold memory (DeepSpeed 0.19.8's engines at stages 1-3
        # outlive their owner, checked on CPU with weak references): the peak counts from what this
        # row found allocated before its model was built, so the model's own bytes are in it.
        held_before = torch.cuda.memory_allocated(device)
        row["gpu_memory_held_before_bytes"] = held_before
        torch.cuda.reset_peak_memory_stats(device)
    model = models.build_model(model_name, job["quick"], device).to(device)
    row["trainable_parameters"] = models.trainable_parameters(model)
    started = time.perf_counter()
    failed = 0
    try:
        with mock.patch.dict(os.environ, variant.get("env", {})):  # restored as it was, whatever happens
            run = BUILDERS[family](model, world_size, int(stage_text or 0),
                                   _micro_batch(model_name, job["quick"]), job.get("optimizer_impl", "fused"),
                                   variant.get("extra"))
            row["setup_s"] = round(time.perf_counter() - started, 3)
            row.update(_measure(run, model_name, job["quick"], rank, job["warmup"], job["steps"], device))
            probe_batch = models.batch(model_name, job["quick"], job["warmup"] + job["steps"], rank)
            row.update(run.probe(*(t.to(device) for t in probe_batch)))
            breakdown = row.get("memory_breakdown")
            if breakdown:
                # Ranks hold unequal shards when sizes do not divide evenly: report the largest.
                row["model_state_bytes_per_rank"] = _max_over_ranks(sum(breakdown.values()))
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - held_before
                row["peak_gpu_memory_bytes"] = _max_over_ranks(peak)
    except Exception as error:  # noqa: BLE001 - a failing system is a row, not a crashed benchmark
        failed = 1
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
    # A rank whose peers all failed symmetrically can go on with the next row; if only some failed,
    # this collective pairs with a peer's pending one, and the timeouts bound the damage.
    if _max_over_ranks(failed) and "error" not in row:
        row["error"] = "another rank raised (see its error); this rank's figures are discarded"
    row["peak_rss_bytes"] = _max_over_ranks(_peak_rss_bytes())
    return row


def _micro_batch(model_name: str, quick: bool | str) -> int:
    return models.spec(model_name, quick).batch_per_rank
