"""`RayZeroConfig.from_lightning(**kwargs)`: Lightning's `DeepSpeedStrategy` keywords in, the same
config out as the equivalent DeepSpeed JSON.

Mirrors lightning.pytorch.strategies.DeepSpeedStrategy: its `__init__` defaults, how
`_create_default_config` turns keywords into a DeepSpeed dict (ignored entirely when `config` is
given), how `_format_precision_config` adds `fp16`/`bf16` from the Trainer's precision, and how the
Trainer's `accumulate_grad_batches` / `gradient_clip_val` fill the batch and clipping keys.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from rayzero.config.errors import ConfigError, unknown_key_problem

if TYPE_CHECKING:
    from rayzero.config.model import RayZeroConfig

# DeepSpeedStrategy.__init__ parameters and their Lightning defaults.
LIGHTNING_DEFAULTS: dict[str, Any] = {
    "zero_optimization": True,
    "stage": 2,
    "remote_device": None,
    "offload_optimizer": False,
    "offload_parameters": False,
    "offload_params_device": "cpu",
    "nvme_path": "/local_nvme",
    "params_buffer_count": 5,
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "offload_optimizer_device": "cpu",
    "optimizer_buffer_count": 4,
    "block_size": 1_048_576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
    "pin_memory": False,
    "sub_group_size": 1_000_000_000_000,
    "contiguous_gradients": True,
    "overlap_comm": True,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "zero_allow_untested_optimizer": True,
    "logging_batch_size_per_gpu": "auto",
    "config": None,
    "logging_level": logging.WARN,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False,
    "load_full_weights": False,
    "exclude_frozen_parameters": False,
    # Strategy plumbing with no config key: accepted, ignored with a note when set.
    "accelerator": None,
    "parallel_devices": None,
    "cluster_environment": None,
    "precision_plugin": None,
    "process_group_backend": None,
    "timeout": None,
}
# Lightning's registered strategy names (`Trainer(strategy="deepspeed_stage_3_offload")`).
LIGHTNING_PRESETS: dict[str, dict[str, Any]] = {
    "deepspeed": {},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    "deepspeed_stage_3_offload_nvme": {
        "stage": 3, "offload_optimizer": True, "offload_parameters": True, "remote_device": "nvme",
        "offload_params_device": "nvme", "offload_optimizer_device": "nvme",
    },
}
# Trainer arguments Lightning folds into the DeepSpeed config; `batch_size` is the train dataloader's
# (DeepSpeedStrategy's `_auto_select_batch_size`), None when unknown.
TRAINER_DEFAULTS: dict[str, Any] = {"precision": "32-true", "accumulate_grad_batches": 1, "gradient_clip_val": None,
                                    "batch_size": None}

_NO_CONFIG_KEY = {
    "remote_device": "rayzero builds large models on the meta device and materialises shards itself",
    "load_full_weights": "rayzero checkpoints load at any world size; a full state dict loads with "
                         "`rayzero.initialize(..., model=model)` after `model.load_state_dict`",
    "exclude_frozen_parameters": "not implemented: frozen parameters are saved",
    "logging_level": "set the level of the `rayzero` logger instead",
    "accelerator": "Ray places workers", "parallel_devices": "Ray places workers",
    "cluster_environment": "Ray places workers", "precision_plugin": "use `precision`",
    "process_group_backend": "chosen by rayzero (nccl with GPUs, gloo without)",
    "timeout": "set in the driver's run settings",
}


def lightning_to_dict(kwargs: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """The DeepSpeed dict Lightning would hand to DeepSpeed for these keywords."""
    kwargs = dict(kwargs)
    preset = kwargs.pop("strategy", None)
    if preset is not None:
        if preset not in LIGHTNING_PRESETS:
            raise ConfigError([unknown_key_problem("from_lightning.strategy", str(preset), preset,
                                                   LIGHTNING_PRESETS)], "DeepSpeedStrategy keywords")
        kwargs = {**LIGHTNING_PRESETS[preset], **kwargs}  # explicit keywords win over the preset
    known = {**LIGHTNING_DEFAULTS, **TRAINER_DEFAULTS}
    unknown = [key for key in kwargs if key not in known]
    if unknown:
        raise ConfigError([unknown_key_problem("from_lightning", key, kwargs[key], known) for key in unknown],
                          "DeepSpeedStrategy keywords")
    args = {**known, **kwargs}
    for key, why in _NO_CONFIG_KEY.items():
        if args[key] != LIGHTNING_DEFAULTS[key]:
            notes.append(f"ignored: DeepSpeedStrategy({key}={args[key]!r}) has no DeepSpeed config key ({why})")
    cfg = _load_user_config(args["config"])
    if cfg is None:
        cfg = _default_config(args)
    _format_precision(cfg, args)
    # Lightning's _format_batch_size_and_grad_accum_config and _format_config fill these from the Trainer.
    cfg.setdefault("gradient_accumulation_steps", args["accumulate_grad_batches"])
    if args["batch_size"] is not None:
        cfg.setdefault("train_micro_batch_size_per_gpu", args["batch_size"])
    cfg.setdefault("gradient_clipping", args["gradient_clip_val"] or 0.0)
    return cfg


def _load_user_config(config: Optional[Union[str, Path, Mapping[str, Any]]]) -> Optional[dict[str, Any]]:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # a deep copy we may add keys to
    return json.loads(Path(config).read_text())


def _default_config(args: Mapping[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "activation_checkpointing": {
            "partition_activations": args["partition_activations"],
            "cpu_checkpointing": args["cpu_checkpointing"],
            "contiguous_memory_optimization": args["contiguous_memory_optimization"],
            "synchronize_checkpoint_boundary": args["synchronize_checkpoint_boundary"],
        },
        "aio": {
            "block_size": args["block_size"],
            "queue_depth": args["queue_depth"],
            "single_submit": args["single_submit"],
            "overlap_events": args["overlap_events"],
            "thread_count": args["thread_count"],
        },
    }
    if args["zero_optimization"]:
        zero = {key: args[key] for key in (
            "stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
            "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")}
        if args["offload_optimizer"]:
            zero["offload_optimizer"] = {
                "device": args["offload_optimizer_device"],
                "nvme_path": args["nvme_path"],
                "buffer_count": args["optimizer_buffer_count"],
                "pin_memory": args["pin_memory"],
            }
        if args["offload_parameters"]:
            zero["offload_param"] = {
                "device": args["offload_params_device"],
                "nvme_path": args["nvme_path"],
                "buffer_count": args["params_buffer_count"],
                "buffer_size": args["params_buffer_size"],
                "max_in_cpu": args["max_in_cpu"],
                "pin_memory": args["pin_memory"],
            }
        cfg = {"zero_allow_untested_optimizer": args["zero_allow_untested_optimizer"], "zero_optimization": zero, **cfg}
    if args["logging_batch_size_per_gpu"] != "auto":
        cfg = {"train_micro_batch_size_per_gpu": args["logging_batch_size_per_gpu"], **cfg}
    return cfg


def _format_precision(cfg: dict[str, Any], args: Mapping[str, Any]) -> None:
    precision = str(args["precision"])
    if "fp16" not in cfg and precision in ("16-mixed", "16-true", "16"):
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": args["loss_scale"],
            "initial_scale_power": args["initial_scale_power"],
            "loss_scale_window": args["loss_scale_window"],
            "hysteresis": args["hysteresis"],
            "min_loss_scale": args["min_loss_scale"],
        }
    elif "bf16" not in cfg and precision in ("bf16-mixed", "bf16-true", "bf16"):
        cfg["bf16"] = {"enabled": True}


def from_lightning(
    world_size: int | None = None, hidden_size: int | None = None, **kwargs: Any
) -> "RayZeroConfig":
    """See `RayZeroConfig.from_lightning`."""
    from rayzero.config.loader import load_config

    notes: list[str] = []
    cfg = lightning_to_dict(kwargs, notes)
    config = load_config(cfg, world_size=world_size, hidden_size=hidden_size, allow_unresolved=True)
    config._notes[:0] = notes
    for note in notes:
        logging.getLogger("rayzero.config").warning(note)
    return config
