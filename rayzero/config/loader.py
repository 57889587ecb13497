"""`load_config`: JSON file / dict / model in, one validated `RayZeroConfig` out, or one
`ConfigError` listing every problem.

Pipeline: read -> migrate deprecated keys -> DeepSpeed's leniencies (prepare.py) -> pydantic validation (unknown keys, types, ranges) ->
cross-field rules -> "auto" resolution and batch-size derivation. Later stages still run when an
earlier one found problems (on the config minus the offending keys), so one run reports everything.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Union

from pydantic import ValidationError

from rayzero.config.auto import resolve
from rayzero.config.convert import to_problem
from rayzero.config.environment import RUN
from rayzero.config.errors import ConfigError, Problem
from rayzero.config.migrate import migrate
from rayzero.config.model import RayZeroConfig
from rayzero.config.prepare import prepare
from rayzero.config.layouts import check_layouts
from rayzero.config.rules import check_resolved, check_rules

logger = logging.getLogger("rayzero.config")

Source = Union[str, Path, Mapping[str, Any], RayZeroConfig]


def load_config(
    source: Source,
    *,
    world_size: int | None = None,
    hidden_size: int | None = None,
    trainer: Mapping[str, Any] | None = None,
    allow_unresolved: bool = False,
) -> RayZeroConfig:
    """Validate a DeepSpeed config and resolve what the given facts allow.

    `source` is a path to a JSON file, a dict, or a `RayZeroConfig` (re-checked, e.g. to resolve
    "auto" once the model's hidden size is known). `trainer` holds HF-Trainer-style arguments
    (`per_device_train_batch_size`, `learning_rate`, ...) that "auto" values are taken from.
    `allow_unresolved=True` keeps an "auto" that nothing resolves (with a note) instead of raising:
    for a driver that validates before the model exists. Raises `ConfigError` with every problem.
    """
    name = str(source) if isinstance(source, (str, Path)) else "config"
    notes: list[str] = []
    problems: list[Problem] = []
    raw = _read(source, name)
    raw = migrate(raw, notes, problems)
    raw = prepare(raw, notes, problems)
    config = _validate(raw, problems)
    check_rules(config, notes, problems)
    resolve(config, world_size=world_size, hidden_size=hidden_size, trainer=trainer,
            allow_unresolved=allow_unresolved, notes=notes, problems=problems)
    check_resolved(config, problems, notes)
    check_layouts(config, world_size, notes, problems)
    if problems:
        raise ConfigError(problems, name)
    notes[:] = list(dict.fromkeys(notes))  # each note once, in order
    shown, under_fit = _shown_by_driver()
    for note in notes:
        if note in shown:  # [Note: config notes once]
            continue
        _LOGGED.add(note)
        if under_fit:
            shown.add(note)
        # resolutions are information; everything else (ignored, deprecated, unimplemented) warns
        level = logging.INFO if note.startswith(("auto:", "derived:", "filled:", "rounded:")) else logging.WARNING
        logger.log(level, note)
    config._notes = notes
    return config


# [Note: config notes once]
# The driver validates a config and logs its notes; under rayzero.fit every worker loads it again
# (twice: the loop's checks and rayzero.initialize), which would print each note 1 + 2·N times.
# The driver hands the notes it logged to the workers (`notes_shown` of $RAYZERO_RUN, set by
# driver/fit.py); a worker logs only notes not in that set, each once. Elsewhere (a script,
# torchrun, tests) every load logs its notes, as before. `config.notes` always lists them all.
_LOGGED: set[str] = set()
"""Every note this process logged (what the driver hands to its workers)."""
_SHOWN: dict[tuple[str, ...], set[str]] = {}  # the driver's notes -> notes shown (the driver's, then this worker's)


def _shown_by_driver() -> tuple[set[str], bool]:
    """(notes shown already, whether this process runs under rayzero.fit). Read when a config loads,
    not at import: a Ray worker imports rayzero before its run's environment is set."""
    notes = RUN.get().notes_shown
    if notes is None:
        return set(), False
    if notes not in _SHOWN:
        _SHOWN[notes] = set(notes)
    return _SHOWN[notes], True


def logged_notes() -> list[str]:
    """The notes this process has logged so far (driver side of [Note: config notes once])."""
    return sorted(_LOGGED)


def _read(source: Source, name: str) -> dict[str, Any]:
    if isinstance(source, RayZeroConfig):
        # Only what was written or resolved: defaults stay defaults, so a second pass with trainer
        # facts (the engine's, after the driver's) does not mistake a default for a user's choice.
        return source.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, Path)):
        raise ConfigError([Problem("", type(source).__name__, "a config is a JSON path, a dict or a RayZeroConfig",
                                   "pass one of those")], name)
    path = Path(source)
    try:
        text = path.read_text()
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path; UnicodeDecodeError: not text
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError([Problem("", str(path), f"cannot read the file ({reason})",
                                   "check the path (a JSON file, UTF-8)")], name) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError([Problem("", str(path), f"not valid JSON: {error.msg} at line {error.lineno} "
                                   f"column {error.colno}", "fix the JSON syntax there")], name) from None
    if not isinstance(data, dict):
        raise ConfigError([Problem("", type(data).__name__, "the top level must be a JSON object",
                                   "wrap the settings in { ... }")], name)
    return data


def _validate(raw: dict[str, Any], problems: list[Problem]) -> RayZeroConfig:
    """Validate, converting every pydantic error; on errors, drop the offending keys and retry so
    the later stages still see a config to check."""
    for _ in range(5):
        try:
            return RayZeroConfig.model_validate(raw)
        except ValidationError as error:
            for item in error.errors(include_url=False):
                problems.append(to_problem(item, RayZeroConfig))
                _drop(raw, item["loc"], item["type"] == "missing")
    return RayZeroConfig()


def _drop(raw: Any, loc: tuple, whole_section: bool) -> None:
    """Remove the key at `loc` (or, for a missing key, the section that lacks it)."""
    loc = loc[:-1] if whole_section else loc
    node = raw
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    if loc and isinstance(node, (dict, list)):
        try:
            del node[loc[-1]]
        except (KeyError, IndexError, TypeError):
            pass
