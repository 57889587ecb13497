"""The benchmark models and their data, defined once so every system trains exactly the same thing.

Two models of our own: a small GPT (token embedding, a stack of pre-norm transformer blocks, an untied language
model head) and a plain MLP. Both are built from a fixed seed, so every rank of every system starts
from identical weights, and their batches come from a generator seeded by (step, rank), so rank r sees
the same micro-batch at step s whichever system is being measured. The global batch at world size N is
the N per-rank micro-batches together, which is what data parallelism means; the per-rank batch stays
fixed as N changes (weak scaling), as in the ZeRO paper's measurements.

The head is untied on purpose: tied weights are a correctness case for the engine's tests, not a
performance question, and untied keeps FSDP2's wrapping plain (tied weights must live in one unit).

And transformers' own GPT2LMHeadModel (`gpt2-medium`, `gpt2-xl`: bench/gpu_transformers.py), built
from a GPT2Config with random init (nothing downloaded), its head tied as GPT-2's is.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

from rayzero.demo.model import next_token_loss

SEED = 1234


@dataclasses.dataclass(frozen=True)
class GPTSpec:
    """Shape of the GPT benchmark model and of its per-rank batch."""

    vocab_size: int
    width: int
    depth: int
    heads: int
    sequence_length: int
    batch_per_rank: int


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """Shape of the MLP benchmark model and of its per-rank batch."""

    width: int
    depth: int
    batch_per_rank: int


# --quick keeps each step at tens of milliseconds on one core so ten systems fit in the time budget;
# the full sizes make compute large enough that per-step overheads matter less (closer to real use).
QUICK = {
    "gpt": GPTSpec(vocab_size=512, width=128, depth=2, heads=4, sequence_length=64, batch_per_rank=4),
    "mlp": MLPSpec(width=512, depth=4, batch_per_rank=32),
}
FULL = {
    "gpt": GPTSpec(vocab_size=2048, width=256, depth=4, heads=4, sequence_length=128, batch_per_rank=8),
    "mlp": MLPSpec(width=1024, depth=4, batch_per_rank=64),
}
# bench/gpu.py on one CUDA device: a GPT of ~0.18 B parameters and an MLP of ~0.13 B, so that a step
# is tens of milliseconds of GPU work rather than kernel-launch overhead.
GPU = {
    "gpt": GPTSpec(vocab_size=8192, width=1024, depth=12, heads=16, sequence_length=512, batch_per_rank=8),
    "mlp": MLPSpec(width=4096, depth=8, batch_per_rank=512),
}
# transformers' GPT-2 as GPT2Config has them (vocab 50257, n_positions 1024 = the sequence length):
# medium 24 x 1024 with 16 heads (~0.35 B parameters), XL 48 x 1600 with 25 heads (~1.56 B); quick:
# tiny shapes of the same model code, for a CPU dry run.
TRANSFORMERS = ("gpt2-medium", "gpt2-xl")
GPU |= {
    "gpt2-medium": GPTSpec(vocab_size=50257, width=1024, depth=24, heads=16, sequence_length=1024, batch_per_rank=8),
    "gpt2-xl": GPTSpec(vocab_size=50257, width=1600, depth=48, heads=25, sequence_length=1024, batch_per_rank=4),
}
QUICK |= {
    "gpt2-medium": GPTSpec(vocab_size=1000, width=64, depth=2, heads=4, sequence_length=32, batch_per_rank=2),
    "gpt2-xl": GPTSpec(vocab_size=1000, width=80, depth=3, heads=5, sequence_length=32, batch_per_rank=2),
}
SIZES = {"quick": QUICK, "full": FULL, "gpu": GPU}


def spec(name: str, size: bool | str) -> GPTSpec | MLPSpec:
    """The spec of model `name` at `size`: "quick", "full" or "gpu" (True / False: quick / full)."""
    if isinstance(size, bool):
        size = "quick" if size else "full"
    return SIZES[size][name]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Returns the mean next-token cross-entropy, so every system calls `loss = model(batch)`."""

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(spec.vocab_size, spec.width)
        self.position_embedding = nn.Embedding(spec.sequence_length, spec.width)
        self.blocks = nn.ModuleList(Block(spec.width, spec.heads) for _ in range(spec.depth))
        self.ln_f = nn.LayerNorm(spec.width)  # final norm
        self.head = nn.Linear(spec.width, spec.vocab_size, bias=False)
        # nanoGPT's scaled init keeps the residual stream's variance flat with depth.
        for name, parameter in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * spec.depth))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self, tokens, targets)  # the demo's GPT's forward: same module names


