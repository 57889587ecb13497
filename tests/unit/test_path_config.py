"""Driver-side checks with no cluster (issue 13 items 2 and 5): a config's problems in one round with
each explanation once, HF trainer semantics, and the capacity / address checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayzero.config import ConfigError, load_config
from rayzero.config.trainer import with_trainer_semantics
from rayzero.driver.cluster import ClusterUnreachableError, capacity, probe
from rayzero.driver.config_check import validated_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    # no warm-up given: one step, as HF 5.24 fills it (DeepSpeed 0.19.6+ refuses 0)
    _, validated, _ = validated_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
                                       2, {"learning_rate": 0.1})
    assert validated["scheduler"]["params"]["warmup_num_steps"] == 1


def _auto_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _auto_paths(value, (*prefix, key))
        elif value == "auto":
            yield (*prefix, key)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("arguments", [
    {"learning_rate": 3e-3, "per_device_train_batch_size": 4},
    {"learning_rate": 1e-4, "warmup_steps": 5, "weight_decay": 0.01, "adam_beta2": 0.98, "max_grad_norm": 0.5},
    {"warmup_steps": 0.1, "max_steps": 100, "gradient_accumulation_steps": 2, "adam_epsilon": 1e-6},
])
def test_trainer_autos_are_filled_as_transformers_fills_them(tmp_path, arguments):
    """The oracle is transformers' own HfTrainerDeepSpeedConfig, on the guide's full-"auto" ZeRO-3 file."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    written = json.loads((EXAMPLES / "ds_zero3_auto.json").read_text())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **arguments)
    theirs = HfTrainerDeepSpeedConfig(json.loads(json.dumps(written)))
    theirs.trainer_config_process(args)
    model = torch.nn.Linear(64, 64)
    model.config = type("Config", (), {"hidden_size": 64})()
    theirs.trainer_config_finalize(args, model, arguments.get("max_steps", 100))
    config, facts = with_trainer_semantics(written, {"max_steps": 100, **arguments})
    ours = load_config(config, world_size=1, hidden_size=64, trainer=facts).to_deepspeed_dict()
    for path in _auto_paths(written):
        expected, got = _at(theirs.config, path), _at(ours, path)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == pytest.approx(
            list(expected) if isinstance(expected, (list, tuple)) else expected), path


def test_capacity_counts_what_total_resources_can_ever_hold():
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 2.0}]
    assert capacity({"CPU": 1.0}, "PACK", nodes) == 6
    assert capacity({"CPU": 1.0}, "STRICT_PACK", nodes) == 4
    assert capacity({"CPU": 1.0}, "STRICT_SPREAD", nodes) == 2
    assert capacity({"CPU": 1.0, "GPU": 1.0}, "SPREAD", nodes) == 1
    assert capacity({"CPU": 3.0}, "PACK", nodes) == 1


def test_an_address_nothing_listens_at_is_reported_in_seconds():
    with pytest.raises(ClusterUnreachableError) as raised:  # the probe's own short connect, not Ray's wait
        probe("127.0.0.1:9", "RAY_ADDRESS")
    assert "no Ray cluster answers at 127.0.0.1:9 (RAY_ADDRESS=127.0.0.1:9)" in str(raised.value)
    probe("http://127.0.0.1:8265", "RAY_ADDRESS")  # a job-server URL is Ray's to resolve: not probed


def test_a_config_passed_inside_a_run_that_has_one_says_the_run_s_is_used_without_it(tmp_path, monkeypatch):
    """A first-hour slip: a `rayzero run --config ds.json` loop calls initialize(config=config) with
    fit's train_loop_config (`{}`). The error names the rejected config and how to train with the run's."""
    import json

    import pytest
    import torch

    import rayzero
    from rayzero.config import ConfigError

    run_config = tmp_path / "ds.json"
    run_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    monkeypatch.setenv("RAYZERO_CONFIG", str(run_config))
    with pytest.raises(ConfigError) as raised:
        rayzero.initialize(model=torch.nn.Linear(4, 1), config={})
    message = str(raised.value)
    assert "train_batch_size" in message and "train_micro_batch_size_per_gpu" in message  # the problem, as before
    assert f"config passed to initialize(), not this run's config ($RAYZERO_CONFIG: {run_config}" in message
    assert "leave config= out to train with the run's" in message
    engine = rayzero.initialize(model=torch.nn.Linear(4, 1))[0]  # as the message says
    assert engine.train_micro_batch_size_per_gpu() == 1
    monkeypatch.delenv("RAYZERO_CONFIG")  # no run config: the error is as it always was
    with pytest.raises(ConfigError, match=r"^1 problem\(s\) in config:") as raised:
        rayzero.initialize(model=torch.nn.Linear(4, 1), config={})
    assert "RAYZERO_CONFIG" not in str(raised.value)
