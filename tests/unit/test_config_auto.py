""""auto" resolution and batch-size derivation (HF Trainer semantics, DeepSpeed's batch rule)."""
from __future__ import annotations

import logging

import pytest

from rayzero.config import ConfigError, load_config

HF_TRAINER = {
    "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5,
    "learning_rate": 3e-5, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6, "weight_decay": 0.01,
    "warmup_steps": 50, "max_steps": 1000, "fp16": False, "bf16": True,
}
AUTO_CONFIG = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def _problems(source, **facts) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(source, **facts)
    return {problem.path: str(problem) for problem in caught.value.problems}


def test_everything_resolves_from_hidden_size_world_size_and_trainer(caplog):
    with caplog.at_level(logging.INFO, logger="rayzero.config"):
        config = load_config(AUTO_CONFIG, world_size=8, hidden_size=1024, trainer=HF_TRAINER)
    zero = config.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == \
        (1024 * 1024, int(0.9 * 1024 * 1024), 10 * 1024)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps, config.train_batch_size) == \
        (4, 2, 64)
    assert config.gradient_clipping == 0.5 and config.bf16.enabled is True
    assert config.optimizer.params == {"lr": 3e-5, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}
    assert config.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 50,
                                       "total_num_steps": 1000}
    assert config.unresolved_autos() == []
    expected = "auto: zero_optimization.reduce_bucket_size = 1048576 from hidden_size=1024 (h²)"
    assert expected in config.notes and expected in caplog.text
    assert any("train_batch_size = 64" in n and "world_size=8" in n for n in config.notes)


def test_unresolvable_auto_names_the_key_and_what_would_provide_it():
    problems = _problems(AUTO_CONFIG)
    assert "--hidden-size" in problems["zero_optimization.stage3_prefetch_bucket_size"]
    assert "learning_rate" in problems["optimizer.params.lr"]
    assert "adam_beta1 and adam_beta2" in problems["optimizer.params.betas"]
    assert "per_device_train_batch_size" in problems["train_micro_batch_size_per_gpu"]
    assert "--world-size" in problems["train_batch_size"]
    assert "max_steps" in problems["scheduler.params.total_num_steps"]
    assert all("cannot be resolved" in text for text in problems.values())


def test_allow_unresolved_keeps_auto_and_round_trips():
    config = load_config(AUTO_CONFIG, allow_unresolved=True)
    assert config.zero_optimization.reduce_bucket_size == "auto"
    assert "zero_optimization.reduce_bucket_size" in config.unresolved_autos()
    assert any("still \"auto\"" in n for n in config.notes)
    assert load_config(config.to_deepspeed_dict(), allow_unresolved=True) == config
    # later, with the facts, the kept config resolves (the engine's second pass)
    resolved = load_config(config, world_size=2, hidden_size=64, trainer=HF_TRAINER)
    assert resolved.zero_optimization.reduce_bucket_size == 64 * 64 and resolved.train_batch_size == 16


def test_warmup_ratio_fills_warmup_steps():
    config = load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
                         trainer={"warmup_ratio": 0.1, "max_steps": 95})
    assert config.scheduler.params["warmup_num_steps"] == 10


@pytest.mark.parametrize("given, derived", [
    ({"train_micro_batch_size_per_gpu": 4}, (32, 4, 1)),
    ({"train_batch_size": 32}, (32, 4, 1)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, (64, 4, 2)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, (64, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (48, 2, 3)),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (48, 2, 3)),
])
def test_batch_keys_are_derived_like_deepspeed(given, derived):
    config = load_config(given, world_size=8)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == derived


@pytest.mark.parametrize("given, derived", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}, (64, 2, 4)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, (64, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}, (32, 4, 1)),
])
def test_an_auto_batch_key_the_other_two_determine_is_derived_as_its_hint_says(given, derived):
    # found as a user: the hint said "train_batch_size with world_size" and following it still failed
    config = load_config(given, world_size=8)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == derived


def test_auto_micro_batch_and_accumulation_together_stay_unresolved_without_the_trainer():
    problems = _problems({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto"}, world_size=8)
    assert "gradient_accumulation_steps value" in problems["train_micro_batch_size_per_gpu"]
    assert "gradient_accumulation_steps" in problems


def test_inconsistent_batch_keys_show_the_arithmetic():
    text = _problems({"train_batch_size": 50, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
                     world_size=8)["train_batch_size"]
    assert "4 × 1 × 8 = 32" in text
    text = _problems({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=8)["train_batch_size"]
    assert "multiple of 32" in text
    assert "is required" in _problems({}, world_size=2)["train_batch_size"]


def test_explicit_value_disagreeing_with_the_trainer_is_an_error():
    text = _problems({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                     trainer={"per_device_train_batch_size": 4, "learning_rate": 1e-3})
    assert "disagrees with trainer per_device_train_batch_size = 4" in text["train_micro_batch_size_per_gpu"]
    assert "optimizer.params.lr" not in text  # they agree


def test_trainer_arguments_are_checked_too():
    problems = _problems({}, trainer={"learnin_rate": 1.0}, world_size=0)
    assert "did you mean `trainer.learning_rate`" in problems["trainer.learnin_rate"]
    assert "positive integer" in problems["world_size"]


def test_amp_auto_follows_the_trainer_backend():
    config = load_config({"amp": {"enabled": "auto", "opt_level": "auto"}, "fp16": {"enabled": "auto"}},
                         trainer={"fp16": True, "fp16_opt_level": "O2"})
    assert config.amp.enabled is False and config.amp.opt_level == "O2" and config.fp16.enabled is True
    problems = _problems({"amp": {"enabled": "auto"}}, trainer={"fp16": True, "half_precision_backend": "apex"})
    assert "apex AMP is not supported" in problems["amp.enabled"]


def test_second_pass_on_a_loaded_config_does_not_treat_defaults_as_choices():
    # the driver validates without facts; the engine re-loads the model with the trainer's
    first = load_config({"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"}}, allow_unresolved=True)
    second = load_config(first, world_size=2, trainer={"per_device_train_batch_size": 3, "max_grad_norm": 0.5,
                                                       "fp16": True})
    assert second.train_batch_size == 6 and second.fp16.enabled is True
    assert second.gradient_clipping == 1.0  # not "auto" in the file: the trainer does not override it
