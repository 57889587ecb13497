"""How many bytes gloo's collectives put on the links between nodes, and an alpha-beta model of a
step across nodes: the oracle of tests/ray/test_multinode_emulated.py and the fallback of
bench/multinode.py where network namespaces are refused.

[Note: gloo's traffic across nodes]
gloo (torch 2.13) runs a collective over the ranks of its group in rank order; with ranks
contiguous per node, which of its messages cross between nodes follows from the algorithm alone:
  - all_reduce: a ring (reduce-scatter, then all-gather around it); each edge r -> r+1 carries
    2(N-1)/N of the tensor, and the ring crosses between nodes on `nodes` of its N edges;
  - all_gather_into_tensor: a ring; each edge carries (N-1)/N of the output;
  - reduce_scatter_tensor: an all_reduce of the whole input, then each rank keeps its slice (the
    bytes on the links equal all_reduce's);
  - broadcast: a binomial tree over ranks renumbered from the root (v = rank - root mod N);
    v receives the whole tensor from v - 2^k, 2^k the highest power of two <= v.
Measured on the emulated cluster (bench/netcluster_gloo.py, 2 nodes x 2 ranks, 32 MiB and 1 MiB,
frames counted by tc, so ~4.6% of Ethernet/IP/TCP headers and ~2% of ACKs on top): all_reduce 3.14x
the tensor's bytes, all_gather 1.57x, reduce_scatter 3.14x, broadcast from rank 0 or 2 2.09x, from
1 or 3 3.14x, against 3, 1.5, 3, 2 and 3 from the rules above. rayzero on gloo turns an all-gather of
>= 2^21 elements into one broadcast per rank and a reduce-scatter of a scratch input into an
all_reduce ([Note: gloo's temporary copies] in rayzero/engine/comm.py): those cross at the
broadcasts' mean (2.5x for 2 x 2) and at all_reduce's rate. A stage-3 gradient reduction across
nodes does not use gloo's reduce-scatter: it is two all-to-alls ([Note: two-stage reduce-scatter on
gloo] in rayzero/engine/two_stage_reduce.py), the second of which sends each rank's 1/N of the
full tensor to each of the other nodes' ranks of its local index: (nodes - 1) x the full tensor
crosses in all (1x for 2 x 2, a third of gloo's all-reduce), and the engine counts the full tensor
(its stage inside the node) plus 1/local of it (its stage across).
"""
from __future__ import annotations

FRAME_OVERHEAD = 1.046
"""tc's bytes per payload byte of a bulk TCP stream here (MTU 1500: headers plus the ACKs coming
back), measured with plain gloo broadcasts between two nodes (bench/netcluster_gloo.py)."""
GLOO_DIRECT_MIN_ELEMENTS = 1 << 21
"""rayzero/engine/comm.py's threshold of the same name (restated: bench code never changes it)."""


def _nodes_of(ranks_per_node: list[int]) -> list[int]:
    return [node for node, count in enumerate(ranks_per_node) for _ in range(count)]


def ring_crossings(ranks_per_node: list[int]) -> int:
    """Edges r -> r+1 (mod N) of the rank-order ring whose ends sit on different nodes."""
    nodes = _nodes_of(ranks_per_node)
    world = len(nodes)
    return sum(nodes[rank] != nodes[(rank + 1) % world] for rank in range(world)) if world > 1 else 0


def broadcast_crossings(ranks_per_node: list[int], root: int) -> int:
    """Messages of gloo's binomial-tree broadcast from `root` that cross between nodes."""
    nodes = _nodes_of(ranks_per_node)
    world = len(nodes)
    crossings = 0
    for virtual in range(1, world):
        parent = virtual - (1 << (virtual.bit_length() - 1))
        crossings += nodes[(parent + root) % world] != nodes[(virtual + root) % world]
    return crossings


def crossing_factors(ranks_per_node: list[int]) -> dict[str, float]:
    """Bytes that cross between nodes per byte of the collective's full tensor, per kind, for gloo
    ([Note: gloo's traffic across nodes]); payload only (times FRAME_OVERHEAD for tc's count)."""
    world = sum(ranks_per_node)
    if world < 2:
        return {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "broadcast": 0.0,
                "all_gather_direct": 0.0, "reduce_scatter_direct": 0.0, "reduce_scatter_two_stage": 0.0}
    ring = ring_crossings(ranks_per_node)
    roots = [broadcast_crossings(ranks_per_node, root) for root in range(world)]
    all_reduce = ring * 2 * (world - 1) / world
    return {
        "all_reduce": all_reduce,
        "all_gather": ring * (world - 1) / world,
        "reduce_scatter": all_reduce,
        "broadcast": sum(roots) / world,  # mean over roots
        "all_gather_direct": sum(roots) / world,  # one broadcast of 1/N of the output per root
        "reduce_scatter_direct": all_reduce,
        # the engine's stage-3 reduction across equal nodes; gloo's own where nodes differ in size
        "reduce_scatter_two_stage": (len(ranks_per_node) - 1 if len(set(ranks_per_node)) == 1 else all_reduce),
    }


def link_bytes_from_comm_stats(comm_stats: dict[str, dict[str, int]], ranks_per_node: list[int],
                               counted_in_two_stages: bool = False) -> float:
    """Inter-node bytes (tc's count) one step's collectives put on the links, from the engine's own
    per-kind counts (`engine.comm_stats()`): a model. A kind whose calls average >= 2^21 elements is
    taken to run rayzero's gloo direct path; `control` (one-element syncs) is left out. The gradient
    reduction runs in two stages across equal nodes ([Note: gloo's traffic across nodes]);
    `counted_in_two_stages`: the counts are of an engine that ran it so (across emulated nodes),
    not of one whose ranks all shared a node (the fallback's)."""
    factors = crossing_factors(ranks_per_node)
    local = ranks_per_node[0]
    two_stage = len(ranks_per_node) > 1 and len(set(ranks_per_node)) == 1
    total = 0.0
    for kind, stats in comm_stats.items():
        if kind in ("total", "control") or not stats.get("calls"):
            continue
        if kind == "reduce_scatter" and two_stage:  # counted: the full tensor + 1/local of it
            full = stats["bytes"] * local / (local + 1) if counted_in_two_stages and local > 1 else stats["bytes"]
            total += full * factors["reduce_scatter_two_stage"]
            continue
        direct = stats["elements"] / stats["calls"] >= GLOO_DIRECT_MIN_ELEMENTS
        key = f"{kind}_direct" if direct and f"{kind}_direct" in factors else kind
        total += stats["bytes"] * factors.get(key, 0.0)
    return total * FRAME_OVERHEAD


def alpha_beta_step_s(compute_s: float, link_bytes: float, nodes: int, rate_mbit: float, delay_ms: float,
                      collective_calls: int, world: int) -> dict[str, float]:
    """A step across nodes as the alpha-beta model sees it (a model, not a measurement): the step
    on one node (`compute_s`, which includes its loopback collectives), plus the inter-node bytes
    spread evenly over the nodes' uplinks at the line rate (beta), plus each collective's 2(N-1)
    ring stages paying the one-way delay (alpha, the worst kind's count)."""
    beta_s = link_bytes / max(nodes, 1) / (rate_mbit * 1e6 / 8)
    alpha_s = collective_calls * 2 * (world - 1) * delay_ms / 1000
    return {"step_s": compute_s + beta_s + alpha_s, "compute_s": compute_s, "beta_s": beta_s, "alpha_s": alpha_s}
