"""Resume a real ZeroEngine from its checkpoints: same world size bitwise, other sizes and stages close.

The chain follows the issue: saved at stage 3 on 2 ranks -> resumed at stage 2 on 3 ranks (10 steps
against the uninterrupted run) -> saved there, resumed at stage 0 on 1 rank. Every run feeds each
optimizer step the same global batch of 12 samples (micro batch 12 / world), so the uninterrupted
loss curve is the reference at any world size.
"""
from __future__ import annotations

import json
import os
import pathlib

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_checkpoint_reshard import run_group

from rayzero.checkpoint.cli import main as checkpoint_cli
from rayzero.checkpoint.manifest import read_manifest
from rayzero.engine import checkpoint_io
from rayzero.engine.api import initialize

GLOBAL_BATCH = 12
TOTAL_STEPS = 20
SAVE_AT = 6
RESHARD_UNTIL = 16  # the 3-rank run covers steps 6..16 (10 steps), then saves for the 1-rank run


def make_engine(stage: int, world: int, init_seed: int):
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                     "warmup_num_steps": 8}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "checkpoint": {"use_node_local_storage": False},
    }
    engine, *_ = initialize(model=model, config=config)
    return engine


def train(engine, first: int, last: int, rank: int, world: int, noise: bool) -> list[float]:
    """Steps first..last-1 on this rank's slice of each step's global batch; the global mean losses."""
    losses = []
    micro = GLOBAL_BATCH // world
    for step in range(first, last):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(GLOBAL_BATCH, 16, generator=generator)[rank * micro:(rank + 1) * micro]
        targets = torch.randn(GLOBAL_BATCH, 1, generator=generator)[rank * micro:(rank + 1) * micro]
        if noise:  # drawn from the global RNG: a resume must restore it to stay bitwise identical
            inputs = inputs + 0.01 * torch.randn_like(inputs)
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _two_ranks_stage3(rank: int, world: int, root: str, out: str) -> None:
    # 1. uninterrupted run with RNG noise, checkpoint (async) at step 6; then resume bitwise
    engine = make_engine(3, world, init_seed=0)
    train(engine, 0, SAVE_AT, rank, world, noise=True)
    engine.save_checkpoint(os.path.join(root, "noisy"), client_state={"note": "noisy"})
    reference = train(engine, SAVE_AT, TOTAL_STEPS, rank, world, noise=True)
    checkpoint_io.wait_for_checkpoint(engine)
    resumed = make_engine(3, world, init_seed=1)  # different init: everything must come from the checkpoint
    path, client = resumed.load_checkpoint(os.path.join(root, "noisy"))
    assert path.endswith(f"global_step{SAVE_AT}") and client == {"note": "noisy"}
    assert resumed.global_steps == SAVE_AT
    again = train(resumed, SAVE_AT, TOTAL_STEPS, rank, world, noise=True)
    assert again == reference, (again, reference)  # bitwise: same floats, same order
    # 2. noise-free reference for the resharding runs
    engine = make_engine(3, world, init_seed=0)
    train(engine, 0, SAVE_AT, rank, world, noise=False)
    engine.save_checkpoint(os.path.join(root, "clean"), asynchronous=False)
    reference = train(engine, SAVE_AT, TOTAL_STEPS, rank, world, noise=False)
    # 3. the final stage-3 state: a checkpoint to consolidate offline, and DeepSpeed's 16-bit export
    engine.save_checkpoint(os.path.join(root, "final"), asynchronous=False)
    assert engine.save_16bit_model(os.path.join(root, "export"))
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(reference, handle)


def _three_ranks_stage2(rank: int, world: int, root: str, out: str) -> None:
    reference = json.loads(pathlib.Path(out).read_text())
    engine = make_engine(2, world, init_seed=1)
    engine.load_checkpoint(os.path.join(root, "clean"))
    assert engine.global_steps == SAVE_AT and engine.lr_scheduler.last_epoch == SAVE_AT
    losses = train(engine, SAVE_AT, RESHARD_UNTIL, rank, world, noise=False)
    for got, want in zip(losses, reference[:RESHARD_UNTIL - SAVE_AT]):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, reference)
    engine.save_checkpoint(os.path.join(root, "clean"))
    checkpoint_io.wait_for_checkpoint(engine)


