"""Stage 3 beyond one node: which ranks share a copy of the parameters, and how each gather travels.

[Note: stage-3 layouts]
Flat ZeRO-3 shards every parameter over all W ranks: every forward and backward all-gather and
every gradient reduce-scatter spans the world, so across nodes a step is bound by the slowest link.
DeepSpeed's answers are policies over process groups of the same ranks, chosen by config
(`Stage3Layout.build`), never branches in the stage code:
  - MiCS (`mics_shard_size: K`): parameters, gradients and optimizer state are sharded over groups of
    K consecutive ranks (the *shard group*) and replicated across the W/K groups. Gathers stay in the
    shard group; each gradient bucket is reduce-scattered in the shard group, then its shard is
    all-reduced across the ranks holding the same shard (the *replica group*). With
    `mics_hierarchical_params_gather` and a shard group spanning nodes, a gather goes first across
    nodes between ranks of the same local index, then inside each node ([Note: hierarchical gather]
    in gather_routes.py), so each piece crosses the slow link once per node instead of once per rank.
    DeepSpeed 0.19 removed MiCS (its config refuses the keys); this follows its 0.18 MiCS_Init and
    the MiCS paper (Zhang et al., VLDB 2022).
  - hpZ (`zero_hpz_partition_size: K`): parameters stay sharded over the world (the primary
    partition: the optimizer's and the checkpoint's layout), and when a parameter is released after
    its forward, its gathered values are kept as a *secondary* shard over the K consecutive ranks of
    the rank's hpZ group (1/K of it per rank). The backward all-gather reads the secondary shards, so
    it stays inside the group (a node, when K is the ranks per node). Secondaries of trainable
    parameters expire at the optimizer step; frozen parameters keep theirs (DeepSpeed does the same).
  - qwZ (`zero_quantized_weights`): every parameter all-gather carries int8 blocks and their scales
    instead of the compute dtype ([Note: block quantization] in quantize.py); with
    `zero_quantized_nontrainable_weights`, frozen parameters are also *stored* quantized.
  - qgZ (`zero_quantized_gradients`): a bucket's reduce-scatter becomes DeepSpeed's two-stage int4
    all-to-all: inside each node, then across nodes between ranks of the same local index.
Each group follows node boundaries (`Topology.groups_fit_nodes`) or is refused before training.
Whatever the layout, on gloo a gradient reduction whose group spans nodes runs in two stages, inside
the node and then across ([Note: two-stage reduce-scatter on gloo] in two_stage_reduce.py): gloo's own
reduce-scatter is an all-reduce, twice the bytes on the slow link. NCCL keeps its reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from rayzero.config.errors import RayZeroValueError
from rayzero.config.layouts import effective_size
from rayzero.engine.comm import Communicator
from rayzero.engine.stage3.gather_routes import Direct, GatherRoute, Hierarchical, Quantized
from rayzero.engine.topology import Topology


def consecutive(world_size: int, size: int) -> list[list[int]]:
    """[[0..size-1], [size..2*size-1], ...]: groups of `size` consecutive ranks."""
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def strided(world_size: int, size: int) -> list[list[int]]:
    """The ranks at the same position of every group of `size` consecutive ranks."""
    return [list(range(offset, world_size, size)) for offset in range(size)]


@dataclass(frozen=True)
class LayoutChoice:
    """What the config asks for, before any process group exists (pure: unit-tested)."""

    mics_shard_size: int = 0
    """Ranks per MiCS shard group; 0 = the world (flat or hpZ)."""
    hierarchical_gather: bool = False
    hpz_size: int = 1
    """Ranks per hpZ secondary partition; 1 = none."""
    quantize_weights: bool = False
    quantize_frozen_weights: bool = False
    quantize_gradients: bool = False

    @classmethod
    def from_config(cls, zero: Any) -> LayoutChoice:
        mics = int(zero.mics_shard_size)
        return cls(
            mics_shard_size=mics if mics > 0 else 0,
            hierarchical_gather=bool(zero.mics_hierarchical_params_gather) and mics > 0,
            hpz_size=max(1, int(zero.zero_hpz_partition_size)),
            quantize_weights=bool(zero.zero_quantized_weights),
            quantize_frozen_weights=bool(zero.zero_quantized_nontrainable_weights),
            quantize_gradients=bool(zero.zero_quantized_gradients),
        )

    @property
    def flat(self) -> bool:
        return self == LayoutChoice()

    def problems(self, topology: Topology) -> list[str]:
        """Why this choice cannot run on `topology` (empty: it can)."""
        world = topology.world_size
        out = []
        two_stage = self.quantize_gradients or self.hierarchical_gather
        if two_stage and len(set(topology.node_sizes())) > 1:
            key = "zero_quantized_gradients" if self.quantize_gradients else "mics_hierarchical_params_gather"
            out.append(f"zero_optimization.{key} needs the same number of ranks on every node, and this run has "
                       f"{topology.describe()}: run as many workers on each node, or turn {key} off")
        for key, asked in (("mics_shard_size", self.mics_shard_size), ("zero_hpz_partition_size", self.hpz_size)):
            size = effective_size(key, asked, world)  # hpZ: min(K, world), as DeepSpeed's groups
            if size <= 1:
                continue
            if world % size:
                out.append(f"zero_optimization.{key}={asked} does not divide the world size {world}: use a "
                           f"divisor of {world} (the ranks per node, {topology.node_sizes()[0]}, usually), or "
                           f"run a multiple of {size} workers")
            elif not topology.contiguous():
                out.append(f"zero_optimization.{key}={asked} needs each node's ranks to be consecutive, and "
                           f"they are not (node of each rank: {list(topology.node_of)}): start the ranks "
                           "node by node (rayzero's workers and torchrun do)")
            else:
                split = topology.groups_fit_nodes(size)
                if split:
                    out.append(f"zero_optimization.{key}={asked} splits a node: {split}; use a divisor of the "
                               f"ranks per node or a multiple of it that divides the world size {world}")
        return out


@dataclass(frozen=True)
class Reductions:
    """The groups a gradient bucket's reduction uses ([Note: stage-3 layouts])."""

    shard: Communicator
    """Reduce-scatter over the shard group (on a queue of its own: [Note: stage 3 bucket plan])."""
    world: Communicator
    """Every rank on the same queue: the bucket plan is rank 0's for every replica alike."""
    replicas: Communicator | None = None
    """MiCS: then all-reduce the shard across the ranks holding the same shard."""
    quantized: tuple[Communicator, Communicator] | None = None
    """qgZ: (inside the node, across nodes) groups of the two-stage int4 all-to-all."""
    two_stage: tuple[Communicator, Communicator] | None = None
    """gloo across nodes: the same groups, for an unquantized reduction in two stages ([Note:
    two-stage reduce-scatter on gloo] in two_stage_reduce.py)."""


