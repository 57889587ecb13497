"""ZeRO++'s quantized collectives over plain torch.distributed process groups (gloo and NCCL):
qwZ's int8 weight all-gather and qgZ's int4 two-stage (inside the node, then across nodes) gradient
reduce-scatter. Quantization: [Note: block quantization] in quantize.py.

[Note: quantized collectives]
Topology: the world is `num_nodes` x `local_size` ranks, a node's ranks contiguous
(global = node * local_size + local). `node_groups` builds, on every rank, the group of its node
(`intra`, group rank = local index) and the group of the ranks with its local index on every node
(`inter`, group rank = node index).

quantized_all_gather: each rank quantizes its own shard (groups never straddle two ranks' shards),
the pieces (payload and scales packed as one byte string, quantize.Layout) are all-gathered, and
every rank dequantizes every piece, its own included, so all ranks hold the same values. Bound per
element: half a step of its group, absmax/254 at 8 bits ([Note: block quantization]).

quantized_reduce_scatter (qgZ; DeepSpeed's all_to_all_quant_reduce), input rank-major (chunk k for
global rank k), output = this rank's chunk summed over all ranks (a sum: rayzero scales the loss):
  1. quantize the input chunk by chunk, ordered by destination local index (the "swizzle": the
     chunks for local peer j, one per node, side by side), straight from a strided view;
  2. all-to-all inside the node: local peer j gets the chunks for the ranks with local index j;
  3. dequantize and sum the local_size contributions in fp32 (one partial sum per node);
  4. re-quantize each partial sum; all-to-all across nodes: node n gets the partial for its rank;
  5. dequantize and sum the num_nodes partials in fp32.
With num_nodes == 1 only steps 1-3 run, with local_size == 1 only 1 and 4-5 (quantizing the input
directly); with one rank in all nothing is quantized and the output is the input.
Bound, per element of the output, with A_r the absmax of rank r's contribution in that element's
group and q = 2^(bits-1) - 1 (7 at 4 bits):
    one stage:   |error| <= sum_r A_r / (2q)
    two stages:  |error| <= sum_r A_r / q
  (the first quantization errs by A_r/(2q) per contribution; a dequantized value never exceeds its
  group's absmax (|code| <= q), so a partial sum over a node's ranks i has a group absmax of at most
  sum_i A_i, and its re-quantization errs by at most half that over q), plus fp32 rounding, plus
  the output dtype's rounding.
Differences from DeepSpeed: groups per destination chunk from `group_size_for(chunk,
QGZ_TARGET_GROUP_SIZE)` (DeepSpeed: numel / max(rows, cols, world) from a gradient's shape), padded,
so every size works: DeepSpeed falls back to a plain reduce-scatter for 1-D tensors and sizes not
divisible by 2 x world. Sums in fp32 (DeepSpeed's quant_reduce sums in fp16). A sum, where
DeepSpeed divides the cross-node sum by the number of nodes.

Bytes (all_gather_sent_bytes, reduce_scatter_sent_bytes): what one rank sends to other ranks, split
by link class, in the collectives' own terms: an all-gather delivers this rank's piece to each other
rank, an all-to-all sends each peer its block (the block a rank keeps for itself is not sent): the
logical exchange, not what a ring algorithm relays on its way. The
collectives' input buffers: all-gather `wire_bytes` on `group`; stage 1 local_size x num_nodes
pieces on `intra`; stage 2 num_nodes pieces on `inter`. Across nodes a rank sends (num_nodes - 1)
int4 pieces of ~chunk/2 bytes where a bf16 reduce-scatter sends (world - local_size) chunks of
2 x chunk bytes: 1/(4 x local_size) of it (1/32 with 8 ranks per node). Inside the node it sends
(local_size - 1) x num_nodes pieces, num_nodes/4 times what a bf16 reduce-scatter sends to those
peers: the node's links carry the pre-reduction that spares the slow ones, as ZeRO++ intends.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.engine.comm import _all_gather_flat, _Composed
from rayzero.engine.quantize import (
    Layout,
    _check_float,
    dequantize_into,
    group_size_for,
    quantize_into,
    wire_bytes,
)

QGZ_TARGET_GROUP_SIZE = 4096
"""qgZ's default elements per group, per destination chunk: DeepSpeed's comes out at a gradient's
smaller dimension (numel / max(rows, cols)), 4096 for the 4096-wide layers of a 7B model."""


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two groups of the num_nodes x local_size world ([Note: quantized collectives])."""

    intra: dist.ProcessGroup
    """The ranks of this rank's node; group rank = local index."""
    inter: dist.ProcessGroup
    """The ranks with this rank's local index, one per node; group rank = node index."""
    num_nodes: int
    local_size: int


