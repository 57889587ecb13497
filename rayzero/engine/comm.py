"""The one place the engine calls collectives: works on gloo and NCCL, counts every element sent.

[Note: communication accounting]
Each call records, under its kind, the number of calls, the elements of the *full* tensor the
collective is about and the bytes of those elements, plus `volume_elements` in the ZeRO paper's
unit (what one rank sends per element of the full tensor, times the full tensor's size):
  - reduce_scatter of Ψ elements (input)      -> Ψ
  - all_gather producing Ψ elements (output)  -> Ψ
  - all_reduce of Ψ elements                  -> 2Ψ (it is a reduce-scatter plus an all-gather)
  - broadcast of Ψ elements                   -> Ψ
so a ZeRO stage 0-2 step totals 2Ψ and stage 3 totals 3Ψ, Ψ = trainable elements (+ padding of at
most world_size - 1 per bucket). One-element syncs (overflow flag, gradient norm) are counted under
`control` so they never blur that comparison. `begin_step()` closes the current step's counters;
`last_step()` is what `engine.comm_stats()` returns. The counts are of the logical collective, also
where gloo runs it as others ([Note: gloo's temporary copies]).

[Note: bytes per link class]
Each count also splits the bytes *this rank sends* between links inside its node and links to other
nodes ([Note: topology] in topology.py says how nodes are known). The model is the collective's
point-to-point content, whatever algorithm the backend picks: in a group of G ranks
  - all_gather producing T bytes, reduce_scatter of T bytes, all_to_all of T bytes: T/G to each peer;
  - all_reduce (and control) of T bytes: 2T/G to each peer (a reduce-scatter plus an all-gather);
  - broadcast of T bytes: T to each peer from the source, nothing from the others;
and each peer's share goes to `intra_node_bytes` or `inter_node_bytes` by where the peer runs. A
quantized collective counts the bytes it puts on the wire (payload and scales), and the elements of
the tensor it stands for. This is what the ZeRO++ paper counts; a ring or tree moves the same total
per rank but routes it differently, so the emulated cluster's interface counters (bench/multinode.py)
are reported beside it, not instead of it. Subgroup communicators (`split`) share one set of
counters with the communicator they came from, so `last_step()` is the rank's whole traffic.

[Note: gloo's temporary copies]
On gloo (CPU training), torch's flat reduce-scatter and all-gather each allocate a temporary as
large as the full tensor: measured with VmHWM on 2 ranks (torch 2.13), a 16 MiB reduce-scatter
raised the peak by 16 MiB more than an in-place all-reduce of the same tensor, a 16 MiB all-gather
by 16 MiB more than one broadcast per rank into the output's slices. Stage 3 runs both on
every large parameter, and those copies were a sixth of its peak above the empty process. So, on
gloo, for tensors of at least GLOO_DIRECT_MIN_ELEMENTS:
  - all_gather is one broadcast per rank, each into that rank's slice of `output`;
  - reduce_scatter, when the caller says its input is scratch, is an in-place all-reduce of the
    input followed by a copy of this rank's slice into `output`.
Same sums (gloo reduces the same elements across the same ranks), same bytes. They were also no
slower there: 32 MiB on 2 ranks, reduce-scatter 38 ms -> 20 ms, all-gather 22 ms -> 11 ms (min of
15). Below the threshold gloo's per-call latency dominates and its own collectives are faster.
NCCL allocates nothing of the kind and keeps its own collectives. Across nodes, stage 3's gradient
reductions on gloo do not come here: [Note: two-stage reduce-scatter on gloo] in two_stage_reduce.py.
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rayzero.checkpoint.comm import note_process_group_used
from rayzero.config.environment import COLLECTIVE_TIMEOUT_S
from rayzero.engine.topology import Topology

# [Note: gloo's temporary copies]: from this many elements (8 MiB of fp32) of the full tensor.
GLOO_DIRECT_MIN_ELEMENTS = 1 << 21

# Volume multiplier per kind, see [Note: communication accounting].
_VOLUME = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1, "control": 2}
# Bytes sent to each peer per byte of the counted tensor, times the group size ([Note: bytes per link class]).
_PER_PEER = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "control": 2}

# torch 2.13 renamed the flat-tensor collectives (the old names warn FutureWarning on every call);
# pyproject allows torch >= 2.4, which has only the old names. Same signatures, same semantics.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class KindStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    volume_elements: int = 0
    intra_node_bytes: int = 0
    """Bytes this rank sent to ranks on its own node ([Note: bytes per link class])."""
    inter_node_bytes: int = 0
    """Bytes this rank sent to ranks on other nodes."""

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "elements": self.elements, "bytes": self.bytes,
                "volume_elements": self.volume_elements, "intra_node_bytes": self.intra_node_bytes,
                "inter_node_bytes": self.inter_node_bytes}

    def add(self, other: KindStats) -> None:
        for name in ("calls", "elements", "bytes", "volume_elements", "intra_node_bytes", "inter_node_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Traffic:
    """The counters of one rank, shared by a communicator and the subgroups split from it."""

    def __init__(self) -> None:
        self.current: dict[str, KindStats] = defaultdict(KindStats)
        self.last: dict[str, KindStats] = {}


class _Done:
    """Stands in for a Work handle when no collective ran (world size 1) or one already finished."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Composed:
    """A Work for a collective built from others ([Note: gloo's temporary copies]): complete when all
    of `works` are, then `after()` runs once, on the first `wait`."""

    def __init__(self, works: list, after: Callable[[], None] | None = None) -> None:
        self._works = works
        self._after = after

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return True

    def is_completed(self) -> bool:
        return self._after is None and all(work.is_completed() for work in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])


