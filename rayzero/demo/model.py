"""A small GPT (nanoGPT's shape): token + position embeddings, pre-LN blocks, a linear output head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    """Characters (ASCII)."""
    block_size: int = 64
    """Context length in characters."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream."""


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp_in = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.mlp_out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        heads = lambda t: t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_2(x))))


class CharGPT(nn.Module):
    """forward(inputs, targets) -> mean cross-entropy loss (what engine(x) returns in the demo)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self, inputs, targets)


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A GPT's forward to its mean next-token cross-entropy: token + position embeddings, the blocks,
    the final norm, the head. Any model naming those modules as CharGPT does (bench/models.py's GPT)."""
    positions = torch.arange(inputs.shape[1], device=inputs.device)
    x = model.token_embedding(inputs) + model.position_embedding(positions)
    for block in model.blocks:
        x = block(x)
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
