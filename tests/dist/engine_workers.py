"""Worker bodies for test_engine_behaviour.py (run inside harness.spawn; one spawn, many checks)."""
from __future__ import annotations

import functools
import json
import os

import torch
from testkit import harness as H


def _engine(case: H.Case, **kwargs):
    import rayzero

    model = H.build_model()
    kwargs.setdefault("model_parameters", H.param_groups(model))
    engine, optimizer, loader, scheduler = rayzero.initialize(model=model, config=case.config(), **kwargs)
    return engine, optimizer, loader, scheduler


def _master_snapshot(engine) -> dict[str, torch.Tensor]:
    return {s.spec.name: s.local.detach().clone() for s in engine.state_shards()
            if s.spec.name.startswith("master/")}


def _train_step(engine, rank: int, world: int, step: int, micro: int, poison: bool = False) -> float:
    tokens, targets = H.global_batch(step, world * micro)
    window = slice(rank * micro, (rank + 1) * micro)
    loss = engine(tokens[window], targets[window])
    if poison:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    return loss.item()


def fp16_overflow(rank: int, world: int, stage: int) -> dict:
    """Dynamic loss scaling: a too-large initial scale overflows (steps skipped, scale halved, weights
    untouched) until it fits; an inf on one rank only skips the step on every rank."""
    extra = (("fp16", {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "hysteresis": 1,
                       "loss_scale_window": 1000, "min_loss_scale": 1}),)
    case = H.Case(stage=stage, precision="fp16", extra=extra)
    engine, *_ = _engine(case)
    record = []
    for step in range(12):
        before = _master_snapshot(engine)
        scale = engine.loss_scaler.loss_scale
        loss = _train_step(engine, rank, world, step, case.micro_batch, poison=(step == 8 and rank == world - 1))
        after = _master_snapshot(engine)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        record.append({"scale_before": scale, "scale_after": engine.loss_scaler.loss_scale,
                       "skipped": engine.last_step_overflowed, "unchanged": unchanged, "loss": loss,
                       "global_steps": engine.global_steps})
    engine.close()
    return {"steps": record, "skipped_steps": engine.skipped_steps}


