"""rayzero's error base, problems found in a configuration, and the one exception that carries all
of them.

[Note: user-facing errors]
Every error rayzero raises for something a user caused or can fix derives from `RayZeroError`, so
`except rayzero.RayZeroError` catches all of them and nothing else. Each one says what was wrong,
where (config path, flag, rank) and what to do, and survives pickling: it rebuilds itself from its
constructor arguments (`__reduce__`), so it crosses Ray actors (worker -> controller -> driver)
with its fields intact, as Ray Train's errors do. The base lives here because `rayzero.config` is
the one module every layer may import. `RayZeroValueError` and `RayZeroRuntimeError` also derive
from the built-in they replace, so `except ValueError` keeps working.

A `ConfigError` is raised once per load with *every* problem found, so a user fixes a file in one
pass instead of one error per run (DeepSpeed stops at the first one, or silently ignores it).
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Iterable


class RayZeroError(Exception):
    """Base of every error rayzero raises for something a user can cause or fix
    ([Note: user-facing errors])."""

    def __init__(self, message: str, *args: Any) -> None:
        super().__init__(message, *args)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), self.args)


class RayZeroValueError(RayZeroError, ValueError):
    """A bad value: an argument, a flag, a setting or a model that cannot be used as given."""


class RayZeroRuntimeError(RayZeroError, RuntimeError):
    """Something went wrong while running: a worker, the controller, a checkpoint, a collective."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration."""

    path: str
    """Dotted key path, e.g. `zero_optimization.offload_param.buffer_count`."""
    value: Any
    """The offending value as the user wrote it (or `None` when a key is missing)."""
    rule: str
    """What the value breaks, in words."""
    fix: str = ""
    """What to do about it; names the nearest valid key for a typo."""

    def __str__(self) -> str:
        where = self.path or "<top level>"
        text = f"{where} = {as_json(self.value)}: {self.rule}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


class ConfigError(RayZeroValueError):
    """A configuration was rejected; `problems` lists every reason found."""

    def __init__(self, problems: Iterable[Problem], source: str = "config") -> None:
        self.problems: list[Problem] = list(problems)
        self.source = source
        lines = [f"{len(self.problems)} problem(s) in {source}:"]
        lines += [f"  - {problem}" for problem in self.problems]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # survives pickling across Ray actors
        return (type(self), (self.problems, self.source))


def as_json(value: Any) -> str:
    """A value as the user wrote it in JSON (`true`, `"x"`, `5e8` -> 500000000.0), for messages."""
    try:
        return json.dumps(value, default=lambda v: getattr(v, "value", str(v)))
    except (TypeError, ValueError):
        return repr(value)


def nearest(key: str, candidates: Iterable[str], cutoff: float = 0.8) -> str | None:
    """The closest valid key to a misspelled one, or None when nothing is close enough to be a typo
    (0.8 for keys: `weight_decya` -> `weight_decay`, but not `tensor_parallel` -> `tensorboard`;
    short enum values use 0.6: `bf61` -> `bf16`)."""
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_key_problem(path: str, key: str, value: Any, candidates: Iterable[str]) -> Problem:
    """A `Problem` for a key that is not part of the schema, with the nearest valid key."""
    candidates = sorted(set(candidates))
    guess = nearest(key, candidates)
    full = f"{path}.{key}" if path else key
    if guess is not None:
        fix = f"did you mean `{f'{path}.{guess}' if path else guess}`?"
    else:
        fix = "remove it; valid keys here: " + ", ".join(candidates)
    return Problem(full, value, "unknown key", fix)
