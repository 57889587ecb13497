"""bench/gpu.py's `transformers` section: its rows, its like-for-like config, its model.

The section's figures need a GPU (bench/gpu_check.sh); its CPU dry run takes minutes (one process
per row), so these tests check what makes the rows comparable: DeepSpeed's own defaults (read from
DeepSpeed's config model, not from the bench), one config for rayzero and DeepSpeed, one process
per row, and the model transformers builds.
"""
from __future__ import annotations

import pytest
import torch

from bench import gpu, models
from bench.engine_systems import _torch_optimizer, engine_config
from bench.gpu_transformers import TRANSFORMERS_CONFIG, transformers_jobs


def test_the_zero_knobs_are_deepspeeds_own_defaults() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig(stage=3).model_dump(by_alias=True)
    for key, value in TRANSFORMERS_CONFIG["zero_optimization"].items():
        assert defaults[key] == value, key


def test_each_row_is_its_own_process_and_rayzero_gets_deepspeeds_config() -> None:
    jobs = transformers_jobs()
    assert all(len(job["variants"]) == 1 and len(job["models"]) == 1 for job in jobs)
    assert len({job["name"] for job in jobs}) == len(jobs) == 12
    by_row = {(job["variants"][0]["label"], job["models"][0]): job["variants"][0] for job in jobs}
    for model in ("gpt2-medium", "gpt2-xl"):
        assert {"rayzero-stage3", "fsdp2", "deepspeed-stage3", "rayzero-stage2", "deepspeed-stage2"} \
            <= {label for label, row_model in by_row if row_model == model}
    for label in ("stage3", "stage2", "stage3-offload-cpu"):
        model = "gpt2-medium"
        assert by_row[(f"rayzero-{label}", model)]["extra"] == by_row[(f"deepspeed-{label}", model)]["extra"]
    offload = engine_config(3, 8, by_row[("rayzero-stage3-offload-cpu", "gpt2-medium")]["extra"])
    zero = offload["zero_optimization"]
    assert zero["offload_param"]["pin_memory"] and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["stage3_max_reuse_distance"] == 1_000_000_000 and "optimizer" not in offload
    assert offload["bf16"] == {"enabled": True} and offload["gradient_clipping"] == 0.0


def test_the_client_optimizer_is_fused_adamw_from_the_config_section() -> None:
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = _torch_optimizer([parameter], "fused", TRANSFORMERS_CONFIG)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["fused"]) == (1e-4, 0.01, True)
    assert type(_torch_optimizer([parameter], "fused")) is torch.optim.Adam  # the other sections' as before


@pytest.mark.parametrize("name", models.TRANSFORMERS)
def test_transformers_gpt2_has_gpt2s_shape_and_one_fsdp2_unit_per_block(name: str) -> None:
    shape = models.GPU[name]
    with torch.device("meta"):
        model = models.TransformersGPT2(shape)
    expected = {"gpt2-medium": 354_823_168, "gpt2-xl": 1_557_611_200}[name]  # GPT-2's published sizes
    assert models.trainable_parameters(model) == expected
    language_model = model.language_model
    assert language_model.lm_head.weight is language_model.transformer.wte.weight
    assert len(models.sharding_units(model)) == shape.depth
    tiny = models.build_model(name, "quick")
    tokens, targets = models.batch(name, "quick", step=0, rank=0)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    loss = tiny(tokens, targets).detach()
    assert loss.dtype == torch.float32 and abs(float(loss) - torch.log(torch.tensor(1000.0))) < 0.1


def test_the_gpu_bench_names_an_unknown_section() -> None:
    with pytest.raises(SystemExit):
        gpu.main(["--sections", "transformer"])
