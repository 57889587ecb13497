"""The gloo reduce-scatter across nodes in two stages ([Note: two-stage reduce-scatter on gloo]) on a
real gloo group of 4 ranks as 2 nodes x 2, 1 x 4 and 4 x 1 (nodes x local ranks: the groups are
node_groups', whatever the machine).

Oracles, computed here from every rank's raw inputs (exchanged with a plain fp32 all-gather): the sum
in float64 of every rank's chunk r (fp32 within 1e-6 relative, bf16 within the two bf16 roundings of
a partial and of the result); small blocks (BLOCK_ELEMENTS lowered) so the column rounds and the
last short one run; and the bytes each rank hands to all_to_all_single, per group, against the
engine's own counters and against what a flat reduce-scatter would send across nodes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from testkit.harness import spawn

pytestmark = pytest.mark.dist

CHUNKS = (1, 7, 1000, 4099)


def _inputs(rank: int, numel: int) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
    values[::97] *= 50  # outliers: a partial sum far from the others
    return values


def _cases(rank: int, world: int, _payload: object = None) -> dict:
    from rayzero.engine import two_stage_reduce
    from rayzero.engine.comm import Communicator
    from rayzero.engine.quantized_comm import node_groups
    from rayzero.engine.topology import Topology

    out = {}
    sent: list[tuple[int, int]] = []  # (bytes handed to all_to_all_single, group size)
    original = dist.all_to_all_single

    def counting(output, input, group=None, **kwargs):
        sent.append((input.numel() * input.element_size(), dist.get_world_size(group)))
        return original(output, input, group=group, **kwargs)

    dist.all_to_all_single = counting
    two_stage_reduce.BLOCK_ELEMENTS = 64  # several rounds of columns, the last one short
    try:
        for local in (2, 4, 1):
            groups = node_groups(world, local)
            topology = Topology(tuple(r // local for r in range(world)))
            inside = Communicator(groups.intra, topology=topology)
            across = Communicator(groups.inter, topology=topology, traffic=inside.traffic)
            for dtype in (torch.float32, torch.bfloat16):
                for chunk in CHUNKS:
                    full = _inputs(rank, world * chunk).to(dtype)
                    everyone = [torch.empty(world * chunk) for _ in range(world)]
                    dist.all_gather(everyone, full.float())
                    want = torch.stack(everyone).double().sum(0).view(world, chunk)[rank]
                    got = torch.full((chunk,), float("nan"), dtype=dtype)
                    sent.clear()
                    inside.traffic.current.clear()
                    two_stage_reduce.two_stage_reduce_scatter(got, full.clone(), inside, across)
                    counted = inside.traffic.current["reduce_scatter"]
                    out[(local, str(dtype), chunk)] = {
                        "error": (got.double() - want).abs().max().item(),
                        "scale": want.abs().max().item(),
                        "sent_to_peers": sum(b * (g - 1) // g for b, g in sent),
                        "counted": counted.intra_node_bytes + counted.inter_node_bytes,
                        "inter_counted": counted.inter_node_bytes,
                    }
    finally:
        dist.all_to_all_single = original
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(4, _cases)


@pytest.mark.parametrize("local", [2, 4, 1])
def test_each_rank_receives_the_sum_of_its_chunk(results, local):
    for rank, cases in enumerate(results):
        for chunk in CHUNKS:
            fp32 = cases[(local, "torch.float32", chunk)]
            assert fp32["error"] <= 1e-6 * fp32["scale"], (rank, chunk, fp32)
            bf16 = cases[(local, "torch.bfloat16", chunk)]
            # the partial of a node and the result each round once to bf16 (2^-8 relative)
            assert bf16["error"] <= 2 * 2**-8 * bf16["scale"], (rank, chunk, bf16)


@pytest.mark.parametrize("local", [2, 4, 1])
def test_the_bytes_counted_are_the_bytes_handed_to_gloo(results, local):
    for cases in results:
        for dtype in ("torch.float32", "torch.bfloat16"):
            for chunk in CHUNKS:
                case = cases[(local, dtype, chunk)]
                assert case["counted"] == case["sent_to_peers"], (local, dtype, chunk, case)


def test_across_two_nodes_of_two_a_rank_sends_one_chunk_across_where_a_flat_reduce_scatter_sends_two(results):
    for cases in results:
        for chunk in CHUNKS:
            case = cases[(2, "torch.float32", chunk)]
            assert case["inter_counted"] == chunk * 4, (chunk, case)  # flat: 2 chunks (gloo's all-reduce: 4)

