"""The parts of rayzero.lightning that need no process group: DeepSpeedStrategy's signature, the
precision mapping, and the trainer state kept as JSON in a checkpoint's manifest."""
from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.plugins.precision.bitsandbytes import BitsandbytesPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from rayzero.config.errors import RayZeroValueError
from rayzero.lightning import RayZeroPrecision, RayZeroStrategy
from rayzero.lightning.checkpoints import decode_state, encode_state
from rayzero.lightning.config import engine_config
from rayzero.lightning.precision import as_rayzero_precision


def test_every_deepspeed_strategy_keyword_in_its_order_with_its_default():
    ours = inspect.signature(RayZeroStrategy.__init__).parameters
    theirs = inspect.signature(DeepSpeedStrategy.__init__).parameters
    assert list(ours) == list(theirs)
    assert {name: p.default for name, p in ours.items()} == {name: p.default for name, p in theirs.items()}


def test_strategy_names_are_registered_with_deepspeeds_presets():
    strategy = StrategyRegistry.get("rayzero_stage_3_offload")
    assert isinstance(strategy, RayZeroStrategy)
    assert strategy._keywords["stage"] == 3 and strategy._keywords["offload_parameters"] is True


def test_a_config_path_that_does_not_exist_is_refused_when_the_strategy_is_built(tmp_path):
    with pytest.raises(MisconfigurationException, match="no such file"):
        RayZeroStrategy(config=str(tmp_path / "missing.json"))


@pytest.mark.parametrize("plugin, expected", [
    (Precision(), "32-true"), (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
    (MixedPrecision("16-mixed", "cuda"), "16-mixed"), (HalfPrecision("bf16-true"), "bf16-true"),
])
def test_lightnings_precision_plugins_become_the_engines_precision(plugin, expected):
    converted = as_rayzero_precision(plugin)
    assert isinstance(converted, RayZeroPrecision) and converted.precision == expected
    strategy = RayZeroStrategy()
    strategy.precision_plugin = plugin  # what the Trainer's connector does
    assert strategy.precision_plugin.precision == expected


def test_precisions_deepspeed_refuses_are_refused():
    with pytest.raises(RayZeroValueError, match="64-true"):
        as_rayzero_precision(DoublePrecision())
    with pytest.raises(MisconfigurationException, match="BitsandbytesPrecision"):
        as_rayzero_precision(BitsandbytesPrecision.__new__(BitsandbytesPrecision))


def _trainer_state() -> dict:
    return {
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"layer.weight": torch.ones(2)}, "optimizer_states": [{"state": {}}],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3, "completed": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
            "best_model_score": torch.tensor(0.25), "kth_value": torch.tensor(math.inf),
            "best_k_models": {"/ckpt/a.ckpt": torch.tensor(0.5, dtype=torch.float64)},
            "dirpath": Path("/ckpt"), "last_model_path": ""}},
        "lr_schedulers": [{"base_lrs": [0.1], "_last_lr": [0.01], "last_epoch": 1, "gamma": 0.1,
                           "betas": (0.9, 0.999), "min_lr": -math.inf}],
        "datamodule": {1: "integer keys", "__private": None},
        "hyper_parameters": {"hidden": 32, "layers": (2, 3)},
    }


def test_trainer_state_survives_json_exactly_without_weights_and_optimizer_states():
    state = _trainer_state()
    encoded = encode_state(state)
    text = json.dumps(encoded, allow_nan=False)  # strict JSON: the manifest holds it
    decoded = decode_state(json.loads(text))
    assert "state_dict" not in decoded and "optimizer_states" not in decoded
    callbacks = decoded["callbacks"]["ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}"]
    original = state["callbacks"]["ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}"]
    assert torch.equal(callbacks["best_model_score"], original["best_model_score"])
    assert callbacks["kth_value"].item() == math.inf
    assert callbacks["best_k_models"]["/ckpt/a.ckpt"].dtype == torch.float64
    assert callbacks["dirpath"] == "/ckpt"
    assert decoded["lr_schedulers"][0]["betas"] == (0.9, 0.999) and decoded["lr_schedulers"][0]["min_lr"] == -math.inf
    assert decoded["datamodule"] == {1: "integer keys", "__private": None}
    assert decoded["hyper_parameters"] == {"hidden": 32, "layers": (2, 3)}
    assert {key: decoded[key] for key in ("epoch", "global_step", "loops")} == {
        key: state[key] for key in ("epoch", "global_step", "loops")}


def test_hyperparameters_json_cannot_carry_are_left_out_other_state_is_refused(caplog):
    state = _trainer_state()
    state["hyper_parameters"] = {"encoder": torch.nn.Linear(2, 2)}
    with caplog.at_level(logging.WARNING):
        assert "hyper_parameters" not in decode_state(encode_state(state))
    assert "hyper_parameters" in caplog.text
    state["callbacks"] = {"Custom": {"sampler": object()}}
    with pytest.raises(RayZeroValueError, match="'callbacks' cannot be stored.*Custom.sampler is a object"):
        encode_state(state)


def _trainer(**options):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **options)


def test_the_engines_config_comes_from_the_keywords_completed_by_the_trainer():
    trainer = _trainer(accumulate_grad_batches=4, gradient_clip_val=0.5)
    config = engine_config(RayZeroStrategy(stage=3, offload_optimizer=True)._keywords, trainer, "bf16-mixed")
    assert config["zero_optimization"]["stage"] == 3 and config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and config["train_micro_batch_size_per_gpu"] == 1


def test_a_given_config_replaces_the_keywords_in_deepspeedstrategys_order(tmp_path, monkeypatch):
    trainer = _trainer()
    monkeypatch.setenv("RAYZERO_CONFIG", json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}))
    run_config = engine_config(RayZeroStrategy()._keywords, trainer, "32-true")
    assert run_config["zero_optimization"] == {"stage": 2}
    assert run_config["gradient_accumulation_steps"] == 8  # the run's batch plan (elastic) wins over the Trainer's
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    assert engine_config(RayZeroStrategy()._keywords, trainer, "32-true")["zero_optimization"] == {"stage": 1}
    with pytest.warns(UserWarning, match="offload_optimizer, stage ignored"):
        explicit = engine_config(RayZeroStrategy(stage=3, offload_optimizer=True, config={"zero_optimization": {
            "stage": 0}})._keywords, trainer, "32-true")
    assert explicit["zero_optimization"] == {"stage": 0}
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches"):
        engine_config(RayZeroStrategy(config={"gradient_accumulation_steps": 2})._keywords, trainer, "32-true")


def test_defaults_rayzero_ignores_are_not_warned_about_unless_the_user_sets_them():
    from rayzero.config import load_config

    trainer = _trainer()
    quiet = engine_config(RayZeroStrategy(stage=2)._keywords, trainer, "32-true")
    assert "allgather_bucket_size" not in quiet["zero_optimization"] and "sub_group_size" not in quiet["zero_optimization"]
    assert not [note for note in load_config(quiet).notes if "ignored" in note or "not implemented" in note]
    assert "sub_group_size" in engine_config(RayZeroStrategy(stage=3)._keywords, trainer, "32-true")["zero_optimization"]
    chosen = engine_config(RayZeroStrategy(stage=2, allgather_bucket_size=5e7)._keywords, trainer, "32-true")
    assert any("allgather_bucket_size" in note for note in load_config(chosen).notes)
