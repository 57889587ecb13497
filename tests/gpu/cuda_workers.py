"""Rank code for the CUDA engine tests (tests/gpu/test_cuda_engine.py).

Reuses the parity model, cases and data of tests/testkit/harness.py; what differs on a GPU is the
process group (NCCL, from the usual env variables through `rayzero.init_distributed`), the device
of the batches and the reference (single-process fp32 torch on the same CUDA device, TF32 off so
"fp32" means fp32). The rank code only uses `compute_device()`, so it also runs on CPU with gloo,
which is how it was checked on a machine without a GPU (`PYTHONPATH=tests python tests/gpu/cuda_workers.py`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from testkit import harness as H  # the parity model, cases and data of tests/dist

FP16_EXTRA = (("fp16", {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "hysteresis": 1,
                        "loss_scale_window": 1000, "min_loss_scale": 1}),)
"""Dynamic loss scaling starting at 2^18: the first steps overflow fp16 until the scale fits."""


def _init_from_env(rank: int, world_size: int) -> None:
    """Form the group the way a user's script does: rayzero.init_distributed() from the env."""
    import rayzero

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # the CPU dry run: ranks share few cores
    rayzero.init_distributed()  # nccl (and torch.cuda.set_device) when CUDA is available


def spawn(world_size: int, fn: Callable, payload: Any = None, timeout_s: float = 600) -> list[Any]:
    """`fn(rank, world_size, payload)` on every rank of a fresh group from env; results by rank."""
    return H.spawn(world_size, fn, payload, timeout_s, init=_init_from_env)


def _strict_fp32() -> None:
    """The reference and the fp32 cases must not silently run matmuls in TF32 (10-bit mantissa)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _device() -> torch.device:
    from rayzero.engine.distributed import compute_device

    return compute_device()


def train_case(rank: int, world: int, case: H.Case) -> dict:
    """One case on this rank: per-step losses, this rank's fp32 master pieces (on the CPU), the
    engine's memory stats and the CUDA allocator's own peak, the fp16 loss-scale record."""
    import rayzero

    device = _device()
    model = H.build_model()
    engine, *_ = rayzero.initialize(model=model, config=case.config(), model_parameters=H.param_groups(model))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, record = [], []
    for step in range(case.steps):
        tokens, targets = H.global_batch(step, world * case.gas * case.micro_batch)
        total = 0.0
        scale = float(engine.loss_scaler.loss_scale)
        before = _masters(engine)
        for micro in range(case.gas):
            start = (micro * world + rank) * case.micro_batch
            window = slice(start, start + case.micro_batch)
            loss = engine(tokens[window].to(device), targets[window].to(device))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / case.gas)
        after = _masters(engine)
        record.append({"skipped": engine.last_step_overflowed, "scale_before": scale,
                       "scale_after": float(engine.loss_scaler.loss_scale),
                       "unchanged": all(torch.equal(before[k], after[k]) for k in before)})
    masters = [(s.spec.name[len("master/"):], s.spec.global_shape, s.spec.flat_start, s.spec.flat_end,
                s.local.detach().float().cpu()) for s in engine.state_shards() if s.spec.name.startswith("master/")]
    memory = engine.memory_stats()
    allocator_peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    result = {"losses": losses, "masters": masters, "memory": memory, "allocator_peak": allocator_peak,
              "steps": record, "skipped_steps": engine.skipped_steps, "device": str(device),
              "backend": torch.distributed.get_backend()}
    engine.close()
    return result


def _masters(engine) -> dict[str, torch.Tensor]:
    return {s.spec.name: s.local.detach().clone() for s in engine.state_shards() if s.spec.name.startswith("master/")}


def reference_run(world: int, case: H.Case) -> tuple[list[float], dict[str, torch.Tensor]]:
    """harness.reference_run on this process's compute device: fp32 torch on the whole global batch."""
    device = _device()
    model = H.build_model().to(device)
    if case.optimizer == "adamw":
        optimizer = torch.optim.AdamW(H.param_groups(model), lr=H.LR)
    else:
        optimizer = torch.optim.SGD(H.param_groups(model), lr=H.SGD_LR, momentum=H.SGD_MOMENTUM)
    losses = []
    for step in range(case.steps):
        tokens, targets = H.global_batch(step, world * case.gas * case.micro_batch)
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], case.clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().float().cpu().reshape(-1) for n, p in model.named_parameters() if p.requires_grad}
    return losses, params


def run_cases(rank: int, world: int, cases: list[H.Case]) -> dict:
    """Every case on this rank; rank 0 also runs the fp32 reference of each distinct schedule."""
    _strict_fp32()
    results = [_guarded(train_case, rank, world, case) for case in cases]
    references = {}
    if rank == 0:
        for case in cases:
            key = reference_key(case)
            if key not in references:
                references[key] = reference_run(world, case)
    return {"results": results, "references": references}


def _guarded(fn: Callable, *args: Any) -> dict:
    """`fn(*args)`, or {"error": its traceback}: one failing case fails its own tests, not the
    whole group's (a group that raises would be spawned again by every test, each failing alike)."""
    import traceback

    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the case's test
        return {"error": traceback.format_exc()[-3000:]}


def reference_key(case: H.Case) -> tuple:
    return (case.gas, case.optimizer, case.steps, case.micro_batch)


def compare(case: H.Case, per_rank: list[dict], reference: tuple[list[float], dict]) -> None:
    """The tolerances of tests/dist/test_parity.py (see its docstring for why bf16 gets these)."""
    failed = [r["error"] for r in per_rank if "error" in r]
    assert not failed, f"the case raised on {len(failed)} of {len(per_rank)} ranks:\n{failed[0]}"
    world = len(per_rank)
    ref_losses, ref_params = reference
    losses = [sum(r["losses"][step] for r in per_rank) / world for step in range(case.steps)]
    full: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, shape, start, end, values in result["masters"]:
            flat = full.setdefault(name, torch.full((math.prod(shape),), float("nan")))
            flat[start:end] = values
    H.assert_matches_reference(case.precision, losses, full, ref_losses, ref_params)
    assert all(r["skipped_steps"] == 0 for r in per_rank)


if __name__ == "__main__":  # the CPU dry run (gloo): `PYTHONPATH=tests python tests/gpu/cuda_workers.py`
    cases = [H.Case(stage=s, precision="fp32", steps=4) for s in range(4)]
    for world in (1, 2):
        out = spawn(world, run_cases, cases)
        for index, case in enumerate(cases):
            compare(case, [r["results"][index] for r in out], out[0]["references"][reference_key(case)])
        print(f"world {world}: {len(cases)} cases match the reference on {out[0]['results'][0]['device']}")