def node_groups(world_size: int, local_size: int, backend: str | None = None,
                timeout: datetime.timedelta | None = None) -> NodeGroups:
    """Create the intra-node and inter-node groups of every rank. Collective: every rank of the
    default group must call it, with the same arguments and in the same order relative to every
    other group creation, because torch's new_group must be entered by all ranks for every group
    (this creates all num_nodes node groups, then all local_size cross-node groups, in rank order,
    through torch's new_subgroups_by_enumeration, which calls new_group for each). The same groups as
    torch's init_device_mesh(device, (num_nodes, local_size), mesh_dim_names=("node", "local")):
    intra is its get_group("local"), inter its get_group("node"); either can be passed to the
    collectives, as long as group rank = local index (intra) and = node index (inter)."""
    if not dist.is_initialized():
        raise ValueError("node_groups needs an initialised default process group (init_process_group)")
    if world_size != dist.get_world_size():
        raise ValueError(f"world_size={world_size} but the default process group has "
                         f"{dist.get_world_size()} ranks: pass dist.get_world_size()")
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size={local_size} does not divide world_size={world_size}: pass the "
                         f"number of ranks per node (every node must have as many)")
    nodes = world_size // local_size
    intra, _ = dist.new_subgroups_by_enumeration(
        [[node * local_size + local for local in range(local_size)] for node in range(nodes)],
        timeout=timeout, backend=backend)
    inter, _ = dist.new_subgroups_by_enumeration(
        [[node * local_size + local for node in range(nodes)] for local in range(local_size)],
        timeout=timeout, backend=backend)
    return NodeGroups(intra, inter, nodes, local_size)


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """A world of one without a process group (single-process use)."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@torch.no_grad()
def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                         bits: int = 8, group_size: int | None = None, async_op: bool = False):
    """Every rank's `shard`, quantized, into its slice of `output` (rank order, as
    all_gather_into_tensor), dequantized to output's dtype. `shard` may be this rank's slice of
    `output`. async_op: returns a handle whose `wait()` finishes the gather (the dequantization
    runs there); otherwise None. [Note: quantized collectives]"""
    world, _ = _size_and_rank(group)
    _check_float("shard", shard)
    _check_float("output", output)
    if output.numel() != world * shard.numel() or not output.is_contiguous():
        raise ValueError(f"output must be contiguous with world size x shard elements = {world} x "
                         f"{shard.numel()}, got {output.numel()} (contiguous={output.is_contiguous()})")
    layout = Layout(shard.numel(), bits, group_size_for(shard.numel()) if group_size is None else group_size)
    piece = torch.empty(layout.piece_bytes, dtype=torch.uint8, device=shard.device)
    quantize_into(shard.reshape(-1), layout, *layout.split(piece))
    if world == 1:
        pieces, works = piece.view(1, -1), []
    else:
        pieces = torch.empty(world, layout.piece_bytes, dtype=torch.uint8, device=shard.device)
        works = [_all_gather_flat(pieces.view(-1), piece, group=group, async_op=True)]
    handle = _Composed(works, lambda: dequantize_into(*layout.split(pieces), layout, output.view(world, -1)))
    if async_op:
        return handle
    handle.wait()
    return None


@torch.no_grad()
def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, intra_group: dist.ProcessGroup | None,
                             inter_group: dist.ProcessGroup | None, *, bits: int = 4,
                             group_size: int | None = None) -> None:
    """output = this rank's chunk of the rank-major `input`, summed over every rank, through qgZ's
    quantized two-stage all-to-all ([Note: quantized collectives]). `intra_group`/`inter_group`:
    `node_groups`' intra and inter (None: a group of one). Sums in fp32."""
    local_size, _ = _size_and_rank(intra_group) if intra_group is not None else (1, 0)
    nodes, _ = _size_and_rank(inter_group) if inter_group is not None else (1, 0)
    _check_float("input", input)
    _check_float("output", output)
    chunk = output.numel()
    if input.numel() != nodes * local_size * chunk or not input.is_contiguous():
        raise ValueError(f"input must be contiguous with (nodes x local ranks) x output elements = "
                         f"{nodes} x {local_size} x {chunk}, got {input.numel()} "
                         f"(contiguous={input.is_contiguous()})")
    if nodes * local_size == 1:
        output.copy_(input.view_as(output))
        return
    size = group_size_for(chunk, QGZ_TARGET_GROUP_SIZE) if group_size is None else group_size
    layout = Layout(chunk, bits, size)
    chunks = input.view(nodes, local_size, chunk)  # [node, local]: global rank node * local_size + local
    if local_size > 1:
        # Rows per destination local index, nodes side by side: the swizzle, as a view.
        partials = _exchange_and_sum(chunks.transpose(0, 1), layout, intra_group)  # [node, padded]
        if nodes == 1:
            output.copy_(partials[0, :chunk].view_as(output))
            return
        # The partial sums are padded with zeros to whole groups: quantize them as they are.
        layout, rows = Layout(layout.padded_numel, bits, size), partials
    else:
        rows = chunks[:, 0, :]
    total = _exchange_and_sum(rows.unsqueeze(1), layout, inter_group)
    output.copy_(total[0, :chunk].view_as(output))


