"""ZeRO++'s quantized collectives ([Note: quantized collectives]) on real gloo groups: 4 ranks as
1x4, 2x2 and 4x1 (nodes x local ranks) and 2 ranks as 1x2 and 2x1, one spawned group per world size
running every case.

Oracles, all computed here from every rank's raw inputs (exchanged with plain fp32 collectives):
- the exact sum / gather in float64, and the stated per-element bound from the inputs' own group
  absmaxes (not from the scales the code under test computed);
- routing, exactly: inputs of integers whose group absmax is qmax quantize without error (scale 1),
  so with one contributing rank at a time every output must equal that rank's chunk bit for bit;
- bytes: a wrapper around the torch collectives the module calls counts the bytes of every buffer it
  is handed, against all_gather_sent_bytes / reduce_scatter_sent_bytes.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from testkit.harness import spawn

pytestmark = pytest.mark.dist

CHUNKS = (1, 7, 4096, 10_007, 3 * 4096 + 5)
"""Output elements per rank: one element, odd, exactly one default qgZ group, several groups with a
padded last one."""
SHARDS = (1, 7, 8000, 10_007)


def _inputs(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    values[:: 997] *= 20  # outliers
    return values.to(dtype)


def _gather_exact(tensor: torch.Tensor, world: int) -> torch.Tensor:
    pieces = [torch.empty(tensor.numel(), dtype=torch.float32) for _ in range(world)]
    dist.all_gather(pieces, tensor.float().reshape(-1))
    return torch.stack(pieces).double()  # [rank, element]


def _group_absmax(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """values (..., n): each element's group absmax (groups from the start of the last dim)."""
    n = values.shape[-1]
    padded = torch.nn.functional.pad(values.abs(), (0, -n % group_size))
    return padded.unflatten(-1, (-1, group_size)).amax(-1).repeat_interleave(group_size, -1)[..., :n]


class _Counting:
    """Counts the bytes of every buffer handed to the collectives the module calls."""

    def __init__(self) -> None:
        from rayzero.engine import quantized_comm

        self.calls: list[tuple[str, int, int]] = []  # (collective, input bytes, group size)
        self._module = quantized_comm
        self._saved = (quantized_comm._all_gather_flat, dist.all_to_all_single)

        def gather(output, input, group=None, async_op=False):
            self.calls.append(("all_gather", input.numel() * input.element_size(), dist.get_world_size(group)))
            return self._saved[0](output, input, group=group, async_op=async_op)

        def all_to_all(output, input, group=None, **kwargs):
            self.calls.append(("all_to_all", input.numel() * input.element_size(), dist.get_world_size(group)))
            return self._saved[1](output, input, group=group, **kwargs)

        quantized_comm._all_gather_flat = gather
        dist.all_to_all_single = all_to_all

    def close(self) -> None:
        self._module._all_gather_flat, dist.all_to_all_single = self._saved


def _reduce_scatter_cases(rank: int, world: int, local_size: int) -> dict:
    from rayzero.engine.quantize import group_size_for
    from rayzero.engine.quantized_comm import (
        QGZ_TARGET_GROUP_SIZE,
        node_groups,
        quantized_reduce_scatter,
        reduce_scatter_sent_bytes,
    )

    groups = node_groups(world, local_size)
    nodes = world // local_size
    out: dict = {"bound": [], "routing": [], "bytes": [], "quantized": []}
    cases = [(chunk, torch.float32, torch.float32, 4, None) for chunk in CHUNKS]
    cases += [(4096 + 3, torch.bfloat16, torch.float32, 4, None), (4099, torch.bfloat16, torch.bfloat16, 4, None),
              (1000, torch.float16, torch.float32, 8, None), (1001, torch.float32, torch.float32, 4, 100)]
    for chunk, in_dtype, out_dtype, bits, group_size in cases:
        source = _inputs(1000 * rank + chunk, world * chunk, in_dtype)
        result = torch.full((chunk,), float("nan"), dtype=out_dtype)
        counting = _Counting()
        try:
            quantized_reduce_scatter(result, source, groups.intra, groups.inter, bits=bits, group_size=group_size)
        finally:
            counting.close()
        everyone = _gather_exact(source, world).view(world, world, chunk)[:, rank]  # [source rank, element]
        exact = everyone.sum(0)
        size = group_size or group_size_for(chunk, QGZ_TARGET_GROUP_SIZE)
        step = 2 * (2 ** (bits - 1) - 1)
        absmax_sum = _group_absmax(everyone, size).sum(0)
        two_stages = nodes > 1 and local_size > 1
        bound = absmax_sum / step * (2 if two_stages else 1)
        bound += absmax_sum * 2.0 ** -20  # fp32 sums and scales
        if out_dtype != torch.float32:
            bound += exact.abs() * 2.0 ** -8  # the output's own rounding
        error = (result.double() - exact).abs()
        out["bound"].append((chunk, str(in_dtype), str(out_dtype), bits, float((error / bound).max())))
        out["quantized"].append(float(error.max()) > 0)
        sent = reduce_scatter_sent_bytes(chunk, nodes, local_size, bits=bits, group_size=group_size)
        stages = [(b, g) for _, b, g in counting.calls]
        out["bytes"].append((chunk, stages, sent.intra_node, sent.inter_node))
    # Routing: one contributing rank at a time, integers with group absmax qmax: exact at any bits.
    for bits in (4, 8):
        limit = 2 ** (bits - 1) - 1
        for contributor in range(world):
            chunk = 37
            if rank == contributor:
                values = torch.randint(-limit, limit + 1, (world, chunk),
                                       generator=torch.Generator().manual_seed(contributor))
                values[:, 0] = limit
                source = values.float().reshape(-1)
            else:
                source = torch.zeros(world * chunk)
            exact = _gather_exact(source, world).view(world, world, chunk)[contributor, rank]
            result = torch.empty(chunk)
            quantized_reduce_scatter(result, source, groups.intra, groups.inter, bits=bits, group_size=chunk + 3)
            out["routing"].append((bits, contributor, torch.equal(result.double(), exact)))
    return out


