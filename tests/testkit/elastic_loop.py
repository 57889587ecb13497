"""A tiny deterministic training loop for the controller's fault and resize tests.

The global batch of step s is always samples [s*B, (s+1)*B) of one fixed dataset, however the run is
split into ranks and micro batches, so the weights after N steps are the same at every world size
(up to float summation order) and equal to plain SGD on those batches (`reference_weights`).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import rayzero
from testkit import fault_hooks  # travels with the loop by value ([Note: shipping the loop])

SAMPLES = 96
FEATURES = 8


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.5
    return inputs, targets


def config(batch: int = 12, micro: int = 2, lr: float = 0.05) -> dict:
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "SGD", "params": {"lr": lr}}, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1}}


def initial_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def train(loop_config: dict) -> None:
    context = rayzero.get_context()
    model = initial_model()
    engine, _, _, _ = rayzero.initialize(model=model)
    if context.resume_from:
        _maybe_kill_inside("load", "rayzero/checkpoint/loader.py", loop_config, context, engine.global_steps)
        engine.load_checkpoint(context.resume_from)
        rayzero.report({"loaded_step": engine.global_steps, "loaded": _weights(model)})
    inputs, targets = dataset()
    world, gas = engine.world_size, engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    batch = micro * gas * world
    started_at = engine.global_steps
    if loop_config.get("pid_dir"):  # the fault tests signal this process
        import os

        Path(loop_config["pid_dir"], f"rank{context.rank}.attempt{context.attempt}").write_text(str(os.getpid()))
    while engine.global_steps < loop_config["steps"] and not context.should_stop():
        step = engine.global_steps
        for micro_step in range(gas):
            first = step * batch + (micro_step * world + context.rank) * micro
            index = torch.arange(first, first + micro) % SAMPLES
            loss = torch.nn.functional.mse_loss(engine(inputs[index]), targets[index])
            engine.backward(loss)
            engine.step()
        if loop_config.get("save_every") and engine.global_steps % loop_config["save_every"] == 0:
            if loop_config.get("kill_in") == "save" and engine.global_steps == loop_config.get("kill_step"):
                # the previous async save must be committed first, or the watcher would see its
                # background thread in the saver (a loaded machine) and kill that save instead
                engine.wait_for_checkpoint()
            _maybe_kill_inside("save", "rayzero/checkpoint/saver.py", loop_config, context, engine.global_steps)
            engine.save_checkpoint()
        rayzero.report({"step": engine.global_steps, "loss": loss.item(), "world": world, "gas": gas,
                        "attempt": context.attempt, "started_at": started_at})
        hang_here = loop_config.get("hang_rank") == context.rank and engine.global_steps == loop_config.get("hang_at")
        if hang_here and context.attempt == 0:
            time.sleep(3600)  # a hung rank: the others block in the next collective
        # `sleep_at_world`: a slower pace at some world sizes, so that a test waiting for the run to
        # grow has steps left however long a loaded machine takes to start the new node
        time.sleep(loop_config.get("sleep_at_world", {}).get(world, loop_config.get("sleep", 0.0)))
        if context.rank == loop_config.get("slow_rank"):  # a straggler: slow outside the engine every step
            time.sleep(loop_config["slow_s"])
    rayzero.report({"final": _weights(model), "final_step": engine.global_steps})


def _weights(model: torch.nn.Module) -> list[float]:
    """The full weights, gathered where stage 3 partitions them (a no-op below stage 3)."""
    with rayzero.zero.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _maybe_kill_inside(phase: str, module: str, loop_config: dict, context, step: int) -> None:
    """`kill_in` = "save"/"load": at `kill_attempt` (and `kill_step` for a save) rank `kill_rank` is
    SIGKILLed inside the checkpoint layer's `module`; the other ranks enter a second later, so the
    killed rank is surely inside it (tests/testkit/fault_hooks.py)."""
    if loop_config.get("kill_in") != phase or context.attempt != loop_config.get("kill_attempt", 0):
        return
    if phase == "save" and step != loop_config.get("kill_step"):
        return
    if context.rank == loop_config.get("kill_rank", 1):
        fault_hooks.kill_inside(module, Path(loop_config["pid_dir"], f"killed_in_{phase}"))
    else:
        time.sleep(1.0)


def reference_weights(steps: int, batch: int = 12, lr: float = 0.05) -> list[float]:
    """Plain torch SGD over the same global batches, in one process."""
    from bench.chaos_loop import plain_sgd  # here, not above: this module travels by value

    return plain_sgd(initial_model(), *dataset(), steps, batch, lr)
