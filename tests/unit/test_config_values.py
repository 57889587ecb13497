"""Value forms, strictness and error reporting of rayzero.config (pure logic)."""
from __future__ import annotations

import pytest

from rayzero.config import ConfigError, RayZeroConfig, load_config


def _problems(source: dict, **facts) -> dict[str, str]:
    """path -> full problem text, for a config that must fail."""
    with pytest.raises(ConfigError) as caught:
        load_config(source, **facts)
    return {problem.path: str(problem) for problem in caught.value.problems}


def test_integer_forms_json_configs_use():
    config = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
                                                "stage3_prefetch_bucket_size": 0.94e6,
                                                "stage3_max_live_parameters": "1e9"}})
    zero = config.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.max_live_parameters) == \
        (500_000_000, 940_000, 1_000_000_000)
    assert isinstance(zero.prefetch_bucket_size, int)


def test_fractional_element_count_is_rounded_with_a_note():
    # The HF guide prints 0.9·h² for h = 1024: 943718.4. DeepSpeed refuses it; the meaning is obvious.
    config = load_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 943718.4,
                                                "reduce_bucket_size": "1.5e6"}})
    assert config.zero_optimization.prefetch_bucket_size == 943718
    assert config.zero_optimization.reduce_bucket_size == 1_500_000
    assert any(n.startswith("rounded: zero_optimization.stage3_prefetch_bucket_size") for n in config.notes)


def test_fractional_integer_that_is_not_an_element_count_is_refused_with_path_and_fix():
    problems = _problems({"gradient_accumulation_steps": 2.5, "fp16": {"hysteresis": 1.5}})
    for path in ("gradient_accumulation_steps", "fp16.hysteresis"):
        assert "fractional part" in problems[path] and "whole number" in problems[path]


@pytest.mark.parametrize("written, expected", [("true", True), ("false", False), ("TRUE", True), (True, True)])
def test_boolean_strings(written, expected):
    config = load_config({"zero_optimization": {"overlap_comm": written}})
    assert config.zero_optimization.overlap_comm is expected


def test_bool_is_not_an_integer_and_junk_is_not_a_bool():
    problems = _problems({"train_micro_batch_size_per_gpu": True, "wall_clock_breakdown": "yes"})
    assert "boolean" in problems["train_micro_batch_size_per_gpu"]
    assert "true or false" in problems["wall_clock_breakdown"]


@pytest.mark.parametrize("source, path, suggestion", [
    ({"gradient_clipp1ng": 1.0}, "gradient_clipp1ng", "gradient_clipping"),
    ({"zero_optimization": {"stage3_prefetch_bucket_sise": 5}}, "zero_optimization.stage3_prefetch_bucket_sise",
     "zero_optimization.stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"offload_param": {"buffer_cuont": 5}}},
     "zero_optimization.offload_param.buffer_cuont", "zero_optimization.offload_param.buffer_count"),
    ({"fp16": {"loss_scale_windw": 10}}, "fp16.loss_scale_windw", "fp16.loss_scale_window"),
    ({"aio": {"queue_dpth": 4}}, "aio.queue_dpth", "aio.queue_depth"),
    ({"checkpoint": {"use_node_local_storag": True}}, "checkpoint.use_node_local_storag",
     "checkpoint.use_node_local_storage"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decya": 0.1}}}, "optimizer.params.weight_decya",
     "optimizer.params.weight_decay"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_l": 0.1}}}, "scheduler.params.warmup_max_l",
     "scheduler.params.warmup_max_lr"),
])
def test_unknown_keys_at_every_level_suggest_the_nearest(source, path, suggestion):
    text = _problems(source)[path]
    assert "unknown key" in text and f"did you mean `{suggestion}`" in text


def test_unknown_key_with_nothing_close_lists_the_valid_ones():
    text = _problems({"bf16": {"zzz": 1}})["bf16.zzz"]
    assert "valid keys here" in text and "enabled" in text


def test_every_problem_is_reported_at_once_with_path_value_and_rule():
    problems = _problems({
        "gradient_clipp1ng": 1.0,
        "train_batch_size": -4,
        "communication_data_type": "bf61",
        "zero_optimization": {"stage": 7, "offload_param": {"device": "nvme", "buffer_count": -1}},
        "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}},
    })
    assert set(problems) >= {"gradient_clipp1ng", "train_batch_size", "communication_data_type",
                             "zero_optimization.stage", "zero_optimization.offload_param.buffer_count",
                             "optimizer.params.betas"}
    assert "-1" in problems["zero_optimization.offload_param.buffer_count"]
    assert ">= 0" in problems["zero_optimization.offload_param.buffer_count"]
    assert "did you mean 'bf16'" in problems["communication_data_type"]
    assert "less than or equal to 3" in problems["zero_optimization.stage"]


def test_cross_field_rules_still_run_when_a_field_is_invalid():
    # the typo and the offload rule are independent: both must be reported in one run
    problems = _problems({"gradient_clipp1ng": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "gradient_clipp1ng" in problems and "zero_optimization.offload_param.nvme_path" in problems


def test_attribute_names_and_deepspeed_aliases_are_the_same_setting():
    by_alias = load_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7}})
    by_name = load_config({"zero_optimization": {"stage": 3, "param_persistence_threshold": 7}})
    assert by_alias == by_name and by_name.zero_optimization.param_persistence_threshold == 7
    assert by_name.to_deepspeed_dict()["zero_optimization"]["stage3_param_persistence_threshold"] == 7
    text = _problems({"zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}})
    assert "given twice" in text["zero_optimization.max_live_parameters"]


def test_overlap_comm_default_depends_on_stage():
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False


def test_round_trip_and_problem_survive_pickling():
    import pickle

    config = load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                          "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2})
    assert load_config(config.to_deepspeed_dict()) == config
    assert load_config(config) == config
    with pytest.raises(ConfigError) as caught:
        load_config({"gradient_clipp1ng": 1})
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.problems == caught.value.problems and "gradient_clipping" in str(again)


def test_file_errors_name_the_file_and_position(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "zero_optimization": {"stage": 2\n  "overlap_comm": true}\n}\n')
    with pytest.raises(ConfigError, match=r"not valid JSON: Expecting ',' delimiter at line 3"):
        load_config(broken)
    listing = tmp_path / "list.json"
    listing.write_text("[1]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(str(listing))


def test_json_schema_names_deepspeed_keys():
    schema = RayZeroConfig.model_json_schema(by_alias=True)
    zero = schema["$defs"]["ZeroConfig"]["properties"]
    assert "stage3_prefetch_bucket_size" in zero and zero["stage"]["maximum"] == 3
    assert schema["additionalProperties"] is False
