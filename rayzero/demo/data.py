"""The demo's text: the Python standard library's own source files, found offline via sysconfig.

Deterministic: the top-level `*.py` files of the stdlib directory in sorted name order, concatenated
until `max_chars`. Characters are bytes 0-127 (ASCII); anything else becomes `?`, so the vocabulary
is fixed at 128 and needs no tokenizer file.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from rayzero.config.errors import RayZeroValueError

VOCAB_SIZE = 128
_UNKNOWN = ord("?")


def stdlib_text(max_chars: int = 1_000_000) -> tuple[str, list[str]]:
    """(text, file names used). Raises FileNotFoundError if the stdlib sources are not installed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no Python source files in {stdlib}; the demo trains on them (install the full Python, "
            "not a stripped one)"
        )
    pieces: list[str] = []
    used: list[str] = []
    total = 0
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        pieces.append(text)
        used.append(file.name)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(pieces)[:max_chars], used


def encode(text: str) -> torch.Tensor:
    """Characters to ids 0..127 (uint8 storage keeps a 1M-char corpus at 1 MB)."""
    raw = bytearray(text.encode("ascii", errors="replace"))
    ids = torch.frombuffer(raw, dtype=torch.uint8).clone()
    ids[ids >= VOCAB_SIZE] = _UNKNOWN
    return ids


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.to(torch.uint8).tolist()).decode("ascii", errors="replace")


class BatchSampler:
    """Random windows of `block_size + 1` characters; each rank draws from its own seeded stream."""

    def __init__(self, ids: torch.Tensor, block_size: int, batch_size: int, seed: int) -> None:
        if ids.numel() <= block_size + 1:
            raise RayZeroValueError(f"the corpus ({ids.numel()} chars) is shorter than block_size+1={block_size + 1}")
        self._ids = ids
        self._block = block_size
        self._batch = batch_size
        self._generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self._ids.numel() - self._block - 1, (self._batch,), generator=self._generator)
        offsets = torch.arange(self._block + 1)
        windows = self._ids[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self._generator.get_state().tolist()}  # plain ints: JSON-safe client state

    def load_state_dict(self, state: dict) -> None:
        self._generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
