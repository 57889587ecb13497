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
from rayzero.config.trainer import HF_TRAINER_DEFAULTS, with_trainer_semantics  # noqa: F401 - their old home

CONFIG_ENV = "RAYZERO_CONFIG"
"""Path to a JSON config, or the JSON text itself; the Ray worker sets it for the user's loop."""
TRAINER_ENV = "RAYZERO_TRAINER"
"""JSON of HF-Trainer-style arguments ("auto" facts) from `rayzero.fit(trainer=...)` / `--trainer`."""


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
