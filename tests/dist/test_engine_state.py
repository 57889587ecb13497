"""The engine's checkpoint seam (state_shards / load_state_shards / extra_state) reshards: state
written by 2 ranks at stage 2 resumes on 3 ranks at stage 1 and on 1 rank at stage 0, and training
continues exactly like the uninterrupted single-process reference (fp32, ≤ 1e-5)."""
from __future__ import annotations

import functools

import engine_workers as W
import pytest
from testkit import harness as H

GLOBAL = 6  # samples per optimizer step at every world size (micro batch = GLOBAL / world)
SAVE_AT, LAST = 4, 8


def _case(stage: int, world: int) -> H.Case:
    return H.Case(stage=stage, micro_batch=GLOBAL // world)


@functools.cache
def saved() -> list[dict]:
    return H.spawn(2, W.resume, {"case": _case(2, 2), "first": 0, "last": SAVE_AT})


def _pieces(per_rank: list[dict]) -> list:
    return [piece for rank in per_rank for piece in rank["shards"]]


@functools.cache
def reference():
    return H.reference_run(1, H.Case(stage=0, micro_batch=GLOBAL, steps=LAST))


@pytest.mark.parametrize(("world", "stage"), [(3, 1), (1, 0)])
def test_resume_at_another_world_size_and_stage(world: int, stage: int) -> None:
    before = saved()
    ref_losses, ref_params = reference()
    assert [sum(r["losses"][i] for r in before) / 2 for i in range(SAVE_AT)] == pytest.approx(
        ref_losses[:SAVE_AT], rel=1e-5)
    names = {spec.name for spec, _ in _pieces(before)}
    assert {"module/embed.weight", "master/embed.weight", "optim/exp_avg/embed.weight",
            "optim/exp_avg_sq/embed.weight", "module/scale"} <= names
    assert not any(name.endswith("head.weight") for name in names), "the tied weight is stored once"
    payload = {"case": _case(stage, world), "first": SAVE_AT, "last": LAST,
               "pieces": _pieces(before), "extra": before[0]["extra"]}
    after = H.spawn(world, W.resume, payload)
    losses = [sum(r["losses"][i] for r in after) / world for i in range(LAST - SAVE_AT)]
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    assert after[0]["global_steps"] == LAST
    pieces = _pieces(after)
    for name, expected in ref_params.items():
        spec = next(s for s, _ in pieces if s.name == f"master/{name}")
        full = W.read_from_pieces(pieces, type(spec)(spec.name, spec.global_shape, spec.dtype, 0,
                                                      spec.global_numel))
        assert H.max_rel_diff(full, expected) <= 1e-5, name
