"""A tiny Hugging Face causal LM trained with rayzero from the HF guide's "auto" configs.

    rayzero run examples/hf_causal_lm/train.py:train --config examples/hf_causal_lm/zero3_auto.json \
        --workers 2 --name hf-zero3 --trainer per_device_train_batch_size=4 --trainer learning_rate=3e-3 \
        --trainer warmup_steps=5 -- --steps 30
    rayzero checkpoint consolidate runs/hf-zero3 --hf hf-zero3-model   # from_pretrained("hf-zero3-model")
    rayzero plot runs/hf-zero3 -o hf-zero3.png

The model is built from a small GPT-2 config with random weights (nothing is downloaded); pass
`-- --pretrained DIR` to start from a local HF checkpoint instead (loaded into ZeRO-3 partitions
directly, each rank reading only its part). The data is a repeating token pattern, so the loss
falls quickly. Module-level objects (the config, `dist`) are fine: the workers import this file.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import rayzero

MODEL_CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                          bos_token_id=0, eos_token_id=0)
SEQUENCE = 16


def _batch(step: int, rank: int, micro_batch: int) -> torch.Tensor:
    # token t+1 = token t + 1 (mod a small cycle): learnable in a few dozen steps
    starts = torch.arange(micro_batch) * 7 + step * 13 + rank * 101
    return (starts[:, None] + torch.arange(SEQUENCE)[None, :]) % 24 + 1


def train(config: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pretrained", default=None, help="a local HF model directory to start from")
    args = parser.parse_args(config.get("argv", []))
    context = rayzero.get_context()
    if args.pretrained:
        from rayzero.integrations.transformers import from_pretrained

        model = from_pretrained(GPT2LMHeadModel, args.pretrained)
    else:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(MODEL_CONFIG)
    engine, _, _, scheduler = rayzero.initialize(model=model)  # the run's config; "auto"s resolved
    micro = engine.config.train_micro_batch_size_per_gpu
    # engine.steps: after a restart or a same-name rerun it loads the newest checkpoint and goes on from
    # its step; it ends early at a planned stop (`rayzero stop`, Ctrl-C), whose checkpoint is committed
    for step in engine.steps(args.steps):
        ids = _batch(step, dist.get_rank(), micro)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        lr = scheduler.get_last_lr()[0] if scheduler is not None else engine.config.optimizer.params["lr"]
        rayzero.report({"step": step + 1, "loss": loss.item(), "lr": lr,
                        "samples": (step + 1) * engine.config.train_batch_size})
        if (step + 1) % 10 == 0:
            engine.save_checkpoint(context.checkpoint_dir)  # asynchronous: training goes on while it writes
    engine.save_checkpoint(context.checkpoint_dir)
    engine.wait_for_checkpoint()
