"""Which engine wraps a module, and what happens when a model is wrapped a second time.

[Note: one engine per module]
An engine re-lays a module's parameters out (flat buffers; at stage 3, partitions and the hooks that
gather them). Three things can have become of an earlier engine when `rayzero.initialize` gets the
same module (or one of its submodules) again:
  - it is still open and referenced: refused. A second engine would flatten or partition what the
    first still owns and both would train; `engine.close()` first, or keep using it.
  - it was closed: `close()` handed the module back (stage 3 leaves its parameters gathered, every
    hook removed), so wrapping it again is an ordinary first wrap.
  - it was dropped without `close()` at stages 0-2: it is freed like any object, strategy and
    offload scratch too, since its gradient hooks hold it weakly ([Note: gradient hooks hold their
    engine weakly]); the hooks it left on the parameters do nothing, the parameters keep their
    values, and wrapping again is a first wrap.
  - it was dropped without `close()` at stage 3 (garbage-collected, or only in a reference cycle):
    its strategy is still alive, kept by the forward hooks it left on the module, and the module's
    parameters are 0-element placeholders whose values live in its partitions. The new
    `initialize` closes that strategy first — hooks removed, partitions gathered back into whole
    parameters, offload scratch (swap files, the CPU-step thread) released — and then wraps the
    module as after a `close()`, warning that it did so. DeepSpeed 0.19.8 re-wraps such a module at
    every stage and trains the same as torch from the weights the dropped engine left (measured
    5e-8 at stages 0-3), so a DeepSpeed user expects this to work, as when the HF Trainer or
    Accelerate prepare the same model twice; before this note it trained wrong at stage 3 (the
    dropped engine's hooks re-pointed parameters at its stale partitions: 6e-1 from torch).
Releasing a stage-3 strategy gathers its parameters, a collective on the dropped engine's process
group: every rank does it inside its own `initialize`, the collective call every rank makes anyway.
A group destroyed in between makes that impossible; the error says so.

`_WRAPPED` is the one piece of process-wide state the engine keeps: it must see engines the caller
may have lost track of. It holds only weak references (the strategy references the module, so a
strong one would keep the weakly keyed module alive for ever).
"""
from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Wrapping:
    """One engine's hold on its module (every submodule maps to the same record)."""

    engine: weakref.ReferenceType
    """The ZeroEngine (dead once the caller dropped it)."""
    strategy: weakref.ReferenceType
    """Its strategy: outlives a dropped engine through the hooks it left on the module."""


_WRAPPED: weakref.WeakKeyDictionary[torch.nn.Module, Wrapping] = weakref.WeakKeyDictionary()


def register(engine: Any) -> None:
    """`engine` now wraps `engine.module` and every submodule of it."""
    wrapping = Wrapping(weakref.ref(engine), weakref.ref(engine.strategy))
    for submodule in engine.module.modules():
        _WRAPPED[submodule] = wrapping


def unregister(engine: Any) -> None:
    """`engine` was closed: the module is free again."""
    for submodule in engine.module.modules():
        wrapping = _WRAPPED.get(submodule)
        if wrapping is not None and wrapping.engine() in (engine, None):
            del _WRAPPED[submodule]


def _holders(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Wrapping]]:
    found = []
    for name, submodule in module.named_modules():
        wrapping = _WRAPPED.get(submodule)
        if wrapping is not None:
            found.append((name, submodule, wrapping))
    return found


def _open(wrapping: Wrapping) -> Any:
    engine = wrapping.engine()
    return engine if engine is not None and not engine.closed else None


def ensure_not_wrapped(module: torch.nn.Module) -> None:
    """Refuse `module` while an open engine wraps it; release what a dropped engine left on it
    ([Note: one engine per module]). Collective when there is something to release."""
    holders = _holders(module)
    if any(_open(wrapping) is not None for _, _, wrapping in holders):
        gc.collect()  # an engine the caller dropped may only be waiting in a reference cycle
        holders = _holders(module)
    for name, submodule, wrapping in holders:
        owner = _open(wrapping)
        if owner is not None:
            where = "this model" if not name else f"its submodule `{name}`"
            how = "wrapped by" if submodule is owner.module else "part of a model wrapped by"
            raise RayZeroValueError(
                f"rayzero.initialize: {where} is already {how} a ZeroEngine (ZeRO stage "
                f"{owner.strategy.stage}) that is still open; a second engine would re-partition parameters "
                "the first one owns. Call engine.close() on the first engine before wrapping the model "
                "again, or keep using it")
    released: set[int] = set()
    for _, _, wrapping in holders:
        strategy = wrapping.strategy()
        if strategy is not None and id(strategy) not in released:
            released.add(id(strategy))
            _release_dropped(strategy)
        for submodule in (strategy.module.modules() if strategy is not None else ()):
            if _WRAPPED.get(submodule) is wrapping:
                del _WRAPPED[submodule]


def _release_dropped(strategy: Any) -> None:
    """Close the strategy of an engine dropped without `close()`, as its `close()` would have."""
    logger.warning(
        "rank %d: a ZeRO stage %d engine of this model was dropped without engine.close(); rayzero "
        "removed its hooks and gathered its parameters back before wrapping the model again (call "
        "engine.close() when you are done with an engine: it also frees its memory at once)",
        strategy.comm.rank, strategy.stage)
    try:
        strategy.close()
        strategy.offload.close()
    except Exception as error:
        raise RayZeroRuntimeError(
            f"rayzero.initialize: the model is still held by a ZeRO stage {strategy.stage} engine that was "
            f"dropped without engine.close(), and handing its parameters back failed "
            f"({type(error).__name__}: {error}). At stage 3 that gathers them over the dropped engine's "
            "process group, which must still exist on every rank: call engine.close() before dropping an "
            "engine or destroying its process group, or build the model afresh") from error
