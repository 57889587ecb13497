"""Stage 3 beyond one node on real gloo groups: hpZ and MiCS train the weights flat ZeRO-3 trains,
and the bytes each rank sends per link class match an independent count.

4 ranks as 2 emulated nodes x 2 ranks (GROUP_RANK; layout_workers.py), one spawned group for every
case. `stage3_param_persistence_threshold` 0 and `stage3_max_reuse_distance` 0 make every parameter
gather in forward and again in backward, as a large model's do, so hpZ's backward gathers happen.

Tolerances: fp32 weights within 1e-6 (relative to each tensor's largest value) of flat stage 3's:
the layouts sum the same gradients in another order (MiCS: inside the shard group, then across its
replicas), which moves fp32 results by a few ulps; and within 1e-5 of single-process torch, as every
stage's parity test. bf16 against flat bf16 within 1e-2: gradients are summed in bf16, and MiCS sums
twice (shard group, then replicas) where flat sums once, so an element now and then lands one bf16
rounding (3.9e-3 relative) away; Adam turns a flipped small component into up to 2 lr = 0.02 of
update, and over 6 steps the weights were measured 4.4e-3 (relative to each tensor's largest) apart.
"""
from __future__ import annotations

import functools

import pytest
import torch
from layout_workers import checkpoint_leg, nodes_init, run
from testkit import harness as H

WORLD = 4
KNOBS = (("stage3_param_persistence_threshold", 0), ("stage3_max_reuse_distance", 0))
HPZ = (("zero_hpz_partition_size", 2),)
MICS = (("mics_shard_size", 2),)
MICS_HIERARCHICAL = (("mics_shard_size", 4), ("mics_hierarchical_params_gather", True))
OFFLOAD = (("offload_optimizer", {"device": "cpu"}), ("offload_param", {"device": "cpu"}))
QWZ = (("zero_quantized_weights", True),)
QGZ = (("zero_quantized_gradients", True),)


def _case(layout: tuple = (), **changes) -> H.Case:
    return H.Case(stage=3, zero=KNOBS + layout, **{"steps": 6, **changes})


CASES = {
    "flat": _case(),
    "hpz": _case(HPZ),
    "mics": _case(MICS),
    "mics-hierarchical": _case(MICS_HIERARCHICAL),
    "flat-offload": _case(OFFLOAD),
    "hpz-offload": _case(HPZ + OFFLOAD),
    "mics-offload": _case(MICS + OFFLOAD),
    "flat-sgd-gas2": _case(optimizer="sgd", gas=2),
    "hpz-sgd-gas2": _case(HPZ, optimizer="sgd", gas=2),
    "mics-sgd-gas2": _case(MICS, optimizer="sgd", gas=2),
    "flat-bf16": _case(precision="bf16"),
    "hpz-bf16": _case(HPZ, precision="bf16"),
    "mics-bf16": _case(MICS, precision="bf16"),
    "qwz": _case(QWZ),
    "qgz": _case(QGZ),
    "zeropp": _case(HPZ + QWZ + QGZ),
    "zeropp-offload": _case(HPZ + QWZ + QGZ + OFFLOAD),
    "mics-qwz-qgz": _case(MICS + QWZ + QGZ),
    "frozen-int8": _case((("zero_quantized_nontrainable_weights", True),)),
    "mics-3": _case((("mics_shard_size", 3),)),
    "mics-and-hpz": _case(MICS + HPZ),
}
FLAT_OF = {name: "flat" + name[len(name.split("-")[0]):] for name in CASES}
FLAT_OF["mics-hierarchical"] = "flat"
QUANTIZED = {"qwz", "qgz", "zeropp", "zeropp-offload", "mics-qwz-qgz", "frozen-int8"}
for _name in QUANTIZED:
    FLAT_OF[_name] = "flat-offload" if "offload" in _name else "flat"


@functools.cache
def results() -> dict[str, list]:
    per_rank = H.spawn(WORLD, run, list(CASES.values()), init=nodes_init)
    return {name: [per_rank[rank][index] for rank in range(WORLD)] for index, name in enumerate(CASES)}


TRAINED = [name for name in CASES if name not in ("mics-3", "mics-and-hpz")]


@pytest.mark.parametrize("name", [n for n in TRAINED if not n.startswith("flat") and n not in QUANTIZED])
def test_layout_trains_the_weights_of_flat_stage3(name):
    per_rank, flat = results()[name], results()[FLAT_OF[name]]
    assert all(not isinstance(r, str) for r in per_rank), per_rank[0]
    masters, reference = H.assemble_masters(per_rank), H.assemble_masters(flat)
    tolerance = 1e-2 if per_rank[0].case.precision == "bf16" else 1e-6
    worst = max(H.max_rel_diff(masters[n], reference[n]) for n in reference)
    assert worst <= tolerance, f"{name}: weights {worst:.2e} from flat stage 3's"
    for step, (mine, theirs) in enumerate(zip(per_rank[0].losses, flat[0].losses)):
        assert abs(mine - theirs) <= tolerance * max(1.0, abs(theirs)), (step, mine, theirs)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_collectives_train_close_to_flat_stage3(name):
    """Within int8/int4 rounding: every step's loss within 2% of flat's (the GPT test in
    test_zeropp_gpt.py holds the final loss of a real model to 1%)."""
    per_rank, flat = results()[name], results()[FLAT_OF[name]]
    assert all(not isinstance(r, str) for r in per_rank), per_rank[0]
    for step, (mine, theirs) in enumerate(zip(per_rank[0].losses, flat[0].losses)):
        assert abs(mine - theirs) <= 0.02 * abs(theirs), (name, step, mine, theirs)
    masters = H.assemble_masters(per_rank)
    assert all(not t.isnan().any() for t in masters.values()), "every element trained and covered"


