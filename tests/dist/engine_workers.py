"""Worker bodies for test_engine_behaviour.py (run inside harness.spawn; one spawn, many checks)."""
from __future__ import annotations

import json
import os

import harness as H
import torch


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
    engine.close()
    return out