def _all_gather_cases(rank: int, world: int, local_size: int) -> dict:
    from rayzero.engine.quantize import group_size_for
    from rayzero.engine.quantized_comm import all_gather_sent_bytes, node_groups, quantized_all_gather

    groups = node_groups(world, local_size)
    out: dict = {"bound": [], "identical": [], "routing": [], "bytes": [], "intra": []}
    cases = [(shard, dtype, dtype, 8, async_op) for shard in SHARDS for dtype in (torch.float32, torch.bfloat16)
             for async_op in (False, True)]
    cases += [(999, torch.float32, torch.float32, 4, False), (1000, torch.float16, torch.float32, 8, True)]
    for shard_numel, in_dtype, out_dtype, bits, async_op in cases:
        shard = _inputs(7 * rank + shard_numel, shard_numel, in_dtype)
        output = torch.full((world * shard_numel,), float("nan"), dtype=out_dtype)
        counting = _Counting()
        try:
            handle = quantized_all_gather(output, shard, bits=bits, async_op=async_op)
            if async_op:
                handle.wait()
        finally:
            counting.close()
        everyone = _gather_exact(shard, world)
        size = group_size_for(shard_numel)
        absmax = _group_absmax(everyone, size)
        bound = absmax / (2 * (2 ** (bits - 1) - 1)) + absmax * 2.0 ** -22  # half a step, fp32 rounding
        if out_dtype != torch.float32:
            bound += everyone.abs() * 2.0 ** -8
        error = (output.double().view(world, -1) - everyone).abs()
        out["bound"].append((shard_numel, str(in_dtype), bits, async_op, float((error / bound).max())))
        out["identical"].append(_gather_exact(output, world).eq(output.double()).all().item())
        sent = all_gather_sent_bytes(shard_numel, world, local_size, bits=bits)
        out["bytes"].append((counting.calls, sent.intra_node, sent.inter_node))
    # In place (the shard is this rank's slice of the output), and exact routing of integers.
    shard_numel = 501
    output = torch.zeros(world * shard_numel)
    mine = output.view(world, -1)[rank]
    mine.copy_(torch.arange(shard_numel).remainder(255).sub(127).float() * (rank + 1))
    quantized_all_gather(output, mine, group_size=shard_numel + 1)
    expected = torch.cat([torch.arange(shard_numel).remainder(255).sub(127).float() * (r + 1) for r in range(world)])
    out["routing"].append(torch.equal(output, expected))
    # Over the node's own group (hpZ-like): every node gathers its own ranks' shards.
    output = torch.empty(local_size * 64)
    quantized_all_gather(output, torch.full((64,), float(rank)), groups.intra)
    node = rank // local_size
    out["intra"].append(torch.equal(output, torch.arange(node * local_size, (node + 1) * local_size)
                                    .float().repeat_interleave(64)))
    return out


