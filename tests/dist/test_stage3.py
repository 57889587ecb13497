"""ZeRO stage 3 on real gloo groups: parity with single-process fp32 torch, the stage-3 knobs each
changing traffic or memory measurably, 3Ψ communication, GatheredParameters and zero.Init.

One spawned group per world size runs every case for it (spawning costs seconds; 2 shared cores);
what the ranks run is in stage3_workers.py.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from stage3_workers import DEPTH, FP16_CASE, LAYER, PSI, WIDTH, parity_cases, worker
from testkit.harness import assemble_masters, max_rel_diff, reference_run, spawn

BF16_LOSS_TOLERANCE = 1e-2
BF16_PARAM_TOLERANCE = 0.1
"""bf16 keeps 8 mantissa bits: each forward/backward rounds weights and activations to ~4e-3
relative. Over 20 AdamW steps (whose update size is set by lr, not by the gradient's magnitude)
those roundings move the weights by up to ~8% of their largest value against an fp32 run
(measured 0.079 on down.weight — identical for stage 2, so it is the precision, not the sharding);
the loss stays within 0.3%. The stage-2-vs-stage-3 bf16 check below is the tight one."""
STAGE2_VS_STAGE3_BF16 = 1e-3

_GROUPS: dict[int, list[dict]] = {}
_CHECKPOINT_DIR = tempfile.TemporaryDirectory(prefix="rayzero-stage3-")


def group(world: int) -> list[dict]:
    """Spawn the group for `world` once per session and keep every rank's results."""
    if world not in _GROUPS:
        if world == 3:
            group(2)  # writes the checkpoint the 3-rank group resumes from
        payload = {"parity": parity_cases(), "knobs": world == 2, "extras": world in (2, 3),
                   "stage2_bf16": world == 2,
                   "checkpoint_dir": _CHECKPOINT_DIR.name if world in (2, 3) else None}
        _GROUPS[world] = spawn(world, worker, payload)
    return _GROUPS[world]


# ---- parity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("index", range(4), ids=[f"{c.precision}-gas{c.gas}" for c in parity_cases()])
def test_stage3_matches_single_process_fp32(world, index):
    per_rank = [results["parity"][index] for results in group(world)]
    case = per_rank[0].case
    reference_losses, reference_params = reference_run(world, case)
    losses = [sum(r.losses[step] for r in per_rank) / world for step in range(case.steps)]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses))
    masters = assemble_masters(per_rank)
    assert set(masters) == set(reference_params)  # the unused parameter is trained (decayed) too
    param_rel = {name: max_rel_diff(masters[name], reference_params[name]) for name in reference_params}
    if case.precision == "fp32":
        assert loss_rel <= 1e-5, (loss_rel, losses, reference_losses)
        assert max(param_rel.values()) <= 1e-5, param_rel
    else:
        assert loss_rel <= BF16_LOSS_TOLERANCE, loss_rel
        assert max(param_rel.values()) <= BF16_PARAM_TOLERANCE, param_rel


def test_stage3_bf16_equals_stage2_bf16():
    per_rank = group(2)
    stage3 = assemble_masters([results["parity"][2] for results in per_rank])  # bf16, gas 1
    stage2 = assemble_masters([results["stage2_bf16"] for results in per_rank])
    assert per_rank[0]["parity"][2].case.precision == "bf16"
    diffs = {name: max_rel_diff(stage3[name], stage2[name]) for name in stage2}
    assert max(diffs.values()) <= STAGE2_VS_STAGE3_BF16, diffs


def test_stage3_fp16_overflow_skips_steps_and_lowers_the_scale():
    per_rank = group(2)
    for results in per_rank:
        result = results["fp16"]
        skipped = result.extra["skipped_steps"]
        scale = result.extra["extra_state"]["loss_scaler"]["cur_scale"]
        assert 1 <= skipped < FP16_CASE.steps
        assert scale == 2.0 ** (22 - skipped)  # halved once per skipped step (hysteresis 1)
        assert skipped == results["stage2_fp16"].extra["skipped_steps"]
        assert all(torch.isfinite(values).all() for *_, values in result.masters)
    # the steps that were taken updated the weights exactly as stage 2 does
    stage3 = assemble_masters([results["fp16"] for results in per_rank])
    stage2 = assemble_masters([results["stage2_fp16"] for results in per_rank])
    diffs = {name: max_rel_diff(stage3[name], stage2[name]) for name in stage2}
    assert max(diffs.values()) <= 1e-5, diffs


