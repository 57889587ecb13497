"""RayZeroConfig.from_lightning: Lightning's DeepSpeedStrategy keywords give the same config as
the DeepSpeed JSON Lightning generates."""
from __future__ import annotations

import json

import pytest

from rayzero.config import ConfigError, RayZeroConfig, load_config


def test_defaults_match_lightnings_generated_config():
    expected = load_config({
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                              "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000,
                              "sub_group_size": 1_000_000_000_000},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False,
                                     "synchronize_checkpoint_boundary": False},
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
        "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
    })
    assert RayZeroConfig.from_lightning() == expected


def test_stage3_offload_fp16_keywords_equal_the_equivalent_json():
    config = RayZeroConfig.from_lightning(
        stage=3, offload_optimizer=True, offload_parameters=True, offload_params_device="nvme",
        offload_optimizer_device="nvme", nvme_path="/mnt/nvme", params_buffer_count=6, params_buffer_size=2e8,
        max_in_cpu=1e8, optimizer_buffer_count=5, pin_memory=True, block_size=262144, queue_depth=16,
        thread_count=2, single_submit=True, overlap_events=False, sub_group_size=1e8, reduce_bucket_size=1e6,
        allgather_bucket_size=1e6, contiguous_gradients=False, overlap_comm=False, reduce_scatter=False,
        allgather_partitions=False, precision="16-mixed", loss_scale=128, initial_scale_power=12,
        loss_scale_window=500, hysteresis=3, min_loss_scale=0.5, cpu_checkpointing=True,
        logging_batch_size_per_gpu=4, accumulate_grad_batches=2, gradient_clip_val=1.0,
    )
    equivalent = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3, "contiguous_gradients": False, "overlap_comm": False, "allgather_partitions": False,
            "reduce_scatter": False, "allgather_bucket_size": 1e6, "reduce_bucket_size": 1e6, "sub_group_size": 1e8,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme", "buffer_count": 5, "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": "/mnt/nvme", "buffer_count": 6, "buffer_size": 2e8,
                              "max_in_cpu": 1e8, "pin_memory": True}},
        "activation_checkpointing": {"cpu_checkpointing": True},
        "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": True,
                "overlap_events": False},
        "fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "min_loss_scale": 0.5},
    }
    assert config == load_config(equivalent)
    assert config.zero_optimization.offload_param.buffer_size == 200_000_000


def test_config_keyword_replaces_the_defaults(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "fp16": {"enabled": False}}))
    config = RayZeroConfig.from_lightning(config=str(path), stage=3, precision="16-mixed")
    assert config.zero_optimization.stage == 1  # Lightning ignores the keywords when config is given
    assert config.fp16.enabled is False  # the config's own fp16 block wins over the Trainer's precision
    config = RayZeroConfig.from_lightning(config={"zero_optimization": {"stage": 1}}, precision="bf16-mixed")
    assert config.bf16.enabled is True


def test_registered_strategy_names():
    config = RayZeroConfig.from_lightning(strategy="deepspeed_stage_3_offload", precision="bf16-mixed")
    assert config.zero_optimization.stage == 3 and config.zero_optimization.offload_param_device == "cpu"
    assert config.bf16.enabled is True
    with pytest.raises(ConfigError, match="deepspeed_stage_3_offload"):
        RayZeroConfig.from_lightning(strategy="deepspeed_stage_3_ofload")


def test_unknown_keyword_suggests_and_plumbing_keywords_are_noted():
    with pytest.raises(ConfigError, match="did you mean `from_lightning.offload_parameters`"):
        RayZeroConfig.from_lightning(offload_parameter=True)
    config = RayZeroConfig.from_lightning(load_full_weights=True, remote_device="cpu")
    assert any("load_full_weights" in n for n in config.notes)
    assert any("remote_device" in n for n in config.notes)


def test_the_train_dataloaders_batch_size_fills_the_micro_batch_unless_set():
    # DeepSpeedStrategy._format_batch_size_and_grad_accum_config: the dataloader's batch size, unless
    # the config (or logging_batch_size_per_gpu) names one
    assert RayZeroConfig.from_lightning(batch_size=8).train_micro_batch_size_per_gpu == 8
    assert RayZeroConfig.from_lightning(batch_size=8, logging_batch_size_per_gpu=4).train_micro_batch_size_per_gpu == 4
    config = RayZeroConfig.from_lightning(config={"train_micro_batch_size_per_gpu": 2}, batch_size=8)
    assert config.train_micro_batch_size_per_gpu == 2