@pytest.mark.parametrize("name", [n for n in TRAINED if "bf16" not in n and n not in QUANTIZED])
def test_fp32_layouts_match_single_process_torch(name):
    per_rank = results()[name]
    case = per_rank[0].case
    ref_losses, ref_params = H.reference_run(WORLD, case)
    losses = [sum(r.losses[step] for r in per_rank) / WORLD for step in range(case.steps)]
    H.assert_matches_reference("fp32", losses, H.assemble_masters(per_rank), ref_losses, ref_params)


@pytest.mark.parametrize("name", TRAINED)
def test_engine_link_counts_match_an_independent_count(name):
    """The engine's intra-/inter-node bytes for a step equal what a wrapper around torch.distributed
    counted for the same step, on every rank."""
    for rank, result in enumerate(results()[name]):
        assert result.extra["engine_links"] == result.extra["probe_links"], (name, rank, result.extra["comm"])


def test_hpz_keeps_backward_gathers_inside_the_node():
    flat = results()["flat"][0].extra["comm"]["all_gather"]
    hpz = results()["hpz"][0].extra["comm"]["all_gather"]
    # A parameter's first gather of a step spans the world as flat's do; every later one (its backward
    # gather, a tied weight's second use) reads the node's secondary pieces: at least half of flat's
    # cross-node gather bytes go (each parameter is gathered again for its backward).
    assert hpz["elements"] == flat["elements"], "the same gathers, by other routes"
    assert hpz["inter_node_bytes"] * 2 <= flat["inter_node_bytes"], (hpz, flat)
    assert hpz["intra_node_bytes"] > flat["intra_node_bytes"]


def test_mics_keeps_gathers_and_reduce_scatters_inside_the_shard_group():
    comm = results()["mics"][0].extra["comm"]
    assert comm["all_gather"]["inter_node_bytes"] == 0 and comm["reduce_scatter"]["inter_node_bytes"] == 0
    assert comm["all_reduce"]["inter_node_bytes"] > 0, "gradient shards are all-reduced across the replicas"
    once = results()["mics-sgd-gas2"][0].extra["comm"]["all_reduce"]
    assert once["calls"] == comm["all_reduce"]["calls"], "two micro-steps, one all-reduce a bucket (at the boundary)"
    hierarchical = results()["mics-hierarchical"][0].extra["comm"]["all_gather"]
    flat = results()["flat"][0].extra["comm"]["all_gather"]
    assert hierarchical["inter_node_bytes"] * 2 == flat["inter_node_bytes"], "each piece crosses once per node"


def test_frozen_weights_are_stored_as_int8_blocks():
    """zero_quantized_nontrainable_weights: the frozen layer's shard is held in int8 (a quarter of its fp32
    bytes, plus scales), the trainable ones as before."""
    flat, frozen = results()["flat"][0].memory["params"], results()["frozen-int8"][0].memory["params"]
    frozen_layer = H.HIDDEN * H.HIDDEN + H.HIDDEN  # ParityModel.frozen: a Linear
    saved = flat - frozen
    assert 0.7 * frozen_layer * 4 / WORLD * 0.75 <= saved <= frozen_layer * 4 / WORLD, (flat, frozen)


def test_zeropp_cuts_cross_node_bytes_to_under_a_third_of_flat():
    """hpZ + qwZ + qgZ against flat ZeRO-3 (fp32 here, so int8 weights are a quarter and int4 gradients
    an eighth of the bytes; the ZeRO++ paper's 4x is against fp16): the issue asks <= 0.3x."""
    flat = results()["flat"][0].extra["comm"]["total"]["inter_node_bytes"]
    zeropp = results()["zeropp"][0].extra["comm"]["total"]["inter_node_bytes"]
    assert zeropp <= 0.3 * flat, (zeropp, flat)


def test_checkpoints_move_between_layouts_and_world_sizes(tmp_path):
    """MiCS on 2 nodes x 2 -> flat ZeRO-3 on 1 node x 2 -> hpZ on 2 nodes x 2, a checkpoint between each
    leg (the one format: [Note: flat-range partitioning]): each leg resumes from exactly the weights the
    last one saved, and the 9 steps end with single-process torch's weights (the global batch is the
    same at every world size: 4 ranks x 2, 2 ranks x 4)."""
    legs = [(4, _case(MICS, steps=9), 0, 3), (2, _case(steps=9, micro_batch=4), 3, 6), (4, _case(HPZ, steps=9), 6, 9)]
    saved, losses = None, []
    for index, (world, case, first, last) in enumerate(legs):
        leg = {"case": case, "load": saved, "save": str(tmp_path / f"leg{index}"), "first": first, "last": last}
        per_rank = H.spawn(world, checkpoint_leg, leg, init=nodes_init)
        if saved is not None:
            loaded = H.assemble_masters([type(r)(r.case, [], r.extra["loaded"]) for r in per_rank])
            assert all(torch.equal(loaded[n], previous[n]) for n in previous), f"leg {index} resumed elsewhere"
        previous = H.assemble_masters(per_rank)
        losses += [sum(r.losses[step] for r in per_rank) / world for step in range(last - first)]
        saved = leg["save"]
    ref_losses, ref_params = H.reference_run(4, _case(MICS, steps=9))
    H.assert_matches_reference("fp32", losses, previous, ref_losses, ref_params)


def test_a_group_size_that_does_not_fit_is_refused_naming_both_numbers():
    refused = results()["mics-3"][0]
    assert isinstance(refused, str) and "mics_shard_size" in refused and "3" in refused and "4" in refused, refused
    both = results()["mics-and-hpz"][0]
    assert isinstance(both, str) and "zero_hpz_partition_size" in both and "mics_shard_size" in both, both
