"""Fuzz the config loader: random JSON trees over DeepSpeed's keys and value types, and the corpus'
real configs (tests/data/configs/real) mutated as JSON and as bytes. Property: `load_config` returns
a RayZeroConfig or raises ConfigError whose every problem names its key path (or the file)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import examples, model_tree, mutated_bytes, mutated_json

from rayzero.config import ConfigError, RayZeroConfig, load_config

CORPUS = sorted((Path(__file__).parents[1] / "data" / "configs" / "real").glob("*.json"))
FACTS = st.fixed_dictionaries({}, optional={
    "world_size": st.one_of(st.integers(1, 64), st.sampled_from([0, -1, 10**9])),
    "hidden_size": st.one_of(st.integers(1, 8192), st.sampled_from([0, -3])),
    "allow_unresolved": st.booleans(),
    "trainer": st.dictionaries(st.sampled_from(["per_device_train_batch_size", "gradient_accumulation_steps",
                                                "learning_rate", "max_grad_norm", "weight_decay", "adam_beta1",
                                                "adam_epsilon", "fp16", "bf16", "warmup_steps", "max_steps"]),
                               st.one_of(st.integers(-2, 64), st.floats(allow_nan=True), st.booleans(), st.none(),
                                         st.text(max_size=4)), max_size=5),
})


def _load(source, facts: dict) -> None:
    try:
        config = load_config(source, **facts)
    except ConfigError as error:
        assert error.problems, error
        for problem in error.problems:
            # the key path, or for a whole-file problem the file / the top level, and a reason
            assert problem.rule, problem
            assert problem.path or problem.value is not None or problem.fix, problem
        return
    assert isinstance(config, RayZeroConfig)
    json.dumps(config.to_deepspeed_dict(), allow_nan=True)  # what was accepted also writes back out


@examples(300)
@given(tree=model_tree(RayZeroConfig), facts=FACTS)
def test_random_config_trees(tree, facts):
    for section in ("zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "checkpoint"):
        if isinstance(tree.get(section), dict):
            event(f"has a {section} section")  # --hypothesis-show-statistics: what the trees reached
    _load(tree, facts)


@examples(200)
@given(data=st.data(), index=st.integers(0, len(CORPUS) - 1), facts=FACTS)
def test_mutated_corpus_configs(data, index, facts):
    document = json.loads(CORPUS[index].read_text())
    _load(data.draw(mutated_json(document)), facts)


def test_regression_a_path_with_a_nul_byte_is_a_config_error():
    """Found by test_mutated_corpus_configs: `load_config("\x00")` raised ValueError (embedded null byte)."""
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config("\x00")


@examples(100)
@given(data=st.data(), index=st.integers(0, len(CORPUS) - 1))
def test_mutated_corpus_files(tmp_path_factory, data, index):
    text = CORPUS[index].read_bytes()
    target = tmp_path_factory.mktemp("cfg") / "ds_config.json"
    target.write_bytes(data.draw(mutated_bytes(text)))
    try:
        load_config(str(target))
    except ConfigError as error:
        assert error.source == str(target) and error.problems
        for problem in error.problems:
            assert problem.rule, problem