def _worker(rank: int, world: int, topologies: list[int]) -> dict:
    return {local_size: {"reduce_scatter": _reduce_scatter_cases(rank, world, local_size),
                         "all_gather": _all_gather_cases(rank, world, local_size)}
            for local_size in topologies}


_RESULTS: dict[int, list[dict]] = {}
TOPOLOGIES = {4: [1, 2, 4], 2: [1, 2]}  # local_size: 4 ranks as 4x1, 2x2, 1x4; 2 as 2x1, 1x2


def results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = spawn(world, _worker, TOPOLOGIES[world])
    return _RESULTS[world]


PARAMS = [(world, local) for world, locals_ in TOPOLOGIES.items() for local in locals_]
IDS = [f"{world // local}nodes-x{local}" for world, local in PARAMS]


def _assert_within_bound(rank: int, cases: dict) -> None:
    worst = max(cases["bound"], key=lambda case: case[-1])  # (case..., max error / bound)
    assert worst[-1] <= 1.0, f"rank {rank}: error / bound = {worst}"


@pytest.mark.parametrize("world,local_size", PARAMS, ids=IDS)
def test_reduce_scatter_sums_within_the_two_quantization_bound(world, local_size):
    for rank, per_rank in enumerate(results(world)):
        cases = per_rank[local_size]["reduce_scatter"]
        _assert_within_bound(rank, cases)
        assert all(cases["quantized"]), "the values went through quantization (an exact sum would hide the path)"


@pytest.mark.parametrize("world,local_size", PARAMS, ids=IDS)
def test_reduce_scatter_routes_every_rank_to_every_chunk_exactly(world, local_size):
    for rank, per_rank in enumerate(results(world)):
        routing = per_rank[local_size]["reduce_scatter"]["routing"]
        assert len(routing) == 2 * world and all(ok for *_, ok in routing), f"rank {rank}: {routing}"


@pytest.mark.parametrize("world,local_size", PARAMS, ids=IDS)
def test_reduce_scatter_sends_the_bytes_it_accounts(world, local_size):
    nodes = world // local_size
    for per_rank in results(world):
        for chunk, stages, intra, inter in per_rank[local_size]["reduce_scatter"]["bytes"]:
            # stage 1 on the node's group (if it has peers), then stage 2 across nodes (if any)
            expected = [(link, size) for link, size in (("intra", local_size), ("inter", nodes)) if size > 1]
            assert [size for _, size in stages] == [size for _, size in expected], (chunk, stages)
            counted = {"intra": 0, "inter": 0}
            for (sent, size), (link, _) in zip(stages, expected):
                counted[link] = sent * (size - 1) // size  # all-to-all: a rank's own block stays
            assert (counted["intra"], counted["inter"]) == (intra, inter), chunk


@pytest.mark.parametrize("world,local_size", PARAMS, ids=IDS)
def test_all_gather_within_half_a_step_identical_on_every_rank(world, local_size):
    for rank, per_rank in enumerate(results(world)):
        cases = per_rank[local_size]["all_gather"]
        _assert_within_bound(rank, cases)
        assert all(cases["identical"]), "every rank holds the same dequantized values"
        assert all(cases["routing"]) and all(cases["intra"])


@pytest.mark.parametrize("world,local_size", PARAMS, ids=IDS)
def test_all_gather_sends_the_bytes_it_accounts(world, local_size):
    for per_rank in results(world):
        for calls, intra, inter in per_rank[local_size]["all_gather"]["bytes"]:
            assert [(kind, g) for kind, _, g in calls] == [("all_gather", world)]
            piece = calls[0][1]
            assert intra + inter == (world - 1) * piece and inter == (world - local_size) * piece


def test_quantized_bytes_are_a_fraction_of_bf16s():
    from rayzero.engine.quantized_comm import all_gather_sent_bytes, reduce_scatter_sent_bytes

    shard = 4096 * 1024
    assert all_gather_sent_bytes(shard, 16, 8).total / (15 * shard * 2) == pytest.approx(0.5, abs=1e-3)
    # qgZ across nodes: one int4 piece per other node, where a bf16 reduce-scatter sends a chunk to
    # each rank of each other node: 1/(4 x local_size) of the cross-node bytes
    chunk = 4096 * 64
    qgz = reduce_scatter_sent_bytes(chunk, 4, 8)
    assert qgz.inter_node / ((32 - 8) * chunk * 2) == pytest.approx(1 / 32, rel=1e-2)
    assert qgz.intra_node == 7 * 4 * math.ceil(chunk / 2 + 4 * chunk / 4096)