def behaviours(rank: int, world: int, _: object) -> dict:
    """Several engine behaviours in one process group; returns what each observed."""
    import rayzero

    out: dict = {}
    # 1. ignore_unused_parameters=false names the unused parameter.
    case = H.Case(stage=2, zero=(("ignore_unused_parameters", False),))
    engine, *_ = _engine(case)
    try:
        _train_step(engine, rank, world, 0, 2)
        out["unused_error"] = None
    except ValueError as error:
        out["unused_error"] = str(error)
    engine.close()

    # 2. An optimizer ZeRO was not tested with needs zero_allow_untested_optimizer.
    model = H.build_model()
    config = H.Case(stage=1).config()
    config.pop("optimizer")
    try:
        rayzero.initialize(model=model, config=config, optimizer=torch.optim.Adagrad(model.parameters()))
        out["untested_error"] = None
    except ValueError as error:
        out["untested_error"] = str(error)
    model = H.build_model()
    engine, optimizer, _, _ = rayzero.initialize(
        model=model, config={**config, "zero_allow_untested_optimizer": True},
        optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05))
    _train_step(engine, rank, world, 0, 2)
    out["untested_allowed_type"] = type(optimizer).__name__
    out["untested_allowed_state"] = sorted(next(iter(optimizer.state.values())).keys())
    engine.close()

    # 3. Config from $RAYZERO_CONFIG (JSON text), a scheduler from the config, a dataloader.
    config = H.Case(stage=1, micro_batch=3).config()
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                          "warmup_num_steps": 4, "warmup_type": "linear"}}
    os.environ["RAYZERO_CONFIG"] = json.dumps(config)
    tokens, targets = H.global_batch(0, 30)
    dataset = torch.utils.data.TensorDataset(tokens, targets)
    model = H.build_model()
    engine, optimizer, loader, scheduler = rayzero.initialize(model=model, training_data=dataset)
    del os.environ["RAYZERO_CONFIG"]
    lrs = [engine.get_lr()[0]]
    seen = 0
    for batch_tokens, batch_targets in loader:
        engine.backward(engine(batch_tokens, batch_targets))
        engine.step()
        lrs.append(engine.get_lr()[0])
        seen += batch_tokens.shape[0]
    out["env_lrs"] = lrs
    out["env_samples_seen"] = seen
    out["env_scheduler"] = type(scheduler).__name__
    out["gas_api"] = (engine.gradient_accumulation_steps(), engine.global_steps)
    engine.close()

    # 4. communication_data_type fp32 under bf16: gradients travel as fp32.
    case = H.Case(stage=2, precision="bf16", extra=(("communication_data_type", "fp32"),))
    engine, *_ = _engine(case)
    _train_step(engine, rank, world, 0, 2)
    out["comm_fp32_reduce_scatter"] = engine.comm_stats().get("reduce_scatter")
    out["comm_fp32_all_gather"] = engine.comm_stats().get("all_gather")
    engine.close()

    # 5. Gradient accumulation boundary bookkeeping.
    case = H.Case(stage=0, gas=3)
    engine, *_ = _engine(case)
    flags = []
    for step in range(6):
        flags.append(engine.is_gradient_accumulation_boundary())
        _train_step(engine, rank, world, step, 2)
    out["boundaries"] = flags
    out["after_six_micro"] = engine.global_steps
    out["batch_sizes"] = (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size())
    engine.close()

    # 6. No process group yet: initialize() builds one from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.
    # A fresh port, agreed through the old group: the old store's port may linger in TIME_WAIT.
    port = torch.tensor([H.server_port() if rank == 0 else 0])
    torch.distributed.broadcast(port, src=0)
    os.environ["MASTER_PORT"] = str(int(port))
    torch.distributed.destroy_process_group()
    engine, *_ = _engine(H.Case(stage=1))
    _train_step(engine, rank, world, 0, 2)
    out["env_group"] = (torch.distributed.is_initialized(), engine.world_size, engine.global_rank,
                        engine.comm_stats()["reduce_scatter"]["calls"] > 0)
    engine.close()
    return out


def resume(rank: int, world: int, payload: dict) -> dict:
    """Train steps [first, last) of `case`, first loading `pieces`/`extra` (another run's
    state_shards / extra_state) through the engine's checkpoint seam when given."""
    case, first, last = payload["case"], payload["first"], payload["last"]
    engine, *_ = _engine(case)
    if payload.get("pieces") is not None:
        engine.load_state_shards(functools.partial(read_from_pieces, payload["pieces"]))
        engine.load_extra_state(payload["extra"])
    losses = [_train_step(engine, rank, world, step, case.micro_batch) for step in range(first, last)]
    shards = [(s.spec, s.local.detach().clone()) for s in engine.state_shards()]
    out = {"losses": losses, "shards": shards, "extra": engine.extra_state(),
           "global_steps": engine.global_steps}
    engine.close()
    return out


def read_from_pieces(pieces: list, spec) -> torch.Tensor:
    """Assemble `spec`'s flat range from pieces (ShardSpec, tensor) written by any layout."""
    out = torch.full((spec.flat_end - spec.flat_start,), float("nan"), dtype=torch.float64)
    found = False
    for have, values in pieces:
        if have.name != spec.name:
            continue
        found = True
        lo, hi = max(have.flat_start, spec.flat_start), min(have.flat_end, spec.flat_end)
        if lo < hi:
            out[lo - spec.flat_start:hi - spec.flat_start] = values[lo - have.flat_start:hi - have.flat_start].double()
    if not found:
        raise KeyError(spec.name)
    if torch.isnan(out).any():
        raise AssertionError(f"{spec.name}[{spec.flat_start}:{spec.flat_end}] not fully covered")
    return out.to(spec.dtype)
