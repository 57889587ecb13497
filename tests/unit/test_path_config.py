"""Driver-side checks with no cluster (issue 13 items 2 and 5): a config's problems in one round with
each explanation once, HF trainer semantics, and the capacity / address checks."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rayzero.config import ConfigError
from rayzero.driver.cluster import ClusterUnreachableError, capacity, probe
from rayzero.driver.config_check import validated_config
from rayzero.engine.config_resolution import with_trainer_semantics


def test_every_problem_of_the_hf_guide_config_arrives_in_one_round_the_hint_once():
    with pytest.raises(ConfigError) as raised:
        validated_config(str(Path(__file__).resolve().parents[2] / "examples" / "ds_zero3_auto.json"), 2)
    paths = [problem.path for problem in raised.value.problems]
    assert "optimizer.params.lr" in paths and "fp16.enabled" in paths  # unresolved trainer autos
    assert not [p for p in paths if "offload" in p]  # CPU offload runs: nothing to refuse there
    assert "zero_optimization.reduce_bucket_size" not in paths  # resolved later from model.config
    assert str(raised.value).count("--trainer KEY=VALUE") == 1


def test_trainer_semantics_fill_hf_defaults_and_absent_batch_keys():
    config, facts = with_trainer_semantics({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                                           {"learning_rate": 0.1})
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_accumulation_steps"] == "auto"
    assert facts["per_device_train_batch_size"] == 8 and facts["learning_rate"] == 0.1  # HF's default, theirs
    _, validated, _ = validated_config(config, 2, facts)
    assert validated["train_batch_size"] == 16 and validated["optimizer"]["params"]["lr"] == 0.1
    with pytest.raises(ConfigError) as raised:  # no default warm-up: DeepSpeed's WarmupLR refuses 0 steps
        validated_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}, 2,
                         {"learning_rate": 0.1})
    assert [problem.path for problem in raised.value.problems] == ["scheduler.params.warmup_num_steps"]


def test_capacity_counts_what_total_resources_can_ever_hold():
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 2.0}]
    assert capacity({"CPU": 1.0}, "PACK", nodes) == 6
    assert capacity({"CPU": 1.0}, "STRICT_PACK", nodes) == 4
    assert capacity({"CPU": 1.0}, "STRICT_SPREAD", nodes) == 2
    assert capacity({"CPU": 1.0, "GPU": 1.0}, "SPREAD", nodes) == 1
    assert capacity({"CPU": 3.0}, "PACK", nodes) == 1


def test_an_address_nothing_listens_at_is_reported_in_seconds():
    started = time.monotonic()
    with pytest.raises(ClusterUnreachableError) as raised:
        probe("127.0.0.1:9", "RAY_ADDRESS")
    assert time.monotonic() - started < 5
    assert "no Ray cluster answers at 127.0.0.1:9 (RAY_ADDRESS=127.0.0.1:9)" in str(raised.value)
    probe("http://127.0.0.1:8265", "RAY_ADDRESS")  # a job-server URL is Ray's to resolve: not probed