class Stage3Layout:
    """The communicators one stage-3 strategy uses ([Note: stage-3 layouts]).

    Every rank builds the same groups in the same order (torch requires it of `new_group`)."""

    def __init__(self, world: Communicator, choice: LayoutChoice) -> None:
        self.world = world
        self.choice = choice
        self.shard = world
        """Parameters, gradients and optimizer state are sharded over these ranks."""
        self.replicas: Communicator | None = None
        """MiCS: the ranks holding the same shard as this one (gradient shards are all-reduced)."""
        self.secondary: Communicator | None = None
        """hpZ: the ranks sharing one secondary partition."""
        self.inside_node: Communicator | None = None
        self.across_nodes: Communicator | None = None
        """MiCS's hierarchical gather: the shard group's ranks on this node / of this local index."""
        self.reduce_world = self.reduce = world
        """Gradient reductions over every rank / over the shard group, on a queue of their own."""
        self.reduce_replicas: Communicator | None = None
        self.reduce_inside: Communicator | None = None
        self.reduce_across: Communicator | None = None
        self.two_stage = False
        """Reduce-scatters across nodes run in two stages ([Note: two-stage reduce-scatter on gloo])."""
        if not world.distributed:
            return
        if world.group is not dist.group.WORLD:
            # new_group needs every rank of the world, which a sub-group's outsiders never join:
            # reductions then share the engine's group, and layouts beyond flat are refused.
            if not choice.flat:
                raise RayZeroValueError(
                    "hpZ, MiCS and quantized collectives build process groups over the whole world, and this "
                    "engine was given a sub-group (process_group=...): leave process_group out, or turn "
                    "zero_hpz_partition_size / mics_shard_size / zero_quantized_* off")
            return
        problems = choice.problems(world.topology)
        if problems:
            raise RayZeroValueError("; ".join(problems))
        size = world.world_size
        shard_size = choice.mics_shard_size or size
        # Every rank runs every split below, in this order (conditions are the same on every rank).
        self.shard = world.split(consecutive(size, shard_size))
        if shard_size < size:
            self.replicas = world.split(strided(size, shard_size))
        if 1 < choice.hpz_size < size:
            self.secondary = world.split(consecutive(size, choice.hpz_size))
        # The shard group's ranks by node ([Note: hierarchical gather] in gather_routes.py).
        local = _ranks_per_node(world.topology, self.shard.ranks)
        if choice.hierarchical_gather and local < shard_size:
            self.inside_node = world.split(consecutive(size, local))
            self.across_nodes = world.split(_local_index_groups(size, local, shard_size))
        self.reduce_world = world.split([list(range(size))], fresh=True)
        self.reduce = self.reduce_world if shard_size == size else world.split(consecutive(size, shard_size), fresh=True)
        if self.replicas is not None:
            self.reduce_replicas = world.split(strided(size, shard_size), fresh=True)
        self.two_stage = world.gloo and local < shard_size and _equal_consecutive_nodes(world.topology)
        if choice.quantize_gradients or self.two_stage:
            self.reduce_inside = world.split(consecutive(size, min(local, shard_size)), fresh=True)
            self.reduce_across = world.split(_local_index_groups(size, local, shard_size), fresh=True)

    def gather_routes(self) -> tuple[GatherRoute, GatherRoute | None, Communicator | None]:
        """(how gathers from the shards travel, how gathers from hpZ pieces travel, hpZ's group)."""
        route = Quantized if self.choice.quantize_weights else Direct
        primary: GatherRoute = route(self.shard)
        if self.across_nodes is not None and self.inside_node is not None:
            primary = Hierarchical(self.across_nodes, self.inside_node)
        secondary = route(self.secondary) if self.secondary is not None else None
        return primary, secondary, self.secondary

    def reductions(self) -> Reductions:
        groups = None
        if self.reduce_inside is not None and self.reduce_across is not None:
            groups = (self.reduce_inside, self.reduce_across)
        return Reductions(self.reduce, self.reduce_world, self.reduce_replicas,
                          groups if self.choice.quantize_gradients else None, groups if self.two_stage else None)

    def describe(self) -> dict[str, Any]:
        """For status and logs: the node layout and the groups of this rank."""
        def ranks(comm: Communicator | None) -> list[int] | None:
            return None if comm is None else list(comm.ranks)

        return {"nodes": self.world.topology.describe(), "node_of_rank": list(self.world.topology.node_of),
                "shard_group": ranks(self.shard), "replica_group": ranks(self.replicas),
                "hpz_group": ranks(self.secondary), "quantized_weights": self.choice.quantize_weights,
                "quantized_gradients": self.choice.quantize_gradients}


def _equal_consecutive_nodes(topology: Topology) -> bool:
    """Every node has as many ranks, each node's ranks consecutive (what the two stages assume)."""
    return len(set(topology.node_sizes())) == 1 and topology.contiguous()


def _ranks_per_node(topology: Topology, members: tuple[int, ...]) -> int:
    """Ranks of the shard group on each node it touches (equal by `groups_fit_nodes`)."""
    return sum(1 for rank in members if topology.same_node(rank, members[0]))


def _local_index_groups(world_size: int, local: int, shard_size: int) -> list[list[int]]:
    """Within every shard group, the ranks of the same local index on each of its nodes."""
    out = []
    for group in consecutive(world_size, shard_size):
        out.extend([group[offset::local] for offset in range(local)])
    return out
