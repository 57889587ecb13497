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
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, width)
        x = x + self.proj(attended)
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


def train_engine(rank: int, stage: int, offload: bool, compile_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """STEPS steps of rayzero's engine; compiled when `compile_kwargs` is given (engine.compile's)."""
    import rayzero

    engine, *_ = rayzero.initialize(model=build(), config=config(stage, offload))
    if compile_kwargs is not None:
        reset_dynamo()
        engine.compile(**compile_kwargs)
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
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
        eager = train_engine(rank, case["stage"], case.get("offload", False), None)
        middle = time.process_time()
        compiled = train_engine(rank, case["stage"], case.get("offload", False), case["compile"])
        out[case["name"]] = {"eager": eager, "compiled": compiled,
                             "cpu_s": (middle - started, time.process_time() - middle)}
    return out


def set_world_environment(rank: int, world: int) -> None:
    """torchrun's variables (the spawn sets RANK/WORLD_SIZE/MASTER_*), for Accelerate's state."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
