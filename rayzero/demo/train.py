"""The demo's training loop: user-level code on the public API only (`rayzero.initialize`,
`rayzero.get_context`, `rayzero.report`). Runs under `rayzero.fit`, `rayzero run` and torchrun.

Loop config keys (all optional): `steps` (default 200), `seed`, `max_chars` (corpus size),
`n_layer`, `n_head`, `n_embd`, `block_size`, `save_checkpoint` (default True), `argv` (from
`rayzero run ... -- --steps 50`).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import rayzero
from rayzero.demo.data import VOCAB_SIZE, BatchSampler, encode, stdlib_text
from rayzero.demo.model import CharGPT, GPTConfig

# Used when the run has no DeepSpeed config (e.g. under torchrun); `rayzero demo` passes its own.
DEFAULT_DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
}


def _options(config: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(config or {})
    if options.get("argv"):  # `rayzero run rayzero/demo/train.py:train_loop ... -- --steps 50`
        parser = argparse.ArgumentParser(prog="demo loop")
        parser.add_argument("--steps", type=int)
        parser.add_argument("--seed", type=int)
        parsed = parser.parse_args(options.pop("argv"))
        options.update({k: v for k, v in vars(parsed).items() if v is not None})
    return options


def train_loop(config: dict[str, Any] | None = None) -> None:
    options = _options(config)
    context = rayzero.get_context()
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # torchrun; under rayzero the worker already did this
    steps = int(options.get("steps", 200))
    seed = int(options.get("seed", 1234))

    ids = encode(stdlib_text(int(options.get("max_chars", 1_000_000)))[0])
    gpt = GPTConfig(
        vocab_size=VOCAB_SIZE,
        block_size=int(options.get("block_size", 64)),
        n_layer=int(options.get("n_layer", 2)),
        n_head=int(options.get("n_head", 4)),
        n_embd=int(options.get("n_embd", 128)),
    )
    torch.manual_seed(seed)  # every rank builds the same initial weights
    model = CharGPT(gpt)
    # Under rayzero.fit the run's config reaches the engine through the environment (config=None).
    # A config without an `optimizer` section (the HF guide's snippets: the Trainer brings its own)
    # gets the demo's AdamW, as the HF Trainer would give it one.
    run_config = context.config or DEFAULT_DS_CONFIG
    optimizer = None if "optimizer" in run_config else torch.optim.AdamW(
        model.parameters(), lr=float(options.get("lr", 1e-3)), weight_decay=0.0)
    engine, _, _, _ = rayzero.initialize(
        model=model, config=None if context.config else DEFAULT_DS_CONFIG, optimizer=optimizer
    )
    micro_batch = int(engine.config.train_micro_batch_size_per_gpu)  # resolved, also from train_batch_size
    accumulation = int(engine.gradient_accumulation_steps())
    sampler = BatchSampler(ids, gpt.block_size, micro_batch, seed=seed + 1000 * context.rank)
    samples_per_step = micro_batch * accumulation * context.world_size
    # DeepSpeed's wall_clock_breakdown: report forward / backward / optimizer time per step. The
    # driver shows `*_ms` metrics on its progress line when the config asks for the breakdown.
    breakdown = bool(engine.config.wall_clock_breakdown)
    # engine.steps loads the newest checkpoint after a restart or a same-name rerun and goes on from its
    # step; it ends early at a planned stop ([Note: a loop that resumes] in rayzero/engine/loop.py)
    training = engine.steps(steps)
    if engine.resumed_client_state and "sampler" in engine.resumed_client_state:
        sampler.load_state_dict(engine.resumed_client_state["sampler"])
    for step in training:
        started = time.perf_counter()
        phases = {"forward_ms": 0.0, "backward_ms": 0.0, "optimizer_ms": 0.0}
        total = 0.0
        for _ in range(accumulation):
            inputs, targets = sampler.next()
            mark = time.perf_counter()
            loss = engine(inputs, targets)
            phases["forward_ms"] += (time.perf_counter() - mark) * 1000
            mark = time.perf_counter()
            engine.backward(loss)
            phases["backward_ms"] += (time.perf_counter() - mark) * 1000
            mark = time.perf_counter()
            engine.step()  # DeepSpeed semantics: steps the optimizer at the accumulation boundary
            phases["optimizer_ms"] += (time.perf_counter() - mark) * 1000
            total += loss.item() / accumulation
        metrics = {
            "step": step + 1,
            "loss": total,
            "samples": (step + 1) * samples_per_step,
            "tokens": (step + 1) * samples_per_step * gpt.block_size,
            "step_ms": (time.perf_counter() - started) * 1000,
        }
        if breakdown:
            metrics.update(phases)
        checkpoint = None
        if step + 1 == steps and options.get("save_checkpoint", True) and context.checkpoint_dir:
            engine.save_checkpoint(client_state={"sampler": sampler.state_dict()})
            engine.wait_for_checkpoint()  # saves are asynchronous; the process group must outlive them
            checkpoint = context.checkpoint_dir
        rayzero.report(
            metrics,
            checkpoint=checkpoint,
        )
