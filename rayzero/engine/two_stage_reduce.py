"""A gradient reduce-scatter across nodes on gloo: inside each node, then across nodes.

[Note: two-stage reduce-scatter on gloo]
gloo has no reduce-scatter of its own: torch runs `reduce_scatter_tensor` on gloo as an all-reduce of
the whole input followed by a copy of the rank's slice (measured on 4 ranks: 6.0 bytes on the wire
per input byte, the all-reduce's 6.0; an all-gather 3.0). Inside one machine that costs little
(loopback), and [Note: gloo's temporary copies] in comm.py even chooses the all-reduce for large
tensors. Across nodes it puts twice the reduce-scatter's volume on the slow link: on an emulated
cluster of 2 nodes x 2 ranks it was half of flat ZeRO-3's inter-node bytes (bench/multinode.py).

So a stage-3 reduction whose group spans nodes (equal ranks per node, each node's ranks consecutive)
runs on gloo as two equal-split all-to-alls, the structure of qgZ's reduction ([Note: quantized
collectives] in quantized_comm.py) without the quantization:
  1. inside the node: local peer j receives, from every rank of its node, the chunks of the ranks
     with local index j (one per node), and sums them: one partial sum per node;
  2. across nodes, between the ranks of one local index: node n receives the partial for its rank,
     and sums the num_nodes partials.
A rank sends (local - 1) x nodes chunks inside its node and (nodes - 1) chunks across, where a flat
reduce-scatter sends (world - local) chunks across (and gloo's all-reduce twice that): on 2 x 2,
cross-node bytes of the reduction fall to a third of gloo's. Sums run in fp32 and the partial is
carried in the reduce dtype (one more rounding than a single sum for bf16 and fp16; none for fp32
beyond the order of the additions). Temporaries are bounded: the columns go in blocks of at most
BLOCK_ELEMENTS elements of the full tensor (a send and a receive buffer of that size per stage).
The collectives are counted as the reduce-scatters they are, one per group ([Note: bytes per link
class] in comm.py), which is also what they put on the wire. NCCL keeps its own reduce-scatter.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from rayzero.engine.comm import Communicator, _Done

BLOCK_ELEMENTS = 1 << 21
"""Elements of the full tensor reduced per round: temporaries of 8 MiB of fp32 per buffer at most."""


class ThreadWork:
    """A Work for a reduction running on the reducer's own thread: its collectives are on process
    groups of their own ([Note: stage 3 bucket plan] in stage3/gradients.py), so the backward's
    gathers on the main thread go on meanwhile, as with `overlap_comm` they do beside an async
    reduce-scatter. No torch future: the stall watch waits on a thread of its own instead."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self):
        raise RuntimeError("a reduction on the reducer's thread has no torch future")


def two_stage_reduce_scatter(output: torch.Tensor, input: torch.Tensor, inside: Communicator,
                             across: Communicator, executor: ThreadPoolExecutor | None = None):
    """output = this rank's chunk of the rank-major `input` (global rank node * local + local index),
    summed over every rank of `inside` x `across` ([Note: two-stage reduce-scatter on gloo]).
    Counted now; run now (a completed Work) or, given `executor`, on its thread (a ThreadWork)."""
    local, nodes, chunk = inside.world_size, across.world_size, output.numel()
    if input.numel() != nodes * local * chunk or not input.is_contiguous():
        raise ValueError(f"input must be contiguous with (nodes x local ranks) x output elements = "
                         f"{nodes} x {local} x {chunk}, got {input.numel()}")
    if local > 1:
        inside.count("reduce_scatter", input)
    if nodes > 1:
        across.count("reduce_scatter", input, elements=nodes * chunk, wire_bytes=nodes * chunk * input.element_size())
    if executor is None:
        _reduce(output, input, inside, across)
        return _Done()
    return ThreadWork(executor.submit(_reduce, output, input, inside, across))


@torch.no_grad()
def _reduce(output: torch.Tensor, input: torch.Tensor, inside: Communicator, across: Communicator) -> None:
    local, nodes, chunk = inside.world_size, across.world_size, output.numel()
    chunks = input.view(nodes, local, chunk)
    flat_out = output.view(-1)
    width = max(1, min(chunk, BLOCK_ELEMENTS // (nodes * local)))
    for start in range(0, chunk, width):
        end = min(chunk, start + width)
        block = chunks[:, :, start:end]
        partial = _exchange_and_sum(block.transpose(0, 1), inside) if local > 1 else block[:, 0, :].float()
        if nodes > 1:
            partial = _exchange_and_sum(partial.to(input.dtype).unsqueeze(1), across)
        flat_out[start:end].copy_(partial.view(-1))


def _exchange_and_sum(rows: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """rows (peers, m, w): rows[p] goes to group rank p. All-to-all, then the sum in fp32 of what
    the peers sent, in group-rank order (the same sums on every run): (m, w)."""
    send = rows.contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received.view(-1), send.view(-1), group=comm.group)
    del send
    total = received[0].float()  # fp32 input: a view of `received`, which is ours to overwrite
    for peer in range(1, received.shape[0]):
        total.add_(received[peer])
    return total
