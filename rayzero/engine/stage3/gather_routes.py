"""How a stage-3 parameter all-gather travels: the group it spans and what it carries.

A route gathers one piece per member into an output laid out member-major (`size` rows), exactly
as `all_gather_into_tensor` does, and returns a Work. [Note: stage-3 layouts] (layout.py) says
which route each gather takes:
  - `Direct`: one all-gather over a communicator (the shard group, or hpZ's secondary group);
  - `Hierarchical`: MiCS's two-stage gather over a shard group spanning nodes;
  - `Quantized`: qwZ's int8 blocks over a communicator ([Note: quantized collectives] in
    quantized_comm.py), its `exact` twin for gathers that must not round (closing, consolidating).

[Note: hierarchical gather]
A shard group of A nodes x L ranks: rank (node j, local l) holds shard j*L + l. Stage one gathers
across nodes between the ranks of local index l (A pieces: shards l, L + l, ...); stage two gathers
those A pieces inside the node (L x A pieces), which a transpose puts in shard order. Each piece
crosses the slow link to A - 1 ranks instead of (A - 1) * L. The second stage starts when the
first is waited on, so it is not overlapped with compute (MiCS overlaps it on a second stream).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from rayzero.engine.comm import Communicator
from rayzero.engine.comm import _all_gather_flat, _Composed
from rayzero.engine.quantize import Layout, dequantize_into, group_size_for
from rayzero.engine.quantized_comm import quantized_all_gather

WEIGHT_BITS = 8
"""qwZ's weights travel as int8 blocks (DeepSpeed's CUDAQuantizer: 8 bits, symmetric)."""
WEIGHT_BLOCK = 512
"""qwZ's target elements per block. DeepSpeed's CUDAQuantizer aims at 8000 (a kernel's sweet spot);
finer blocks err less, at 4 bytes of scale per block (0.8% more bytes at 512). The demo GPT of
tests/dist/test_zeropp_gpt.py (width 128, 200 steps, 2 nodes x 2) ended its held-out loss +0.7%
(qwZ) and +1.1% (hpZ+qwZ+qgZ) from flat ZeRO-3's with blocks of 8000, +0.5% / +0.7% with 2048, and
-0.1% / +0.2% with 512."""


class GatherRoute(Protocol):
    size: int
    """Members contributing a piece: rows of the output."""

    def all_gather(self, output: torch.Tensor, piece: torch.Tensor) -> Any:
        """Start gathering every member's `piece` into `output` (size x piece.numel()); a Work."""


class Direct:
    """One all-gather over `comm`."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.size = comm.world_size

    def all_gather(self, output: torch.Tensor, piece: torch.Tensor) -> Any:
        return self.comm.all_gather(output, piece, async_op=True)


class _Then:
    """A Work that runs `after` once `first` completes (on the first wait)."""

    def __init__(self, first: Any, after: Callable[[], None]) -> None:
        self._first = first
        self._after: Callable[[], None] | None = after

    def wait(self) -> bool:
        self._first.wait()
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return True

    def is_completed(self) -> bool:
        return self._after is None

    def get_future(self) -> torch.futures.Future:
        """The first stage's future (the stall watch waits on it; `wait` then runs the rest)."""
        return self._first.get_future()


class Hierarchical:
    """[Note: hierarchical gather]: across nodes (same local index), then inside the node."""

    def __init__(self, across: Communicator, inside: Communicator) -> None:
        self.across = across
        self.inside = inside
        self.size = across.world_size * inside.world_size

    def all_gather(self, output: torch.Tensor, piece: torch.Tensor) -> Any:
        nodes, local, width = self.across.world_size, self.inside.world_size, piece.numel()
        staged = torch.empty(nodes * width, dtype=output.dtype, device=output.device)
        first = self.across.all_gather(staged, piece.to(output.dtype), async_op=True)

        def second() -> None:
            by_local = torch.empty(local * nodes * width, dtype=output.dtype, device=output.device)
            self.inside.all_gather(by_local, staged)
            output.view(nodes, local, width).copy_(by_local.view(local, nodes, width).transpose(0, 1))

        return _Then(first, second)


class Quantized:
    """qwZ: each member's piece travels as int8 blocks and their fp32 scales, and every member
    dequantizes every piece (its own too, so all hold the same values)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.size = comm.world_size
        self.exact = Direct(comm)

    def all_gather(self, output: torch.Tensor, piece: torch.Tensor) -> Any:
        layout = Layout(piece.numel(), WEIGHT_BITS, group_size_for(piece.numel(), WEIGHT_BLOCK))
        self.comm.count("all_gather", output, wire_bytes=layout.piece_bytes * self.size)
        return quantized_all_gather(output, piece, self.comm.group, bits=WEIGHT_BITS,
                                    group_size=layout.group_size, async_op=True)


def stored_layout(numel: int) -> Layout:
    """How a frozen parameter's shard of `numel` padded elements is stored quantized."""
    return Layout(numel, WEIGHT_BITS, group_size_for(numel, WEIGHT_BLOCK))


class Stored:
    """zero_quantized_nontrainable_weights: shards kept as int8 blocks travel as they are stored (no
    second quantization) and are dequantized on arrival; DeepSpeed gathers them quantized too."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.size = comm.world_size

    def all_gather(self, output: torch.Tensor, piece: torch.Tensor) -> Any:
        layout = stored_layout(output.numel() // self.size)
        self.comm.count("all_gather", output, wire_bytes=layout.piece_bytes * self.size)
        pieces = torch.empty(self.size, layout.piece_bytes, dtype=torch.uint8, device=output.device)
        if self.comm.distributed:
            works = [_all_gather_flat(pieces.view(-1), piece, group=self.comm.group, async_op=True)]
        else:
            pieces[0].copy_(piece)
            works = []
        return _Composed(works, lambda: dequantize_into(*layout.split(pieces), layout, output.view(self.size, -1)))