# ---- communication and knobs ---------------------------------------------------------------------
def knobs() -> dict:
    return group(2)[0]["knobs"]


def test_stage3_step_moves_three_psi():
    baseline = knobs()["baseline"]  # no persistence, no reuse: every gather is paid
    assert baseline["all_gather"] == 2 * PSI  # forward + backward
    assert baseline["reduce_scatter"] == PSI
    assert baseline["total"] == 3 * PSI


def test_param_persistence_threshold_cuts_all_gather_traffic():
    baseline, persist = knobs()["baseline"], knobs()["persist_100"]
    persistent = DEPTH * WIDTH + 2 * WIDTH  # biases and the LayerNorm (24 elements each) < 100
    assert persist["persistent"] == persistent
    # persistent parameters are gathered once per step (after the update) instead of twice
    assert persist["all_gather"] == 2 * (PSI - persistent) + persistent
    assert persist["all_gather"] < baseline["all_gather"]
    assert persist["params_bytes"] > baseline["params_bytes"]  # they are held whole


def test_model_persistence_threshold_caps_persistent_elements():
    capped = knobs()["persist_100_model_100"]
    assert capped["persistent"] == 4 * WIDTH  # four 24-element biases fit in 100 elements
    assert knobs()["persist_100"]["all_gather"] < capped["all_gather"] < knobs()["baseline"]["all_gather"]


def test_max_reuse_distance_keeps_parameters_between_forward_and_backward():
    near, far = knobs()["baseline"], knobs()["reuse_far"]
    assert far["all_gather"] == PSI  # gathered in forward, kept for backward: no second gather
    assert far["peak_live"] == PSI
    assert near["peak_live"] <= 2 * LAYER < PSI


def test_max_live_parameters_caps_gathered_elements():
    capped = knobs()["reuse_far_live_1300"]
    assert capped["peak_live"] <= 1300 < knobs()["reuse_far"]["peak_live"]
    assert capped["all_gather"] > knobs()["reuse_far"]["all_gather"]  # evicted ones are re-gathered


def test_prefetch_bucket_size_gathers_ahead_within_the_live_cap():
    off, on, capped = knobs()["baseline"], knobs()["prefetch_1200"], knobs()["prefetch_1200_live_1300"]
    assert off["prefetched"] == 0 and on["prefetched"] > 0
    assert on["all_gather"] == off["all_gather"]  # earlier, not more
    assert on["peak_live"] > off["peak_live"]  # the price: more gathered at once
    assert capped["prefetched"] > 0 and capped["peak_live"] <= 1300


def test_stage3_checkpoint_from_two_ranks_resumes_on_three():
    reference = group(2)[0]["checkpoint"]["reference"]
    for results in group(3):
        resumed = results["checkpoint"]
        assert resumed["global_steps"] == 3
        for got, want in zip(resumed["resumed"], reference):
            assert abs(got - want) <= 1e-5 * abs(want), (resumed["resumed"], reference)


# ---- GatheredParameters and Init -------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_gathered_parameters_read_and_modify(world):
    for rank, results in enumerate(group(world)):
        checks = results["gathered"]
        assert checks["released_numel"] == 0  # partitioned outside the context
        assert checks["gathered_shape"] == (WIDTH, WIDTH)
        assert checks["gathered_matches_master"]
        assert checks["after_modify_all_half"], rank  # the modifier rank's values reached everyone
        assert checks["master_modified"], rank  # ... including the fp32 master piece
        assert checks["plain_untouched_by_context"] == [2.0, 2.0, 2.0]  # no-op for plain params
        expected, losses = checks["external_losses"]  # a registered external parameter is gathered
        assert losses[0] == pytest.approx(expected, rel=1e-6) and losses[1] < losses[0]


@pytest.mark.parametrize("world", [2, 3])
def test_init_builds_partitioned_model_identical_to_normal_build(world):
    for results in group(world):
        checks = results["init"]
        assert checks["max_local_numel"] == 0  # nothing whole survives construction
        # while building, at most one module's parameters exist whole (the one being initialised)
        assert len(checks["whole_at_init"]) == 6  # embed, 2 Linear, Scaled, LayerNorm, head (the tie)
        assert max(checks["whole_at_init"]) <= checks["largest_module"] < checks["model_numel"]
        assert checks["tied"] and checks["buffer_equal"] and checks["params_equal"]
        assert checks["losses"]["init"] == checks["losses"]["normal"]
        assert "reset_parameters" in checks["no_reset_error"] and "param_init_fn" in checks["no_reset_error"]

