"""The `checkpoint` section's tier settings: validation messages, defaults, and how the checkpoint
layer reads them ([Note: checkpoint settings precedence] in rayzero/checkpoint/options.py)."""
from __future__ import annotations

import json

import dataclasses
import subprocess
import sys

import pytest

from rayzero.checkpoint.options import CheckpointOptions
from rayzero.config import ConfigError, load_config


def _problems(section: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config({"checkpoint": section})
    return {problem.path: str(problem) for problem in caught.value.problems}


@pytest.mark.parametrize("key, value, rule", [
    ("keep_last", -1, ">= 0"),
    ("replicas", -2, ">= 0"),
    ("upload_threads", 0, ">= 1"),
    ("timeout_s", 0, "> 0"),
    ("async_save", "sometimes", "true or false"),
    ("durable_uri", "my-bucket/run1", "pyarrow.fs URI"),
    ("keep_last", 2.5, "whole number"),
])
def test_bad_value_names_the_key_the_value_and_the_rule(key, value, rule):
    text = _problems({key: value})[f"checkpoint.{key}"]
    assert f"checkpoint.{key} = {json.dumps(value)}" in text and rule in text  # values shown as JSON


def test_every_problem_in_the_section_is_reported_at_once():
    problems = _problems({"keep_last": -1, "upload_threads": 0, "replicas": "two"})
    assert set(problems) == {"checkpoint.keep_last", "checkpoint.upload_threads", "checkpoint.replicas"}


@pytest.mark.parametrize("typo, suggestion", [
    ("keep_lst", "checkpoint.keep_last"), ("durable_url", "checkpoint.durable_uri"),
    ("asyncsave", "checkpoint.async_save"), ("upload_thread", "checkpoint.upload_threads"),
])
def test_unknown_key_suggests_the_nearest(typo, suggestion):
    text = _problems({typo: 1})[f"checkpoint.{typo}"]
    assert "unknown key" in text and suggestion in text


def test_values_reach_the_checkpoint_layer_and_round_trip():
    config = load_config({"checkpoint": {"use_node_local_storage": True, "replicas": 2, "keep_last": "1",
                                         "durable_uri": "s3://bucket/run", "async_save": "false",
                                         "upload_threads": 3, "timeout_s": 90, "tag_validation": "Fail"}})
    options = CheckpointOptions.from_config(config)
    assert (options.node_local, options.replicas, options.keep_last, options.durable_uri, options.async_save,
            options.upload_threads, options.timeout_s, options.tag_validation) == \
        (True, 2, 1, "s3://bucket/run", False, 3, 90.0, "Fail")
    assert load_config(config.to_deepspeed_dict()).checkpoint == config.checkpoint


def test_config_defaults_are_the_checkpoint_layer_defaults():
    section = load_config({}).checkpoint
    defaults = CheckpointOptions()
    for field in dataclasses.fields(CheckpointOptions):
        source = "use_node_local_storage" if field.name == "node_local" else field.name
        if hasattr(section, source):
            value = getattr(section, source)
            assert getattr(value, "value", value) == getattr(defaults, field.name), field.name
    assert CheckpointOptions.from_config(load_config({})) == defaults


def test_environment_overrides_config_and_keywords_override_both(monkeypatch):
    config = load_config({"checkpoint": {"keep_last": 1, "async_save": False, "durable_uri": "file:///tmp/a"}})
    monkeypatch.setenv("RAYZERO_CHECKPOINT_KEEP_LAST", "7")
    monkeypatch.setenv("RAYZERO_CHECKPOINT_ASYNC_SAVE", "true")
    monkeypatch.setenv("RAYZERO_DURABLE_URI", "")  # blank turns the configured durable copy off
    options = CheckpointOptions.from_config(config)
    assert (options.keep_last, options.async_save, options.durable_uri) == (7, True, None)
    assert CheckpointOptions.from_config(config, keep_last=2).keep_last == 2
    monkeypatch.delenv("RAYZERO_CHECKPOINT_KEEP_LAST")
    assert CheckpointOptions.from_config(config).keep_last == 1


@pytest.mark.parametrize("variable, text, expected", [
    ("RAYZERO_CHECKPOINT_UPLOAD_THREADS", "many", "RAYZERO_CHECKPOINT_UPLOAD_THREADS = 'many'"),
    ("RAYZERO_CHECKPOINT_ASYNC_SAVE", "maybe", "true or false"),
    ("RAYZERO_CHECKPOINT_REPLICAS", "-1", "set by the environment variable RAYZERO_CHECKPOINT_REPLICAS"),
])
def test_bad_environment_value_names_the_variable(monkeypatch, variable, text, expected):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError, match="checkpoint") as caught:
        CheckpointOptions.from_config(load_config({}))
    assert expected in str(caught.value)


def test_config_layer_imports_neither_torch_nor_ray():
    code = ("import sys, rayzero.config; rayzero.config.load_config({'checkpoint': {'keep_last': 1}}); "
            "print(sorted(m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
