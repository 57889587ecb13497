"""Issue 35 item 2: rayzero leaves torch's, numpy's and Python's random streams where the same program
under DDP leaves them ([Note: the user's random streams]), on 2 gloo ranks: `rayzero.initialize` at
stages 0-3 (and stage 3 with CPU offload) against DistributedDataParallel, rayzero's `from_pretrained`
against transformers', an Accelerate loop with a DeepSpeed config and HF's Trainer with `deepspeed=`
(both through rayzero's `deepspeed`) against their own DDP. The states are compared after setup and
after training (dropout draws in every forward). A model transformers builds under ZeRO-3 is
compared with DeepSpeed's own build (its path draws on rank 0 only, DeepSpeed's as rayzero's).
RayZeroStrategy's cases are in test_lightning_strategy.py. One spawn runs every rayzero case."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch
from random_stream_workers import ZEROS, deepspeed_zero3_build, run_cases
from random_streams import moved_streams
from testkit.harness import spawn


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn(2, run_cases, str(tmp_path_factory.mktemp("streams")))


def _assert_where_ddp_leaves_them(cases: dict[str, dict], names) -> None:
    ddp = cases["ddp"]
    for name in names:
        for moment in ("after_setup", "after_training"):
            assert moved_streams(cases[name][moment], ddp[moment]) == [], (name, moment)


def test_initialize_leaves_the_streams_where_ddp_leaves_them(ranks):
    for result in ranks:
        _assert_where_ddp_leaves_them(result["initialize"], ZEROS)


def test_from_pretrained_draws_nothing_as_transformers_does(ranks):
    for result in ranks:
        loaded = result["from_pretrained"]
        for stage in ("stage_2", "stage_3"):
            assert moved_streams(loaded[stage], loaded["transformers"]) == [], stage


def test_a_hugging_face_model_built_under_zero3_draws_as_under_deepspeed(ranks, tmp_path):
    """transformers' ZeRO-3 build initialises on rank 0 only, after a construction that draws nothing:
    the streams are not a plain build's (nor rank 1's rank 0's), under DeepSpeed 0.19.8 as here. The
    oracle is DeepSpeed itself: the same program's streams and initial weights, rank by rank."""
    pytest.importorskip("deepspeed")
    deepspeed_ranks = spawn(2, deepspeed_zero3_build, str(tmp_path))
    for ours, theirs in zip((result["zero3_build"] for result in ranks), deepspeed_ranks):
        assert "rayzero" in ours["deepspeed"] and "rayzero" not in theirs["deepspeed"], (ours["deepspeed"], theirs["deepspeed"])
        assert moved_streams(ours["after_build"], theirs["after_build"]) == []
        assert sorted(ours["weights"]) == sorted(theirs["weights"])
        for name, weight in theirs["weights"].items():
            assert torch.equal(ours["weights"][name], weight), name


def test_an_accelerate_loop_with_a_deepspeed_config_leaves_the_streams_where_its_ddp_does(ranks):
    for result in ranks:
        cases = result["accelerate"]
        assert cases["ddp"]["trained_by"] == "DistributedDataParallel"
        assert cases["z2"]["trained_by"] == cases["z3"]["trained_by"] == "DeepSpeedEngine"  # rayzero's
        _assert_where_ddp_leaves_them(cases, ("z2", "z3"))


def test_the_hf_trainer_with_deepspeed_leaves_the_streams_where_its_ddp_does(ranks):
    for result in ranks:
        cases = result["trainer"]
        assert cases["ddp"]["trained_by"] == "DistributedDataParallel"
        assert cases["z2"]["trained_by"] == cases["z3_offload"]["trained_by"] == "DeepSpeedEngine"
        _assert_where_ddp_leaves_them(cases, ("z2", "z3_offload"))