class Communicator:
    """Collectives over one process group, counted per kind.

    With world size 1 (or no process group) every collective is the identity and is still counted,
    so single-process runs report the same traffic figures as the math predicts... minus the
    network. That keeps the engine free of `if world_size == 1` branches.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, topology: Topology | None = None,
                 traffic: Traffic | None = None) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if initialized:
            note_process_group_used()  # [Note: gloo at interpreter exit]
        # Without a process group the engine runs as a world of one (unit tests, notebooks).
        self.group = (group or dist.group.WORLD) if initialized else None
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        # The global rank of each member, in group order (peers for [Note: bytes per link class]).
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(self.group)) if initialized else (0,)
        # Which global ranks share a node; until `discover_topology`, one node (all links intra-node).
        self.topology = topology or Topology.single(max(self.ranks) + 1)
        # NCCL gathers in place when the input is this rank's slice of the output; gloo needs a copy.
        self.in_place_gather = initialized and dist.get_backend(self.group) == "nccl"
        self.gloo = initialized and dist.get_backend(self.group) == "gloo"
        self.traffic = traffic or Traffic()

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def discover_topology(self) -> Topology:
        """Learn every rank's node ([Note: topology]); every rank of the world must call it."""
        self.topology = Topology.discover(self.group)
        return self.topology

    def split(self, partition: list[list[int]], fresh: bool = False) -> Communicator:
        """The communicator of this rank's part of `partition` (lists of global ranks covering the
        world, each in the order its members take ranks), counted with this one's traffic. This one
        itself when its part is all of this group, unless `fresh`: then always new process groups
        (a queue of collectives of their own). A collective call: every rank of the world calls it
        with the same partition, in the same order as any other `split`."""
        if self.group is None:
            return self
        mine = next(ranks for ranks in partition if self.global_rank in ranks)
        if list(mine) == list(self.ranks) and not fresh:
            return self
        group, _ = dist.new_subgroups_by_enumeration(
            partition, backend=dist.get_backend(self.group), timeout=_timeout())
        return Communicator(group, topology=self.topology, traffic=self.traffic)

    # ---- accounting -------------------------------------------------------------------------
    def count(self, kind: str, tensor: torch.Tensor, *, elements: int | None = None,
               wire_bytes: int | None = None, source: int | None = None, runs_as: str | None = None) -> None:
        """Count one collective about `tensor` ([Note: communication accounting]). A quantized
        collective passes the `elements` of the tensor it stands for and the `wire_bytes` it sends;
        `source`: a broadcast's root (group rank); `runs_as`: the kind whose traffic it really has
        ([Note: gloo's temporary copies]: a reduce-scatter run as an all-reduce sends twice as much)."""
        stats = self.traffic.current[kind]
        sent = tensor.numel() * tensor.element_size() if wire_bytes is None else wire_bytes
        elements = tensor.numel() if elements is None else elements
        stats.calls += 1
        stats.elements += elements
        stats.bytes += sent
        stats.volume_elements += _VOLUME[kind] * elements
        if self.world_size == 1:
            return
        if kind == "broadcast":
            per_peer = sent if source == self.rank else 0
        else:
            per_peer = _PER_PEER[runs_as or kind] * sent // self.world_size
        inside, outside = self.topology.split_peers(self.global_rank, self.ranks)
        stats.intra_node_bytes += per_peer * inside
        stats.inter_node_bytes += per_peer * outside

    def begin_step(self) -> None:
        """Close the counters of the step that just ended; start counting the next one."""
        self.traffic.last = dict(self.traffic.current)
        self.traffic.current = defaultdict(KindStats)

    def discard_current(self) -> None:
        """Forget traffic that belongs to no training step (initial broadcasts, checkpoint loads)."""
        self.traffic.current = defaultdict(KindStats)

    def last_step(self) -> dict[str, dict[str, int]]:
        """Per kind, plus `total` over the data-moving kinds (control excluded)."""
        out = {kind: stats.as_dict() for kind, stats in sorted(self.traffic.last.items())}
        total = KindStats()
        for kind, stats in self.traffic.last.items():
            if kind != "control":
                total.add(stats)
        out["total"] = total.as_dict()
        return out

    # ---- collectives ------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum `tensor` in place across ranks."""
        self.count("all_reduce", tensor)
        if not self.distributed:
            return _Done() if async_op else None
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       scratch: bool = False):
        """Sum `input` across ranks; rank r receives the r-th equal slice into `output`. `scratch`:
        the caller no longer needs `input`, which may then hold anything afterwards."""
        assert input.numel() == output.numel() * self.world_size, "reduce_scatter needs equal splits"
        direct = scratch and self._gloo_direct(input) and input.is_contiguous()
        self.count("reduce_scatter", input, runs_as="all_reduce" if direct else None)
        if not self.distributed:
            output.copy_(input)
            return _Done() if async_op else None
        group = self.group
        if direct:
            # [Note: gloo's temporary copies]
            mine = input.view(self.world_size, -1)[self.rank]
            work = _Composed([dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)],
                             lambda: output.copy_(mine.view(output.shape)))
            return _finish(work, async_op)
        return _reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's `input` into `output` (rank order)."""
        assert output.numel() == input.numel() * self.world_size, "all_gather needs equal splits"
        self.count("all_gather", output)
        if not self.distributed:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return _Done() if async_op else None
        if self._gloo_direct(output) and output.is_contiguous():
            # [Note: gloo's temporary copies]
            slices = output.view(self.world_size, -1)
            if input.data_ptr() != slices[self.rank].data_ptr():
                slices[self.rank].copy_(input.view(-1))
            work = _Composed([dist.broadcast(piece, src=dist.get_global_rank(self.group, rank), group=self.group,
                                             async_op=True) for rank, piece in enumerate(slices)])
            return _finish(work, async_op)
        if not self.in_place_gather and _overlaps(input, output):
            # `input` is this rank's slice of `output` (in-place gather). NCCL handles that; gloo
            # copies input into output first, which is a self-copy — clone to keep it defined.
            input = input.clone()
        return _all_gather_flat(output, input, group=self.group, async_op=async_op)

    def _gloo_direct(self, full: torch.Tensor) -> bool:
        return self.gloo and full.device.type == "cpu" and full.numel() >= GLOO_DIRECT_MIN_ELEMENTS

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   wire_bytes: int | None = None, elements: int | None = None):
        """Equal-split all-to-all: rank r's j-th slice of `input` becomes rank j's r-th slice of
        `output`. `wire_bytes` / `elements`: what to count when `input` stands for another tensor
        (a quantized payload: [Note: bytes per link class])."""
        self.count("all_to_all", input, elements=elements, wire_bytes=wire_bytes)
        if not self.distributed:
            output.copy_(input)
            return _Done() if async_op else None
        return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.count("broadcast", tensor, source=src)
        if self.distributed:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)

    def all_reduce_control(self, tensor: torch.Tensor, op: str = "sum",
                           waiter: Callable[[Any], None] | None = None) -> torch.Tensor:
        """A small synchronisation (overflow flag, norm): `op` is `sum` or `max`. A sync point;
        `waiter(work)` waits for it instead of a plain wait when given."""
        self.count("control", tensor)
        if self.distributed:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=waiter is not None)
            if waiter is not None:
                waiter(work)
        return tensor


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S.get())


def _finish(work: _Composed, async_op: bool) -> _Composed | None:
    if async_op:
        return work
    work.wait()
    return None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end
