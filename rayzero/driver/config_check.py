"""The run's config, checked on the driver before any worker starts (`rayzero.fit` / `rayzero run`)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def validated_config(
    config: Any, world_size: int, trainer: Mapping[str, Any] | None = None, *, allow_unresolved: bool = False,
) -> tuple[dict[str, Any] | None, dict[str, Any], Mapping[str, Any] | None]:
    """(the config for the workers, the validated one, the trainer facts) or a ConfigError listing
    every problem. `allow_unresolved`: a trainer inside the run fills the "auto"s no fact given here
    resolves (a script's HF Trainer or Accelerate), as `rayzero config validate --allow-auto`.

    Validation happens here, before any worker starts. The workers get the config as the user wrote
    it, not the normalised dump: the engine resolves it again knowing the model (hidden size) and the
    trainer arguments (`trainer` of $RAYZERO_RUN), and a dump carries every default as if the user had set
    it, which that resolution then rejects.
    """
    if config is None:
        return None, {}, trainer
    from rayzero.config import ConfigError, RayZeroConfig, load_config
    from rayzero.config.runnable import check_runnable

    name = str(config) if isinstance(config, (str, Path)) else "config"
    if trainer:  # HF semantics: TrainingArguments defaults, batch keys from the trainer
        from rayzero.config.trainer import with_trainer_semantics

        config, trainer = with_trainer_semantics(config, trainer)
    # The model's "auto"s are resolved in the engine from model.config.hidden_size; a stand-in width
    # here lets one load_config call report every other problem (an "auto" no fact resolves
    # included) in one round. Its values are never used: the workers get the config as written.
    try:
        checked = load_config(config, world_size=world_size, hidden_size=_STAND_IN_HIDDEN_SIZE, trainer=trainer,
                              allow_unresolved=allow_unresolved)
    except ConfigError as error:
        raise ConfigError(_with_trainer_fix(error.problems), name) from None
    # What this build cannot run (optimizer, scheduler, an "auto" only a trainer fills) is refused
    # here, before any worker starts ([Note: valid vs runnable]).
    check_runnable(checked, name, trainer_present=bool(trainer) or allow_unresolved)
    validated = checked.to_deepspeed_dict()
    if isinstance(config, RayZeroConfig):
        return config.to_deepspeed_dict(), validated, trainer
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config)), validated, trainer
    return json.loads(Path(config).read_text()), validated, trainer


_STAND_IN_HIDDEN_SIZE = 1024


def _with_trainer_fix(problems: list[Any]) -> list[Any]:
    """The problems, the first unresolved trainer "auto" saying (once) how to give trainer facts."""
    out, said = [], False
    for problem in problems:
        if not said and problem.value == "auto" and "trainer" in problem.fix:
            problem = dataclasses.replace(problem, fix=f"{problem.fix} (for this and every trainer \"auto\" "
                                                       "below: rayzero.fit(..., trainer={...}) or rayzero run "
                                                       "--trainer KEY=VALUE)")
            said = True
        out.append(problem)
    return out