def _exchange_and_sum(rows: torch.Tensor, layout: Layout, group: dist.ProcessGroup) -> torch.Tensor:
    """rows (peers, m, numel): rows[p] for group rank p. Quantize, all-to-all, and sum what the
    peers sent in fp32: (m, padded_numel), padding zero."""
    peers, per_peer = rows.shape[0], rows.shape[1]
    send = torch.empty(peers, per_peer, layout.piece_bytes, dtype=torch.uint8, device=rows.device)
    quantize_into(rows, layout, *layout.split(send))
    received = torch.empty_like(send)
    dist.all_to_all_single(received.view(-1), send.view(-1), group=group)
    padded = Layout(layout.padded_numel, layout.bits, layout.group_size)  # same bytes; padding -> 0
    total = torch.empty(per_peer, layout.padded_numel, dtype=torch.float32, device=rows.device)
    for peer in range(peers):  # a fixed order: the same sums on every run
        dequantize_into(*padded.split(received[peer]), padded, total, accumulate=peer > 0)
    return total


@dataclass(frozen=True)
class SentBytes:
    """Bytes one rank sends to other ranks in one call, by link class ([Note: quantized collectives])."""

    intra_node: int
    inter_node: int

    @property
    def total(self) -> int:
        return self.intra_node + self.inter_node


def all_gather_sent_bytes(shard_numel: int, world_size: int, local_size: int | None = None, *, bits: int = 8,
                          group_size: int | None = None) -> SentBytes:
    """quantized_all_gather over a group of `world_size` ranks, `local_size` per node (None: all on
    one node, e.g. hpZ's secondary group): this rank's piece to each other rank."""
    local = world_size if local_size is None else local_size
    if local < 1 or world_size % local:
        raise ValueError(f"local_size={local_size} does not divide world_size={world_size}")
    piece = wire_bytes(shard_numel, bits, group_size)
    return SentBytes((local - 1) * piece, (world_size - local) * piece)


def reduce_scatter_sent_bytes(chunk_numel: int, num_nodes: int, local_size: int, *, bits: int = 4,
                              group_size: int | None = None) -> SentBytes:
    """quantized_reduce_scatter with `chunk_numel` output elements: stage 1 sends each of the
    local_size - 1 local peers num_nodes pieces, stage 2 each of the num_nodes - 1 other nodes one."""
    if num_nodes * local_size == 1:
        return SentBytes(0, 0)
    size = group_size_for(chunk_numel, QGZ_TARGET_GROUP_SIZE) if group_size is None else group_size
    piece = wire_bytes(chunk_numel, bits, size)
    return SentBytes((local_size - 1) * num_nodes * piece, (num_nodes - 1) * piece)
