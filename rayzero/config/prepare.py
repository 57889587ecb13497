"""The raw-dict pass between migration and validation: what DeepSpeed 0.19 tolerates in a real
config that a strict schema would refuse, made explicit with a note each.

[Note: DeepSpeed's leniencies]
Measured on the corpus in tests/data/configs/real (see tests/unit/test_fidelity_corpus.py):
- DeepSpeed reads the top level as a plain dict, so keys it does not know (`_comment`,
  `comms_config`, `monitor_config`, Accelerate's `fp8`, ...) are ignored without a word. rayzero
  ignores them too, with a warning — unless the key is a near miss of a known one
  (`zero_optimisation`), which is almost always a typo that would silently drop a whole section:
  that stays an error with the suggestion. A known key written at the wrong level
  (`zero_stage`, a top-level `offload_optimizer`) is an error naming where it belongs.
- DeepSpeed's pydantic sections drop every "auto" before validating (`DeepSpeedConfigModel`), so
  "auto" on a key no rule resolves means DeepSpeed's default. rayzero does the same with a note;
  keys that do have a rule (bucket sizes from the hidden size, trainer arguments) keep "auto".
- Element-count sizes written as the HF guide computes them (0.9·h² = 943718.4) are refused by
  DeepSpeed's int fields; rayzero rounds them with a note (a deliberate difference: the value the
  user meant is obvious and nothing else about the math changes).
"""
from __future__ import annotations

import difflib
import functools
import math
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from rayzero.config.base import AUTO
from rayzero.config.convert import model_in
from rayzero.config.errors import Problem
from rayzero.config.model import RayZeroConfig

TYPO_CUTOFF = 0.8
"""How close (difflib ratio) an unknown key must be to a known one to count as its misspelling."""

_ELEMENT_COUNTS = {
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
    "stage3_param_persistence_threshold", "param_persistence_threshold", "stage3_model_persistence_threshold",
    "model_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
    "stage3_max_reuse_distance", "max_reuse_distance", "sub_group_size", "buffer_size", "max_in_cpu",
}
"""Keys counting tensor elements: a fractional value is rounded, not refused."""

_ELSEWHERE = {
    "zero_stage": ("zero_optimization.stage", 'write "zero_optimization": {"stage": N}'),
    "stage": ("zero_optimization.stage", 'write "zero_optimization": {"stage": N}'),
}
"""Top-level keys users write for a setting that lives elsewhere (beyond zero_optimization's own fields)."""


def prepare(raw: dict[str, Any], notes: list[str], problems: list[Problem]) -> dict[str, Any]:
    """Apply DeepSpeed's leniencies to `raw` (already a migrated copy) in place and return it."""
    _top_level(raw, notes, problems)
    _walk(raw, RayZeroConfig, "", notes)
    return raw


def _model_keys(model: type[BaseModel]) -> dict[str, FieldInfo]:
    keys: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        keys[name] = field
        if field.alias:
            keys[field.alias] = field
    return keys


def _top_level(raw: dict[str, Any], notes: list[str], problems: list[Problem]) -> None:
    from rayzero.config.zero_optimization import ZeroConfig

    known = _model_keys(RayZeroConfig)
    zero_keys = _model_keys(ZeroConfig)
    for key in [k for k in raw if k not in known]:
        if not isinstance(key, str):
            continue
        value = raw[key]
        if key in _ELSEWHERE or key in zero_keys:
            where, fix = _ELSEWHERE.get(key, (f"zero_optimization.{key}", f"move it into \"zero_optimization\""))
            problems.append(Problem(key, value, f"not a top-level key: it belongs at `{where}`", fix))
            raw.pop(key)
            continue
        if difflib.get_close_matches(key, list(known), n=1, cutoff=TYPO_CUTOFF):
            continue  # a near miss: validation reports it with the suggestion
        raw.pop(key)
        if key.startswith("_") or "comment" in key.lower():
            notes.append(f"ignored: `{key}` (a comment)")
        else:
            notes.append(f"ignored: `{key}` is not a DeepSpeed 0.19 key rayzero knows; DeepSpeed ignores unknown "
                         "top-level keys too. Remove it, or check its spelling")


@functools.lru_cache(maxsize=None)
def _accepts_auto(field: FieldInfo) -> bool:
    try:
        TypeAdapter(typing.Annotated[(field.annotation, *field.metadata)] if field.metadata
                    else field.annotation).validate_python(AUTO)
        return True
    except (ValidationError, TypeError, ValueError):
        return False


def _walk(node: dict[str, Any], model: type[BaseModel], path: str, notes: list[str]) -> None:
    keys = _model_keys(model)
    for key in list(node):
        field = keys.get(key)
        if field is None:
            continue  # unknown: validation reports it
        value = node[key]
        where = f"{path}.{key}" if path else key
        if isinstance(value, str) and value == AUTO and not _accepts_auto(field):
            del node[key]
            default = field.get_default(call_default_factory=True)
            shown = default.value if hasattr(default, "value") else default
            notes.append(f"auto: {where} = {shown!r}, DeepSpeed's default (DeepSpeed reads \"auto\" on this key "
                         "as its default)")
            continue
        if key in _ELEMENT_COUNTS:
            rounded = _round_count(value)
            if rounded is not None:
                node[key] = rounded
                notes.append(f"rounded: {where} = {value!r} counts elements; using {rounded}")
            continue
        sub = model_in(field.annotation)
        if sub is not None and isinstance(value, dict):
            _walk(value, sub, where, notes)


def _round_count(value: Any) -> int | None:
    """The nearest integer for a fractional element count (943718.4, "9.4e5"), else None."""
    if isinstance(value, str):
        try:
            value = float(value.strip().replace("_", ""))
        except ValueError:
            return None
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer() and value >= 0:
        return int(round(value))
    return None
