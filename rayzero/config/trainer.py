"""The HF Trainer's view of a DeepSpeed config: every `TrainingArguments` value the "auto"s take,
HF's defaults for those not given. One path for `rayzero config validate --trainer`, `rayzero run
--trainer` / `rayzero.fit(trainer=...)` on the driver and the engine on the workers."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HF_TRAINER_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
    "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
    "fp16": False, "bf16": False, "warmup_steps": 0,
}
"""`transformers.TrainingArguments` defaults (5.x) for the arguments "auto" values are taken from.
`warmup_steps` 0 gives WarmupLR one warm-up step, as HF fills it (DeepSpeed 0.19.6+ refuses 0)."""

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
        try:
            config = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
        except (OSError, ValueError):
            return config, facts  # the loader reports it (the file, or the JSON error with line and column)
    if isinstance(config, Mapping):
        config = json.loads(json.dumps(config))
        for key in _BATCH_KEYS:
            config.setdefault(key, "auto")
    return config, facts
