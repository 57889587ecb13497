"""The base model and the value types DeepSpeed JSON files use.

JSON configs write integers as `5e8` or `0.94e6` (floats to a JSON parser) and booleans as
`"true"`; DeepSpeed accepts both, so we do too, but never a fractional integer or a bool-as-int.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainValidator, WithJsonSchema

AUTO = "auto"


def _to_int(value: Any) -> Any:
    """Accept 5e8, 0.94e6, "5e8" and "1_000" as integers; refuse 2.5, True and "abc"."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got the boolean {json.dumps(value)}")
    if isinstance(value, str) and value != AUTO:
        text = value.strip().replace("_", "")
        try:
            value = float(text) if any(c in text for c in ".eE") else int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got the string {json.dumps(value)}") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value} which has a fractional part")
        return int(value)
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {json.dumps(value)}")
    if isinstance(value, str) and value != AUTO:
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got the string {json.dumps(value)}") from None
    return value


def _to_bool(value: Any) -> Any:
    """DeepSpeed accepts JSON booleans and the strings "true"/"false" (any case)."""
    if isinstance(value, str) and value != AUTO:
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        raise ValueError(f"expected true or false, got the string {json.dumps(value)}")
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return value


def _or_auto(convert: Any, kind: type, json_type: str, ge: float | None = None) -> Any:
    """A plain validator (one clear error, not one per union member) for `<kind> | "auto"`."""

    def validate(value: Any) -> Any:
        if isinstance(value, str) and value == AUTO:
            return AUTO
        value = convert(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f'expected {json_type} or "auto", got {value!r}')
        if ge is not None and value < ge:
            raise ValueError(f"must be >= {ge:g}")
        return value

    number: dict[str, Any] = {"type": json_type}
    if ge is not None:
        number["minimum"] = ge
    schema = {"anyOf": [number, {"const": AUTO}]}
    return Annotated[Union[kind, Auto], PlainValidator(validate), WithJsonSchema(schema)]


Int = Annotated[int, BeforeValidator(_to_int)]
"""An integer that may be written 5e8 / 0.94e6 / "5e8"."""
Float = Annotated[float, BeforeValidator(_to_float)]
Bool = Annotated[bool, BeforeValidator(_to_bool)]
Auto = Literal["auto"]
AutoInt = _or_auto(_to_int, int, "integer")
"""An integer, or "auto" to be resolved from facts (hidden size, world size, trainer arguments)."""
AutoCount = _or_auto(_to_int, int, "integer", ge=0)
"""A non-negative integer (a size or a count), or "auto"."""
AutoPositive = _or_auto(_to_int, int, "integer", ge=1)
AutoFloat = _or_auto(_to_float, float, "number")
AutoNonNegativeFloat = _or_auto(_to_float, float, "number", ge=0)
AutoBool = _or_auto(_to_bool, bool, "boolean")

# Field metadata (json_schema_extra keys) read by the rules and the docs generator.
UNIMPLEMENTED = "x-rayzero-unimplemented"
"""Recognised DeepSpeed key that rayzero accepts but does not act on: setting it warns."""
REMOVED = "x-rayzero-removed"
"""A training feature DeepSpeed 0.19 removed (the value names it): refused when enabled."""
STAGE3_ONLY = "x-rayzero-stage3-only"
"""Only ZeRO stage 3 reads this key: setting it at a lower stage warns that it is ignored."""
NOT_STAGE3 = "x-rayzero-not-stage3"
"""Stage 3 does not read this key (it gathers with prefetch buckets): setting it there warns."""


class ConfigModel(BaseModel):
    """Every config section: unknown keys are errors, JSON keys and attribute names both accepted."""

    model_config = ConfigDict(
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        validate_assignment=True,
    )
