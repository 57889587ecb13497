"""Turn pydantic validation errors into `Problem`s with full key paths and suggestions."""
from __future__ import annotations

import typing
from typing import Any, Mapping

from pydantic import BaseModel

from rayzero.config.errors import Problem, nearest, unknown_key_problem

_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def to_problem(item: Mapping[str, Any], root: type[BaseModel], prefix: tuple = ()) -> Problem:
    """One pydantic error (from `ValidationError.errors()`) on a `root` model as a `Problem`;
    `prefix` is the key path of `root` inside the whole config."""
    loc = tuple(item["loc"])
    kind = item["type"]
    value = item.get("input")
    if kind == "extra_forbidden":
        parent = _path(prefix + loc[:-1])
        return unknown_key_problem(parent, str(loc[-1]), value, valid_keys(root, loc[:-1]))
    if kind == "missing":
        return Problem(_path(prefix + loc), None, "required key is missing", f"add `{loc[-1]}`")
    message = str(item["msg"]).removeprefix("Value error, ")
    fix = ""
    expected = (item.get("ctx") or {}).get("expected")
    if kind in ("enum", "literal_error") and expected:
        choices = [choice.strip(" '") for choice in expected.replace(" or ", ",").split(",")]
        guess = nearest(str(value), choices, cutoff=0.6) if isinstance(value, str) else None
        fix = f"did you mean {guess!r}?" if guess else f"use one of: {', '.join(choices)}"
    elif kind in _BOUNDS:
        ctx = item.get("ctx") or {}
        op, name = _BOUNDS[kind]
        fix = f"use a value {op} {ctx.get(name)}"
    elif "must be >=" in message:
        fix = "use a value in that range"
    elif "expected an integer" in message or kind.startswith("int"):
        fix = "write a whole number, e.g. 500000000 or 5e8"
    elif "true or false" in message or kind.startswith("bool"):
        fix = "write true or false"
    elif kind == "string_pattern_mismatch":
        # pydantic prints the regex; users need the words it allows.
        pattern = str((item.get("ctx") or {}).get("pattern", ""))
        choices = pattern.removeprefix("^(").removesuffix(")$").split("|") if pattern.startswith("^(") else []
        message = f"not one of the accepted values ({', '.join(choices)})" if choices else message
        guess = nearest(str(value), choices, cutoff=0.6) if isinstance(value, str) and choices else None
        fix = f"did you mean {guess!r}?" if guess else (f"use one of: {', '.join(choices)}" if choices
                                                         else "use one of the values the rule allows")
    return Problem(_path(prefix + loc), value, message, fix)


def _path(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or inside Optional/Union/list...), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The section class found at a key path below `root` (JSON keys or attribute names)."""
    cls: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        cls = model_in(field.annotation)
    return cls


def valid_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """Every key accepted at a path: JSON keys and attribute names."""
    cls = model_at(root, loc)
    if cls is None:
        return []
    keys: list[str] = []
    for name, field in cls.model_fields.items():
        if field.exclude:
            continue
        keys.append(name)
        if field.alias:
            keys.append(field.alias)
    return keys
