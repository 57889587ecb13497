"""bench/gpu.py's `transformers` section: transformers' GPT-2 medium and XL, bf16, rayzero against
FSDP2 and DeepSpeed at stages 2 and 3 and ZeRO-3 with CPU offload, each row in its own process.

    python bench/gpu.py --sections transformers --rounds 2 --json bench/results/gpu-transformers.json
    python bench/gpu.py --device cpu --quick --sections transformers --rounds 1   # a dry run, tiny GPT-2s

The model is transformers' own GPT2LMHeadModel built from GPT2Config (bench/models.py's
`TransformersGPT2`: random init on the device, nothing downloaded, head tied to the token embedding,
dropout 0 so loss curves compare step by step): `gpt2-medium` (24 x 1024, 16 heads, ~0.35 B
parameters) at 8 x 1024 tokens per rank, `gpt2-xl` (48 x 1600, 25 heads, ~1.56 B) at 4 x 1024; vocab
50257, 1024 positions. Rows, in run order:

    gpt2-medium: rayzero, FSDP2, DeepSpeed at stage 3; rayzero, DeepSpeed at stage 2
    gpt2-xl:     rayzero, FSDP2, DeepSpeed at stage 3; rayzero, DeepSpeed at stage 2
    gpt2-medium: rayzero, DeepSpeed at stage 3 + CPU offload of parameters and optimizer (pinned)

Like for like (`TRANSFORMERS_CONFIG`, given unchanged to DeepSpeed and rayzero beside the client
optimizer; FSDP2 reads its bf16 switch):
- bf16 as DeepSpeed users write it (`"bf16": {"enabled": true}`: bf16 weights and compute, fp32
  master weights and optimizer state); FSDP2: `fully_shard` on each GPT2Block then the root with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (fp32 sharded parameters and optimizer).
- one client optimizer, torch's fused AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01),
  built the same way for every system; on the host under offload (`zero_force_ds_cpu_optimizer:
  false`: DeepSpeedCPUAdam would need a JIT build).
- `zero_optimization` at DeepSpeed 0.19.8's own defaults, written out (deepspeed/runtime/zero/
  config.py): `reduce_bucket_size` 5e8, `stage3_prefetch_bucket_size` 5e7,
  `stage3_param_persistence_threshold` 1e5, `stage3_max_live_parameters` 1e9,
  `stage3_max_reuse_distance` 1e9; `overlap_comm` unset (both resolve it to true at stage 3, false
  below). These replace bench/engine_systems.py's stage-3 overrides (persistence and reuse distance
  0, chosen there to make the small models' stage 3 gather everything): at GPT-2's sizes a user runs
  the defaults. FSDP2 runs its own (reshard after forward).
- `gradient_clipping` 0 (DeepSpeed's default clips at 1.0; FSDP2 does not clip), as in
  bench/engine_systems.py's `deepspeed_config`.

Per row: step time (median over steps, then over rounds, with the spread of the round medians and of
the steps), peak memory (`torch.cuda.max_memory_allocated` from before the model's build to the end
of its probe step, so the model's own bytes are in it: a fresh process holds nothing before), the
loss of every step. Comparisons (bench/gpu.py's): throughput ratio = reference / rayzero median step
time (> 1: rayzero faster), peak memory ratio rayzero / reference, largest relative loss gap against
the reference (FSDP2 at stage 3, DeepSpeed's same stage and offload otherwise). DeepSpeed 0.19.8
builds its fp32 master weights from the model after casting it to bf16 (checked on CPU: its masters
are bf16(init), rayzero's and FSDP2's the fp32 init), so its losses part from the other two's after
the first step (~5e-5 relative in the CPU dry run, where rayzero's and FSDP2's were equal): that is in
the gap against DeepSpeed.

Steps: 2 warm-up and 6 timed (offload: 4), then the probe step. On one H200 a row is mostly its
process's start (NCCL, importing transformers and DeepSpeed, building the model, the engine's setup):
~10-15 s a gpt2-medium row, ~15-25 s a gpt2-xl row, ~20-30 s an offload row; ~3 min a round
(estimated from bench/gpu.py's H100 and H200 rows, not measured: no GPU was lent to the round that
wrote this). bench/gpu_check.sh runs one round.
"""
from __future__ import annotations

from typing import Any

MEDIUM, XL = "gpt2-medium", "gpt2-xl"
PINNED_CPU = {"device": "cpu", "pin_memory": True}

TRANSFORMERS_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    # The client optimizer's section (bench/engine_systems.py builds torch's AdamW from it, fused); the
    # engines get the optimizer object, not this section.
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01, "torch_adam": True}},
    "zero_optimization": {
        "reduce_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
    },
}
OFFLOAD = {"offload_param": PINNED_CPU, "offload_optimizer": PINNED_CPU}


def _config(offload: bool) -> dict[str, Any]:
    if not offload:
        return TRANSFORMERS_CONFIG
    return {**TRANSFORMERS_CONFIG, "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {**TRANSFORMERS_CONFIG["zero_optimization"], **OFFLOAD}}


def _row(system: str, model: str, offload: bool = False) -> dict[str, Any]:
    label = f"{system}-offload-cpu" if offload else system
    return {"variant": {"system": system, "label": label, "extra": _config(offload), "env": {}}, "model": model}


def transformers_rows() -> list[dict[str, Any]]:
    """The section's rows in run order: one (variant, model) each, each run in its own process."""
    rows = []
    for model in (MEDIUM, XL):
        rows += [_row(system, model) for system in ("rayzero-stage3", "fsdp2", "deepspeed-stage3")]
        rows += [_row(system, model) for system in ("rayzero-stage2", "deepspeed-stage2")]
    rows += [_row(system, MEDIUM, offload=True) for system in ("rayzero-stage3", "deepspeed-stage3")]
    return rows


def transformers_jobs() -> list[dict[str, Any]]:
    """bench/gpu.py's job templates: one process group per row, bf16."""
    jobs = []
    for row in transformers_rows():
        variant = row["variant"]
        offload = variant["label"].endswith("-offload-cpu")
        jobs.append({"variants": [variant], "models": [row["model"]], "section": "transformers",
                     "precision": "bf16", "name": f"transformers-{row['model']}-{variant['label']}",
                     "warmup": 2, "steps": 4 if offload else 6})
    return jobs
