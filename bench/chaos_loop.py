"""The chaos soak's training problem and its two loops (rayzero, Ray Train v2), imported on the workers.

A linear regression whose global batch at step s is always samples [s*B, (s+1)*B) of one fixed
dataset, however the run is split into ranks: the weights after N steps are the same at any world
size (up to float summation order; the problem contracts, so those differences do not grow) and
equal plain SGD in one process (`reference_weights`). Both loops leave the same trail in the soak's
directory, so the harness measures both systems the same way from outside:

  times.log       rank 0: one line per step, `invocation step unix_time world` (an invocation is
                  one call of the loop on rank 0: a new one after every restart, resize or rerun)
  loads.log       rank 0: `invocation loaded_step` when the loop resumed from a checkpoint
  ranks/rank<r>   `pid node_id world invocation_start` of rank r's newest process (overwritten)
  finish          written by the harness: the step to end at (the loop stops there, saves, reports)
  final.json      rank 0 at the end: the step and the weights
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import torch

SAMPLES = 96
FEATURES = 64
OUTPUTS = 64
BATCH = 12  # the global batch: divisible by 2 and 3 workers
LR = 0.05


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    mixing = torch.randn(FEATURES, OUTPUTS, generator=generator) / FEATURES ** 0.5
    return inputs, inputs @ mixing + 0.5


def initial_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, OUTPUTS)


def flat_weights(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def plain_sgd(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, steps: int, batch: int,
              lr: float) -> list[float]:
    """`model`'s weights after `steps` steps of torch SGD on MSE, step s on samples [s*batch, (s+1)*batch)
    (wrapping around), in one process: the oracle of the loops whose global batches are those."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        index = torch.arange(step * batch, (step + 1) * batch) % len(inputs)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[index]), targets[index]).backward()
        optimizer.step()
    return flat_weights(model)


def reference_weights(steps: int) -> list[float]:
    """Plain torch SGD over the same global batches, in one process, no faults."""
    return plain_sgd(initial_model(), *dataset(), steps, BATCH, LR)


def rayzero_config() -> dict:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1}}


class Trail:
    """The files a loop leaves for the harness (see the module docstring)."""

    def __init__(self, directory: str, rank: int, world: int) -> None:
        self.root, self.rank, self.world = Path(directory), rank, world
        self.invocation = uuid.uuid4().hex[:12]
        (self.root / "ranks").mkdir(exist_ok=True)
        node = os.environ.get("RAYZERO_NODE_ID") or _ray_node_id()
        (self.root / "ranks" / f"rank{rank}").write_text(f"{os.getpid()} {node} {world} {time.time()}")
        self._times = open(self.root / "times.log", "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def loaded(self, step: int) -> None:
        if self.rank == 0:
            with open(self.root / "loads.log", "a") as out:
                out.write(f"{self.invocation} {step}\n")

    def stepped(self, step: int) -> None:
        if self._times is not None:
            self._times.write(f"{self.invocation} {step} {time.time():.4f} {self.world}\n")

    def finish_step(self, default: int) -> int:
        """The step to end at: the harness's `finish` file once it exists."""
        try:
            return int((self.root / "finish").read_text())
        except (OSError, ValueError):
            return default

    def final(self, step: int, weights: list[float]) -> None:
        if self.rank == 0:
            (self.root / "final.tmp").write_text(json.dumps({"step": step, "weights": weights}))
            (self.root / "final.tmp").replace(self.root / "final.json")


def _ray_node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - only a label for the harness
        return ""


def _batch_slice(step: int, rank: int, world: int, micro: int, micro_step: int) -> torch.Tensor:
    first = step * BATCH + (micro_step * world + rank) * micro
    return torch.arange(first, first + micro) % SAMPLES


def rayzero_loop(config: dict) -> None:
    """The loop under `rayzero.fit`; saves every `save_every` steps when given (else rayzero's
    `checkpoint.interval` or a planned stop saves)."""
    import rayzero

    context = rayzero.get_context()
    model = initial_model()
    engine, _, _, _ = rayzero.initialize(model=model)
    trail = Trail(config["dir"], context.rank, engine.world_size)
    if context.resume_from:
        engine.load_checkpoint(context.resume_from)
        trail.loaded(engine.global_steps)
    inputs, targets = dataset()
    world, gas = engine.world_size, engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    save_every = config.get("save_every")
    while engine.global_steps < trail.finish_step(config["steps"]) and not context.should_stop():
        step = engine.global_steps
        for micro_step in range(gas):
            index = _batch_slice(step, context.rank, world, micro, micro_step)
            loss = torch.nn.functional.mse_loss(engine(inputs[index]), targets[index])
            engine.backward(loss)
            engine.step()
        if save_every and engine.global_steps % save_every == 0:
            engine.save_checkpoint()
        trail.stepped(engine.global_steps)
        rayzero.report({"step": engine.global_steps, "loss": loss.item(), "world": world})
        time.sleep(config["sleep"])
    if not context.should_stop():  # the end: saved, as a user's loop would; a stop saved already
        if not (save_every and engine.global_steps % save_every == 0):
            engine.save_checkpoint()
        engine.wait_for_checkpoint()
        trail.final(engine.global_steps, flat_weights(model))


def ray_train_loop(config: dict) -> None:
    """The same problem as torch DDP under Ray Train v2: rank 0 saves `{model, step}` every
    `save_every` steps through `ray.train.report(checkpoint=...)`, and every rank resumes from
    `ray.train.get_checkpoint()`, as Ray Train's own examples do."""
    import tempfile

    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = initial_model()
    step = 0
    trail = Trail(config["dir"], rank, world)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
            model.load_state_dict(state["model"])
            step = int(state["step"])
        trail.loaded(step)
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = dataset()
    per_rank = BATCH // world
    while step < trail.finish_step(config["steps"]):
        index = _batch_slice(step, rank, world, per_rank, 0)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[index]), targets[index]).backward()
        optimizer.step()
        step += 1
        finishing = step >= trail.finish_step(config["steps"])
        if step % config["save_every"] == 0 or finishing:
            with tempfile.TemporaryDirectory() as directory:
                saved = None
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "step": step},
                               os.path.join(directory, "state.pt"))
                    saved = ray.train.Checkpoint.from_directory(directory)
                ray.train.report({"step": step}, checkpoint=saved)
        trail.stepped(step)
        time.sleep(config["sleep"])
    trail.final(step, flat_weights(model.module))