def test_resume_bitwise_then_reshard_across_stages(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "reference.json")
    run_group(2, _two_ranks_stage3, root, out)
    run_group(3, _three_ranks_stage2, root, out)
    # 1 rank, stage 0, no process group: continue from the 3-rank checkpoint of step 16
    reference = json.loads(pathlib.Path(out).read_text())
    engine = make_engine(0, 1, init_seed=2)
    path, _ = engine.load_checkpoint(os.path.join(root, "clean"))
    assert path.endswith(f"global_step{RESHARD_UNTIL}")
    losses = train(engine, RESHARD_UNTIL, TOTAL_STEPS, 0, 1, noise=False)
    for got, want in zip(losses, reference[RESHARD_UNTIL - SAVE_AT:]):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, reference)

    # consolidated weights equal the gathered parameters exactly
    engine.save_checkpoint(os.path.join(root, "stage0"), asynchronous=False)
    out = str(tmp_path / "stage0.safetensors")
    assert checkpoint_cli(["consolidate", os.path.join(root, "stage0"), out]) == 0
    consolidated = load_file(out)
    parameters = dict(engine.module.named_parameters())
    assert set(consolidated) == set(parameters)
    for name, parameter in parameters.items():
        assert torch.equal(consolidated[name], parameter.detach()), name
    # stage 3 on 2 ranks: the offline consolidation equals save_16bit_model's on-line gather
    out = str(tmp_path / "final.pt")
    assert checkpoint_cli(["consolidate", os.path.join(root, "final"), out, "--format", "torch"]) == 0
    consolidated = torch.load(out, weights_only=True)
    exported = torch.load(os.path.join(root, "export", "pytorch_model.bin"), weights_only=True)
    assert set(consolidated) == set(exported) == set(parameters)
    for name in parameters:
        assert torch.equal(consolidated[name], exported[name]), name
    assert checkpoint_cli(["verify", os.path.join(root, "final")]) == 0


def test_load_flags_module_only_and_without_optimizer(tmp_path):
    """One process: what load_optimizer_states / load_lr_scheduler_states / load_module_only keep."""
    root = str(tmp_path / "ckpt")
    trained = make_engine(1, 1, init_seed=0)
    train(trained, 0, 5, 0, 1, noise=False)
    trained.save_checkpoint(root, client_state={"epoch": 2}, asynchronous=False)
    weights = {name: p.detach().clone() for name, p in trained.module.named_parameters()}
    momentum = {s.spec.name: s.local.clone() for s in trained.state_shards() if s.spec.name.startswith("optim/")}
    assert momentum and all(value.abs().sum() > 0 for value in momentum.values())

    def optim_state(engine):
        return {s.spec.name: s.local.clone() for s in engine.state_shards() if s.spec.name.startswith("optim/")}

    fresh = make_engine(1, 1, init_seed=1)
    path, client = fresh.load_checkpoint(root, load_optimizer_states=False, load_lr_scheduler_states=False)
    assert client == {"epoch": 2} and fresh.global_steps == 5
    assert fresh.lr_scheduler.last_epoch == 0  # scheduler not restored
    assert all(torch.equal(p, weights[name]) for name, p in fresh.module.named_parameters())
    assert all(value.abs().sum() == 0 for value in optim_state(fresh).values())  # momentum not restored

    module_only = make_engine(1, 1, init_seed=2)
    module_only.load_checkpoint(root, load_module_only=True)
    assert module_only.global_steps == 0
    assert all(torch.equal(p, weights[name]) for name, p in module_only.module.named_parameters())
    masters = {s.spec.name.removeprefix("master/"): s.local for s in module_only.state_shards()
               if s.spec.name.startswith("master/")}
    assert all(torch.equal(masters[name], weights[name].reshape(-1)) for name in weights)  # rebuilt from weights

    full = make_engine(1, 1, init_seed=3)
    full.load_checkpoint(root)
    assert full.lr_scheduler.last_epoch == 5
    assert all(torch.equal(value, momentum[name]) for name, value in optim_state(full).items())
    # data position: global steps x global batch
    manifest = read_manifest(path)
    assert manifest.extra_state["data_position"] == {"consumed_samples": 5 * GLOBAL_BATCH,
                                                     "train_batch_size": GLOBAL_BATCH}
    assert manifest.stage == 1 and manifest.world_size == 1 and manifest.step == 5


def test_consolidated_tied_weights_load_strictly_into_the_plain_model(tmp_path):
    """One process: a checkpoint of a model with tied embeddings consolidates into a state dict that
    the same plain torch model loads with strict=True (both names of the tied weight present)."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 8)
            self.head = torch.nn.Linear(8, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return torch.nn.functional.cross_entropy(self.head(self.embed(tokens)), tokens)

    torch.manual_seed(0)
    engine, *_ = initialize(model=Tied(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3}, "checkpoint": {"use_node_local_storage": False}})
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 11, (4,))))
        engine.step()
    root = str(tmp_path / "ckpt")
    engine.save_checkpoint(root, asynchronous=False)
    out = str(tmp_path / "model.safetensors")
    assert checkpoint_cli(["consolidate", root, out]) == 0
    plain = Tied()
    plain.load_state_dict(load_file(out))  # strict: raises on a missing head.weight
    from rayzero.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        assert torch.equal(plain.head.weight, engine.module.embed.weight.detach())
