"""Deprecated and renamed DeepSpeed keys, rewritten to their replacements before validation.

Each rewrite leaves a note ("... is deprecated; use ... instead") so users can update the file; a
file that sets both the old and the new key to different values is an error, not a silent pick.
"""
from __future__ import annotations

import copy
from typing import Any

from rayzero.config.errors import Problem
from rayzero.config.zero_optimization import ZeroConfig

_ZERO = "zero_optimization"


def _move(section: dict, old: str, new: str, path: str, notes: list[str], problems: list[Problem],
          quiet: bool = False) -> None:
    """Rename `old` to `new` in `section`, refusing conflicting values; `quiet` for legacy aliases
    DeepSpeed itself still accepts without a warning."""
    if old not in section:
        return
    value = section.pop(old)
    where = f"{path}." if path else ""
    if new in section and section[new] != value:
        problems.append(
            Problem(
                f"{where}{old}", value, f"conflicts with `{where}{new}` = {section[new]!r}",
                f"`{old}` is the deprecated name of `{new}`; keep only `{new}`",
            )
        )
        return
    section[new] = value
    if not quiet:
        notes.append(f"deprecated: `{where}{old}` is the old name of `{where}{new}`; rename it (migrated)")


def migrate(raw: dict[str, Any], notes: list[str], problems: list[Problem]) -> dict[str, Any]:
    """A copy of `raw` with deprecated keys replaced; notes and problems are appended to."""
    raw = copy.deepcopy(raw)
    _move(raw, "bfloat16", "bf16", "", notes, problems)
    aio = raw.get("aio")
    if isinstance(aio, dict):
        _move(aio, "thread_count", "intra_op_parallelism", "aio", notes, problems, quiet=True)
    zero = raw.get(_ZERO)
    if isinstance(zero, bool):
        # DeepSpeed < 0.3 accepted `"zero_optimization": true` meaning stage 1.
        notes.append(f"deprecated: `{_ZERO}: {str(zero).lower()}`; write `{_ZERO}: {{\"stage\": N}}` (migrated)")
        raw[_ZERO] = {"stage": 1 if zero else 0}
        return raw
    if not isinstance(zero, dict):
        return raw
    _nested_aio(raw, zero, notes, problems)
    for section in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(section), bool) or zero.get(section) in ("true", "false"):
            # Early DeepSpeed/Lightning docs wrote `"offload_optimizer": true` meaning "to the CPU".
            enabled = zero.pop(section) in (True, "true")
            if enabled:
                zero[section] = {"device": "cpu"}
            notes.append(f"deprecated: `{_ZERO}.{section}: {str(enabled).lower()}`; write "
                         f"`{_ZERO}.{section}: {{\"device\": \"{'cpu' if enabled else 'none'}\"}}` (migrated)")
    for name, field in ZeroConfig.model_fields.items():
        if field.alias and name in zero and field.alias in zero:
            problems.append(Problem(
                f"{_ZERO}.{name}", zero[name], f"given twice: also as `{_ZERO}.{field.alias}` = {zero[field.alias]!r}",
                f"`{field.alias}` (DeepSpeed's JSON key) and `{name}` are the same setting; keep one"))
            zero.pop(name)
    _move(zero, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
          _ZERO, notes, problems)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if pin is not None:
        notes.append(
            f"deprecated: `{_ZERO}.cpu_offload_use_pin_memory`; set `pin_memory` inside "
            f"`offload_optimizer` / `offload_param` (migrated into the offload sections it enables)"
        )
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        enabled = zero.pop(old)
        replacement = {"device": "cpu", "pin_memory": bool(pin)} if enabled in (True, "true") else None
        if enabled not in (True, False, "true", "false"):
            problems.append(Problem(f"{_ZERO}.{old}", enabled, "expected true or false",
                                    f"replace it with `{_ZERO}.{new}: {{\"device\": \"cpu\"}}`"))
            continue
        if new in zero and replacement is not None:
            problems.append(Problem(f"{_ZERO}.{old}", enabled, f"conflicts with `{_ZERO}.{new}`",
                                    f"`{old}` is deprecated; keep only `{new}`"))
            continue
        if replacement is not None:
            zero[new] = replacement
        notes.append(
            f"deprecated: `{_ZERO}.{old}: {str(enabled).lower()}`; use `{_ZERO}.{new}` "
            f"{{\"device\": \"cpu\"}} instead (migrated)"
        )
    return raw


def _nested_aio(raw: dict[str, Any], zero: dict[str, Any], notes: list[str], problems: list[Problem]) -> None:
    """The HF guide's NVMe example puts `aio` inside `zero_optimization`; DeepSpeed reads it at the
    top level only. Move it there (with a warning) rather than lose the user's I/O tuning."""
    if "aio" not in zero:
        return
    nested = zero.pop("aio")
    if "aio" in raw and raw["aio"] != nested:
        problems.append(Problem(f"{_ZERO}.aio", nested, f"conflicts with the top-level `aio` = {raw['aio']!r}",
                                "aio settings belong at the top level only; delete one of them"))
        return
    raw["aio"] = nested
    notes.append(f"moved: `{_ZERO}.aio` belongs at the top level (`aio`), where DeepSpeed reads it; "
                 "move it there (migrated)")
    aio = raw["aio"]
    if isinstance(aio, dict):
        _move(aio, "thread_count", "intra_op_parallelism", "aio", notes, problems, quiet=True)
