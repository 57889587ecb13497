"""The config `rayzero.initialize` trains with: from an argument or $RAYZERO_CONFIG, "auto" resolved
for this world size and model."""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch

from rayzero.config import RayZeroConfig, load_config
from rayzero.config.environment import CONFIG, RUN
from rayzero.config.errors import ConfigError, RayZeroValueError
from rayzero.config.runnable import check_runnable
from rayzero.config.trainer import HF_TRAINER_DEFAULTS, with_trainer_semantics  # noqa: F401 - their old home


def trainer_facts() -> dict[str, Any] | None:
    """HF-Trainer-style arguments ("auto" facts) from `rayzero.fit(trainer=...)` / `--trainer`."""
    return RUN.get().trainer


def detect_hidden_size(model: torch.nn.Module) -> int | None:
    """`model.config.hidden_size` if present, else the most common Linear `in_features`."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    counts = collections.Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return counts.most_common(1)[0][0] if counts else None


def resolve_config(config: Any, world_size: int, model: torch.nn.Module) -> RayZeroConfig:
    """A validated config with "auto" resolved for this world size and model."""
    try:
        return _resolve(config, world_size, model)
    except ConfigError as error:
        run_config = (CONFIG.get() or "").strip() if config is not None else ""
        if not run_config or (isinstance(config, (str, Path)) and str(config).strip() == run_config):
            raise
        # A loop that passes its own config (often fit's train_loop_config, `{}`) inside a run that has
        # one: say which config was rejected, and that the run's is used only without config=.
        shown = "its JSON text" if run_config.startswith("{") else run_config
        raise ConfigError(error.problems, (
            f"{error.source} passed to initialize(), not this run's config (${CONFIG.name}: {shown}, from "
            "`rayzero run --config` or fit's config=): leave config= out to train with the run's"
        )) from None


def _resolve(config: Any, world_size: int, model: torch.nn.Module) -> RayZeroConfig:
    if config is None:
        text = CONFIG.get()
        if not text:
            raise RayZeroValueError(
                f"rayzero.initialize got no config and ${CONFIG.name} is not set: pass config= (a path to a "
                f"DeepSpeed JSON file, a dict or a RayZeroConfig) or set {CONFIG.name} to a path or JSON text")
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
