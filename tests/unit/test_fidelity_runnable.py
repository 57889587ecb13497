"""One check decides what this build can run ([Note: valid vs runnable]), and every entry point
uses it: `rayzero config validate`, `rayzero.initialize`, `rayzero.fit` (tests/ray) and the operator."""
from __future__ import annotations

import json

import pytest
import torch

import rayzero
from rayzero.config import ConfigError, load_config
from rayzero.config.cli import EXIT_INVALID, main
from rayzero.config.runnable import check_runnable, runnable_problems

pytestmark = pytest.mark.unit

BATCH = {"train_micro_batch_size_per_gpu": 2}


def _paths(source: dict, **kwargs) -> dict[str, str]:
    config = load_config({**BATCH, **source}, allow_unresolved=True)
    return {problem.path: str(problem) for problem in runnable_problems(config, **kwargs)}


def test_deepspeed_only_optimizers_are_valid_but_not_runnable():
    source = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}
    assert load_config({**BATCH, **source})  # DeepSpeed accepts it
    assert "DeepSpeed-only" in _paths(source)["optimizer.type"]


def test_torch_optimizers_need_zero_allow_untested_optimizer_above_stage_0_as_in_deepspeed():
    source = {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3}}}
    assert _paths(source) == {}
    assert "zero_allow_untested_optimizer" in _paths({**source, "zero_optimization": {"stage": 2}})["optimizer.type"]
    assert _paths({**source, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}) == {}


def test_adam_without_bias_correction_runs_and_refuses_what_deepspeeds_kernel_lacks():
    """DeepSpeed trains it (its BingBertSquad configs): tests/dist/test_fidelity_bias_correction.py."""
    for kind in ("Adam", "AdamW"):
        assert _paths({"optimizer": {"type": kind, "params": {"bias_correction": False, "adam_w_mode": False}}}) == {}
    for key in ("torch_adam", "amsgrad", "maximize"):
        text = _paths({"optimizer": {"type": "Adam", "params": {"bias_correction": False, key: True}}})
        assert list(text) == [f"optimizer.params.{key}"] and "bias_correction false" in text[f"optimizer.params.{key}"]


def test_autos_only_a_trainer_fills_are_refused_unless_a_trainer_is_there():
    source = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"reduce_bucket_size": "auto"}}
    problems = _paths(source)
    assert set(problems) == {"optimizer.params.lr"}  # the bucket size comes from the model
    assert _paths(source, trainer_present=True) == {}


def test_rayzeros_own_auto_checkpoint_interval_runs_without_a_trainer():
    """`checkpoint.interval: "auto"` is chosen while the run goes, not a placeholder for a trainer: a
    plain `rayzero.fit` with it was refused before any worker started (found by bench/chaos.py
    --intervals auto,...)."""
    assert _paths({"checkpoint": {"interval": "auto"}}) == {}
    config = load_config({**BATCH, "checkpoint": {"interval": "auto"}})
    check_runnable(config)
    assert config.checkpoint.interval == "auto"


def test_offload_modes_are_runnable():
    assert _paths({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "cpu"}}}) == {}


@pytest.mark.parametrize("source, path", [
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
    ({"sequence_parallel_size": 4}, "sequence_parallel_size"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}}, "zero_optimization.zenflow"),
])
def test_deepspeed_features_that_change_what_is_trained_are_refused(source, path):
    assert load_config({**BATCH, **source})  # DeepSpeed accepts each
    assert set(_paths(source)) == {path}


@pytest.mark.parametrize("source, path, words", [
    # DeepSpeed 0.19.8's own refusal (runtime/torch_autocast.py), its words
    ({"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "torch_autocast.enabled", "Cannot enable both torch autocast and zero quantized weights"),
    ({"torch_autocast": {"enabled": True, "dtype": "int8"}}, "torch_autocast.dtype", "floating dtype"),
])
def test_torch_autocast_is_refused_only_where_it_cannot_train(source, path, words):
    assert load_config({**BATCH, **source})  # DeepSpeed's parser accepts each
    problems = _paths(source)
    assert list(problems) == [path] and words in problems[path]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_autocast_runs_at_every_stage(stage):
    """DeepSpeed accepts it at every stage; the parity test is tests/dist/test_fidelity_torch_autocast.py."""
    for dtype in ("bfloat16", "torch.float16", None):
        section = {"enabled": True, **({"dtype": dtype} if dtype else {})}
        assert _paths({"torch_autocast": section, "zero_optimization": {"stage": stage}}) == {}


@pytest.mark.parametrize("source", [
    {"tensor_parallel": {"autotp_size": 1}}, {"sequence_parallel_size": 1}, {"torch_autocast": {"enabled": False}},
    {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},  # precision only: warned
])
def test_their_neutral_settings_run(source):
    assert _paths(source) == {}


def test_config_validate_refuses_what_cannot_run(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BATCH, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}))
    assert main(["validate", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "this build cannot run it" in err and "optimizer.type" in err


def test_initialize_refuses_before_building_anything():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="DeepSpeed-only"):
        rayzero.initialize(model=model, config={**BATCH, "optimizer": {"type": "Lion", "params": {}}})


def test_the_operator_reports_it_before_creating_a_rayjob():
    from rayzero_operator import spec
    problems = spec.deepspeed_problems({**BATCH, "optimizer": {"type": "OneBitLamb"}}, 2, "spec.deepspeed")
    assert [p.field for p in problems] == ["spec.deepspeed.optimizer.type"]


def test_check_runnable_raises_one_error_with_every_reason():
    config = load_config({**BATCH, "optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, allow_unresolved=True)
    with pytest.raises(ConfigError) as caught:
        check_runnable(config, "ds.json")
    assert {p.path for p in caught.value.problems} == {"optimizer.type", "optimizer.params.lr"}
