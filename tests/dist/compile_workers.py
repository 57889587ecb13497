"""What the ranks of tests/dist/test_compile.py run: a small GPT with a ModuleList of blocks trained
eagerly and compiled (`engine.compile`, the HF Trainer's `torch_compile`, Accelerate's dynamo
plugin, a compiled LightningModule), each rank returning its losses and dynamo's counters."""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, WIDTH, SEQ, MICRO, STEPS = 32, 16, 8, 2, 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.norm2 = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, 2, width // 2).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(torch.nn.Module):
    """Tied embedding and head, a position table, two blocks in a ModuleList; returns the loss."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).reshape(-1, VOCAB), targets.reshape(-1))


def build(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def batch(step: int, rank: int, size: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, VOCAB, (size, SEQ), generator=generator),
            torch.randint(0, VOCAB, (size, SEQ), generator=generator))


def config(stage: int, offload: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter gathered and released
        if offload:
            zero["offload_param"] = {"device": "cpu"}  # and prefetch on, as by default
        else:  # each fetch alone, so the peak says what one fetch gathers
            zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled, graph breaks and recompiles since the last reset (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())}


def reset_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def train_engine(rank: int, case: dict[str, Any], compile_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """STEPS optimizer steps of rayzero's engine (of `case["gas"]` micro-steps each); compiled with
    `compile_kwargs` (engine.compile's) when given, before the optimizer step `case["compile_at"]`."""
    import rayzero

    stage, gas = case["stage"], case.get("gas", 1)
    reset_dynamo()
    engine, *_ = rayzero.initialize(model=build(), config={**config(stage, case.get("offload", False)),
                                                           "gradient_accumulation_steps": gas})
    losses = []
    for step in range(STEPS):
        if compile_kwargs is not None and step == case.get("compile_at", 0):
            engine.compile(**compile_kwargs)
        for micro in range(gas):
            loss = engine(*batch(step * gas + micro, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    out = {"losses": losses, "dynamo": dynamo_counts(), "compiled": engine.is_compiled}
    if stage == 3:
        out["peak_live"] = engine.memory_stats()["peak_live_param_elements"]
    out["block"] = sum(p.numel() for p in build().blocks[0].parameters())
    module = engine.module
    engine.close()
    out["handed_back"] = all("forward" not in block.__dict__ for block in module.blocks)
    return out


def engine_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case trained eagerly, then compiled with its compile keywords."""
    torch.set_num_threads(1)
    out = {}
    for case in cases:
        started = time.process_time()
        eager = train_engine(rank, case, None)
        middle = time.process_time()
        compiled = train_engine(rank, case, case["compile"])
        out[case["name"]] = {"eager": eager, "compiled": compiled,
                             "cpu_s": (middle - started, time.process_time() - middle)}
    return out


def set_world_environment(rank: int, world: int) -> None:
    """torchrun's variables (the spawn sets RANK/WORLD_SIZE/MASTER_*), for Accelerate's state."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


# ---- the ways in: the HF Trainer, Accelerate, Lightning ---------------------------------------
HF_STAGE3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _gpt2():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _token_rows(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    rows = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


def hf_trainer(rank: int, directory: str, compile_backend: str | None) -> dict[str, Any]:
    """transformers' Trainer with `deepspeed=` (rayzero's compat `deepspeed`) and, when given,
    `torch_compile=True`: Accelerate's dynamo plugin, which calls `engine.compile` under DeepSpeed."""
    import transformers

    reset_dynamo()
    compile_options = {"torch_compile": True, "torch_compile_backend": compile_backend} if compile_backend \
        else {}
    args = transformers.TrainingArguments(
        output_dir=os.path.join(directory, f"trainer-{compile_backend}"), deepspeed=HF_STAGE3,
        per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, seed=0,
        report_to="none", save_strategy="no", dataloader_num_workers=0, **compile_options)
    trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=_token_rows(2 * MICRO * STEPS))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    out = {"losses": losses, "dynamo": dynamo_counts(), "compiled": engine.is_compiled,
           "engine": type(engine).__name__}
    engine.close()
    return out


def accelerate_regional(rank: int, directory: str, compile_backend: str | None) -> dict[str, Any]:
    """An Accelerate loop with a DeepSpeed plugin and, when given, a dynamo plugin asking for regional
    compilation: Accelerate compiles each block in place (`compile_regions_deepspeed`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, TorchDynamoPlugin

    reset_dynamo()
    AcceleratorState._reset_state(True)
    dynamo = TorchDynamoPlugin(backend=compile_backend, use_regional_compilation=True) if compile_backend \
        else None
    ds_config = {key: value for key, value in config(3).items() if key != "optimizer"}  # the loop's own
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    accelerator = Accelerator(deepspeed_plugin=plugin, **({"dynamo_plugin": dynamo} if dynamo else {}))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "dynamo": dynamo_counts(),
           "compiled_in_place": sum(getattr(m, "_compiled_call_impl", None) is not None
                                    for m in model.modules())}
    engine.close()
    AcceleratorState._reset_state(True)
    return out


def lightning_compiled(rank: int, directory: str, compile_backend: str | None) -> dict[str, Any]:
    """A LightningModule around TinyGPT, passed to `Trainer.fit` as `torch.compile(module)` when a
    backend is given, trained by RayZeroStrategy at stage 3 ([Note: a compiled LightningModule])."""
    import lightning.pytorch as pl

    from rayzero.lightning import RayZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build()
            self.losses: list[float] = []

        def training_step(self, batch_data, batch_index):
            loss = self.model(*batch_data)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    reset_dynamo()
    rows = [batch(step, rank) for step in range(STEPS)]
    loader = torch.utils.data.DataLoader(rows, batch_size=None)  # this rank's batches, as they are
    module = Module()
    strategy = RayZeroStrategy(config={"train_micro_batch_size_per_gpu": MICRO,
                                       "zero_optimization": config(3)["zero_optimization"]})
    trainer = pl.Trainer(accelerator="cpu", devices=world_size(), strategy=strategy, max_steps=STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                         default_root_dir=directory)
    trainer.fit(torch.compile(module, backend=compile_backend) if compile_backend else module, loader)
    return {"losses": module.losses, "dynamo": dynamo_counts(), "uncompiled": module._compiler_ctx is None}


def world_size() -> int:
    return torch.distributed.get_world_size()


def integration_cases(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each way in, eagerly and compiled, at stage 3."""
    import sys

    from rayzero.compat import SITE_DIR

    torch.set_num_threads(1)
    set_world_environment(rank, world)
    sys.path.insert(0, SITE_DIR)  # what `rayzero run` does for a script: `import deepspeed` is rayzero's
    out = {}
    for name, run, backend in (("lightning_eager", lightning_compiled, None),
                               ("lightning_compiled", lightning_compiled, "aot_eager"),
                               ("hf_eager", hf_trainer, None), ("hf_compiled", hf_trainer, "aot_eager"),
                               ("accelerate_eager", accelerate_regional, None),
                               ("accelerate_compiled", accelerate_regional, "aot_eager")):
        started = time.process_time()
        out[name] = run(rank, directory, backend)
        out[name]["cpu_s"] = time.process_time() - started
    return out
