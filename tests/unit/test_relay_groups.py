"""Which ranks each node relay gathers ([Note: relays for small nodes] in
rayzero/controller/relay_rounds.py): a relay per node of 8 or more ranks, small nodes packed so a
relay gathers at least 8, the nodes of one host together, and the relay on its group's biggest node."""
from __future__ import annotations

import pytest

from rayzero.controller.relay_rounds import RANKS_PER_RELAY, relay_groups

pytestmark = pytest.mark.unit


def _nodes(sizes: list[int], hosts: list[str] | None = None) -> list[tuple[str, str]]:
    """Per rank (node, host address), ranks contiguous per node as assign_ranks makes them."""
    where = []
    for index, size in enumerate(sizes):
        where += [(f"n{index}", hosts[index] if hosts else f"10.0.0.{index}")] * size
    return where


def test_nodes_of_eight_keep_a_relay_each():
    groups = relay_groups(_nodes([8] * 4))
    assert [(group.home, group.nodes, group.ranks) for group in groups] == [
        (f"n{index}", (f"n{index}",), tuple(range(8 * index, 8 * index + 8))) for index in range(4)]


def test_single_rank_nodes_share_a_relay_per_eight_so_the_controller_calls_an_eighth_as_often():
    groups = relay_groups(_nodes([1] * 4096))
    # a relay per node made 4,096 calls a round: about one core of the controller's CPU (bench/scale.py)
    assert len(groups) == 4096 // RANKS_PER_RELAY == 512
    assert all(len(group.ranks) == 8 and len(group.nodes) == 8 for group in groups)
    assert sorted(rank for group in groups for rank in group.ranks) == list(range(4096))
    assert groups[1].ranks == tuple(range(8, 16)) and groups[1].home == "n8"


def test_a_short_remainder_joins_the_last_relay_and_a_small_cluster_gets_one():
    groups = relay_groups(_nodes([1] * 13))
    assert [len(group.ranks) for group in groups] == [13]  # one relay: the controller runs it in place
    assert [len(group.ranks) for group in relay_groups(_nodes([1] * 19))] == [8, 11]
    assert [len(group.ranks) for group in relay_groups(_nodes([1] * 3))] == [3]


def test_the_nodes_of_one_host_go_together_and_the_relay_runs_on_the_biggest():
    # ranks 0-3 on n0 (host A), 4 on n1 (host B), 5-6 on n2 (host A again), 7-9 on n3 (host C)
    where = _nodes([4, 1, 2, 3], hosts=["A", "B", "A", "C"])
    # host A has 6 ranks: a relay's worth; B and C (4) are too few for one and join it
    (group,) = relay_groups(where, per_relay=6)
    assert (group.home, group.nodes, group.ranks) == ("n0", ("n0", "n2", "n1", "n3"), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9))
    # 3 more ranks on host C (n4): B and C have 7, a relay of their own, on the first of its biggest nodes
    groups = relay_groups(where + [("n4", "C")] * 3, per_relay=6)
    assert [(group.home, group.nodes, group.ranks) for group in groups] == [
        ("n0", ("n0", "n2"), (0, 1, 2, 3, 5, 6)), ("n3", ("n1", "n3", "n4"), (7, 8, 9, 4, 10, 11, 12))]


def test_the_home_nodes_ranks_come_first():
    groups = relay_groups(_nodes([1, 1, 5, 1]))
    assert [(group.home, group.ranks) for group in groups] == [("n2", (2, 3, 4, 5, 6, 0, 1, 7))]
