"""Stage-3 layouts beyond one node, the parts that need no process group: which group sizes fit a node
layout, the config's refusals (before any worker starts), and world sizes an elastic run skips."""
from __future__ import annotations

import pytest

from rayzero.config import ConfigError, load_config
from rayzero.controller.elastic import plan_batches
from rayzero.engine.stage3.layout import LayoutChoice, consecutive, strided
from rayzero.engine.topology import Topology

TWO_BY_TWO = Topology((0, 0, 1, 1))


def test_groups_follow_node_boundaries_or_are_refused_naming_both_numbers():
    assert LayoutChoice(hpz_size=2).problems(TWO_BY_TWO) == []
    assert LayoutChoice(hpz_size=4).problems(TWO_BY_TWO) == [], "two whole nodes split nothing"
    assert LayoutChoice(mics_shard_size=2).problems(TWO_BY_TWO) == []
    (problem,) = LayoutChoice(mics_shard_size=3).problems(TWO_BY_TWO)
    assert "mics_shard_size=3" in problem and "world size 4" in problem

    (problem,) = LayoutChoice(hpz_size=2).problems(Topology((0, 0, 0, 1, 1, 1)))
    assert "splits a node" in problem and "ranks 2-3" in problem
    (problem,) = LayoutChoice(mics_shard_size=2).problems(Topology((0, 1, 0, 1)))
    assert "consecutive" in problem
    (problem,) = LayoutChoice(quantize_gradients=True).problems(Topology((0, 0, 0, 1)))
    assert "same number of ranks on every node" in problem


def test_topology_describes_nodes_and_links():
    assert TWO_BY_TWO.describe() == "2 nodes x 2 ranks"
    assert Topology((0, 0, 0, 1)).describe() == "2 nodes of 3, 1 ranks"
    assert TWO_BY_TWO.split_peers(0, (0, 1, 2, 3)) == (1, 2)
    assert consecutive(4, 2) == [[0, 1], [2, 3]] and strided(4, 2) == [[0, 2], [1, 3]]


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero}}


def test_config_refuses_what_cannot_run_before_any_worker_starts():
    with pytest.raises(ConfigError, match="zero_hpz_partition_size.*mics_shard_size"):
        load_config(_config(mics_shard_size=2, zero_hpz_partition_size=2), world_size=4)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        load_config(_config(zero_hpz_partition_size=4), world_size=6)
    config = load_config(_config(zero_hpz_partition_size=2, zero_quantized_weights=True,
                                 zero_quantized_gradients=True), world_size=4)
    assert not any("not implemented" in note for note in config.notes), config.notes
    ignored = load_config({**_config(), "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    assert any("only applies to ZeRO stage 3" in note for note in ignored.notes)


def test_an_elastic_run_skips_world_sizes_its_groups_cannot_split():
    plan = plan_batches(_config(zero_hpz_partition_size=2), 1, 4)
    assert plan.valid_sizes() == [2, 4]
    assert "zero_hpz_partition_size=2" in plan.skipped[1]
    unbatched = plan_batches({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, 1, 6)
    assert unbatched.valid_sizes() == [2, 4, 6] and "mics_shard_size=2" in unbatched.skipped[5]
