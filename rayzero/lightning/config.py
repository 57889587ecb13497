"""The DeepSpeed config RayZeroStrategy hands the engine: its keywords, or a config that replaces them,
through `rayzero.config.lightning.lightning_to_dict` (the mapping `RayZeroConfig.from_lightning` uses),
completed with the Trainer's facts as DeepSpeedStrategy completes its config."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from rayzero.config.environment import CONFIG
from rayzero.config.lightning import LIGHTNING_DEFAULTS, lightning_to_dict
from rayzero.integrations.random_streams import streams_kept
from rayzero.lightning.precision import LightningSetupError

DEEPSPEED_ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"
"""DeepSpeedStrategy's environment variable for a config path, honoured the same way."""


def engine_config(keywords: Mapping[str, Any], trainer: Any, precision: str | None,
                  warn: bool = True, read_batch_size: bool = True) -> dict[str, Any]:
    """From `config=` (a dict or JSON path), else $PL_DEEPSPEED_CONFIG_PATH, else the run's config
    ($RAYZERO_CONFIG, `rayzero run --config`), else the keywords. `trainer` None: before there is one
    (no Trainer facts); `warn` False: nothing logged; `read_batch_size` False: the train dataloader is
    not built for its batch size (only the engine's own config needs it)."""
    keywords = dict(keywords)
    source, from_run = keywords["config"], False
    if source is None and os.environ.get(DEEPSPEED_ENV_VAR):
        source = os.environ[DEEPSPEED_ENV_VAR]
    if source is None and CONFIG.is_set():
        text = CONFIG.get().strip()
        source, from_run = (json.loads(text) if text.startswith("{") else text), True
    if source is not None:
        source = dict(source) if isinstance(source, Mapping) else json.loads(Path(source).read_text())
        ignored = sorted(key for key, value in keywords.items() if key != "config" and value != LIGHTNING_DEFAULTS[key])
        if ignored and warn:
            rank_zero_warn(f"RayZeroStrategy: {', '.join(ignored)} ignored: a DeepSpeed config is given and "
                           "replaces the keywords (as in DeepSpeedStrategy)")
        if "gradient_accumulation_steps" in source and not from_run and trainer is not None:
            raise LightningSetupError(
                "Do not set `gradient_accumulation_steps` in the DeepSpeed config: it is set from "
                "Trainer(accumulate_grad_batches=...) (as DeepSpeedStrategy requires)")
        keywords["config"] = source
    if trainer is not None:
        keywords.update(precision=precision, accumulate_grad_batches=trainer.accumulate_grad_batches,
                        gradient_clip_val=trainer.gradient_clip_val,
                        batch_size=_train_batch_size(trainer) if read_batch_size else None)
    notes: list[str] = []
    config = lightning_to_dict(keywords, notes)
    if source is None:
        _drop_unset_defaults_rayzero_ignores(config, keywords)
    for note in notes if warn else ():
        rank_zero_warn(note)
    accumulate = trainer.accumulate_grad_batches if trainer is not None else None
    if from_run and warn and accumulate is not None and config["gradient_accumulation_steps"] != accumulate:
        # the run's batch plan (elastic: [Note: elastic batch]) wins over the script's Trainer
        rank_zero_info(f"RayZeroStrategy: gradient_accumulation_steps={config['gradient_accumulation_steps']} from "
                       f"the run's config, not accumulate_grad_batches={accumulate}")
    return config


def _drop_unset_defaults_rayzero_ignores(config: dict[str, Any], keywords: Mapping[str, Any]) -> None:
    """DeepSpeedStrategy writes `allgather_bucket_size` (rayzero's all-gathers are not bucketed by
    it) and `sub_group_size` (a stage-3 setting) into every config. Left at their defaults they
    would have the config checks warn on every rank of every run about values nobody chose; a value
    the user passes stays, and is warned about."""
    zero = config.get("zero_optimization") or {}
    unset = {key for key in ("allgather_bucket_size", "sub_group_size") if keywords[key] == LIGHTNING_DEFAULTS[key]}
    if "allgather_bucket_size" in unset:
        zero.pop("allgather_bucket_size", None)
    if "sub_group_size" in unset and zero.get("stage") != 3:
        zero.pop("sub_group_size", None)


def _train_batch_size(trainer: Any) -> int:
    """The train dataloader's batch size, for `train_micro_batch_size_per_gpu` when the config has none:
    DeepSpeedStrategy's `_auto_select_batch_size` (it builds the train dataloader once more for it).
    That extra build runs the module's `train_dataloader`, which may draw (BoringModel's dataset is
    `torch.randn`): the streams are put back, as DDP never builds it here ([Note: the user's random
    streams])."""
    if trainer.state.fn != TrainerFn.FITTING:
        return 1  # DeepSpeedStrategy's inference engine uses 1 too
    data_source = trainer.fit_loop._data_source
    with streams_kept():
        loader = data_source.dataloader() if data_source.is_defined() else None
    return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or 1
