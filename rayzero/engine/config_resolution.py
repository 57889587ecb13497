"""The config `rayzero.initialize` trains with: from an argument or $RAYZERO_CONFIG, "auto" resolved
for this world size and model."""
from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rayzero.config import RayZeroConfig, load_config
from rayzero.config.errors import RayZeroValueError
from rayzero.config.runnable import check_runnable

CONFIG_ENV = "RAYZERO_CONFIG"
"""Path to a JSON config, or the JSON text itself; the Ray worker sets it for the user's loop."""
TRAINER_ENV = "RAYZERO_TRAINER"
"""JSON of HF-Trainer-style arguments ("auto" facts) from `rayzero.fit(trainer=...)` / `--trainer`."""


HF_TRAINER_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
    "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
    "fp16": False, "bf16": False,
}
"""`transformers.TrainingArguments` defaults for the arguments "auto" values are taken from. Not
`warmup_steps` (HF's 0): DeepSpeed's WarmupLR refuses 0 warm-up steps, so an "auto" warm-up asks for
`--trainer warmup_steps=N` on the driver rather than failing in every worker."""

_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def with_trainer_semantics(config: Any, trainer: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(config, facts) as the HF Trainer would see them, for `fit(trainer=...)` / `--trainer`.

    The Trainer has every `TrainingArguments` value, defaults included, so an "auto" the user did not
    name a value for takes HF's default. And it feeds batches of `per_device_train_batch_size` with
    `gradient_accumulation_steps` whatever the config says, so a config without those keys gets
    them from the trainer ("auto"), and one that has them must agree (checked by the resolution).
    """
    facts = dict(HF_TRAINER_DEFAULTS)
    facts.update(trainer)
    if isinstance(config, (str, Path)):
        text = str(config).strip()
        config = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
    if isinstance(config, Mapping):
        config = json.loads(json.dumps(config))
        for key in _BATCH_KEYS:
            config.setdefault(key, "auto")
    return config, facts


def trainer_facts() -> dict[str, Any] | None:
    text = os.environ.get(TRAINER_ENV)
    return json.loads(text) if text else None


def detect_hidden_size(model: torch.nn.Module) -> int | None:
    """`model.config.hidden_size` if present, else the most common Linear `in_features`."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    counts = collections.Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return counts.most_common(1)[0][0] if counts else None


def resolve_config(config: Any, world_size: int, model: torch.nn.Module) -> RayZeroConfig:
    """A validated config with "auto" resolved for this world size and model."""
    if config is None:
        text = os.environ.get(CONFIG_ENV)
        if not text:
            raise RayZeroValueError(
                f"rayzero.initialize got no config and ${CONFIG_ENV} is not set: pass config= (a path to a "
                f"DeepSpeed JSON file, a dict or a RayZeroConfig) or set {CONFIG_ENV} to a path or JSON text")
        stripped = text.strip()
        config = json.loads(stripped) if stripped.startswith("{") else Path(stripped)
    elif isinstance(config, str) and config.strip().startswith("{"):
        config = json.loads(config)
    # hidden_size is only a fact for resolving "auto" bucket sizes: pass it only when one is left,
    # so explicit values are never second-guessed by a guess at the model's width.
    trainer = trainer_facts()
    first = load_config(config, world_size=world_size, trainer=trainer, allow_unresolved=True)
    resolved = (first if not _has_auto(first.model_dump())
                else load_config(config, world_size=world_size, hidden_size=detect_hidden_size(model), trainer=trainer))
    check_runnable(resolved)  # [Note: valid vs runnable]
    return resolved


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_auto(v) for v in value)
    return value == "auto"