class TransformersGPT2(nn.Module):
    """transformers' GPT2LMHeadModel behind the bench's `loss = model(tokens, targets)`.

    Dropout 0 (GPT2Config's is 0.1): each system draws random numbers in its own order, and the loss
    curves are compared step by step. `use_cache` off: training keeps no key/value cache. Attention
    is torch's SDPA, named rather than left to the library's default. The loss is the mean
    next-token cross-entropy in fp32 over every position (the batch is already shifted), as the
    bench's GPT computes it.
    """

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel  # seconds to import: only where used

        config = GPT2Config(vocab_size=spec.vocab_size, n_positions=spec.sequence_length, n_embd=spec.width,
                            n_layer=spec.depth, n_head=spec.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa",
                            bos_token_id=spec.vocab_size - 1, eos_token_id=spec.vocab_size - 1)  # 50256 at full size
        self.language_model = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.language_model(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class MLP(nn.Module):
    """Regression MLP returning the mean squared error."""

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(spec.depth):
            layers.append(nn.Linear(spec.width, spec.width))
            if index < spec.depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.layers(inputs), targets)


def build_model(name: str, quick: bool | str, device: torch.device | None = None) -> nn.Module:
    """The model `name` ("gpt", "mlp" or one of TRANSFORMERS) with weights fixed by SEED, identical
    on every rank. Our own models are built on the CPU (the same weights whatever the device; the
    caller moves them); transformers' GPT-2 on `device` itself: XL's 1.56 B parameters initialise in
    a second on a GPU rather than many on the host, and its build counts in the peak memory."""
    shape = spec(name, quick)
    if name not in TRANSFORMERS:
        device = None
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device or "cpu"):
        torch.manual_seed(SEED)
        if name in TRANSFORMERS:
            return TransformersGPT2(shape)
        return GPT(shape) if name == "gpt" else MLP(shape)


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """Sub-modules that FSDP2 shards as separate units (before the root): one per block / layer."""
    if isinstance(model, GPT):
        return list(model.blocks)
    if isinstance(model, TransformersGPT2):
        return list(model.language_model.transformer.h)  # one GPT2Block each
    return [layer for layer in model.layers if isinstance(layer, nn.Linear)]


def batch(name: str, quick: bool | str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch for `step`: a pure function of its arguments."""
    shape = spec(name, quick)
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    if isinstance(shape, GPTSpec):
        tokens = torch.randint(
            0, shape.vocab_size, (shape.batch_per_rank, shape.sequence_length + 1), generator=generator
        )
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    inputs = torch.randn(shape.batch_per_rank, shape.width, generator=generator)
    targets = inputs @ _target_map(shape.width) + 0.1 * torch.randn(
        shape.batch_per_rank, shape.width, generator=generator
    )
    return inputs, targets


@functools.lru_cache(maxsize=4)
def _target_map(width: int) -> torch.Tensor:
    """A fixed random linear map: a target the MLP can fit, so its loss moves."""
    return torch.randn(width, width, generator=torch.Generator().manual_seed(SEED)) / math.sqrt(width)


def trainable_parameters(model: nn.Module) -> int:
    """Ψ in the ZeRO paper: the number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
