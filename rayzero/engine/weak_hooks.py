"""Gradient hooks that hold their engine weakly.

[Note: gradient hooks hold their engine weakly]
A post-accumulate-grad hook lives on the parameter, in a dict that torch's C++ autograd side also
references; Python's cycle collector cannot see that reference, so a hook that holds the strategy
(which holds the module, its buffers and the optimizer state) keeps all of it alive for as long as
the process runs, even after the user dropped the engine and the model without `close()`. Seen on
an H200 in bench/gpu.py: each engine built after another started with the last one's GPU memory
still allocated. The hooks therefore hold the strategy through a weak reference: the engine's owner
decides its lifetime, and a hook whose engine is gone does nothing. `close()` still removes the
hooks (engine.py).

The hook's other arguments (a bucket, a stage-3 partition entry) are held weakly too: each holds
its parameter, whose hook holds it back, the same cycle through C++ one level down. Holding them
strongly kept every parameter, the flat parameter buffer and the flat gradient buffer alive: twice
the model's size, per engine built. Seen on an H100 in bench/gpu.py (each rayzero row left about 2×
its model's parameters allocated on the GPU), after the strategy itself was already freed.
Used by bucketed/strategy.py and stage3/hooks.py; tests/dist/test_engine_lifetime.py builds and
drops each stage's engine and checks that its parameters are gone.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any], *leading: Any) -> Callable[..., None]:
    """A hook calling `method(*leading, *args)` while `method`'s object and every object in
    `leading` live, holding each weakly ([Note: gradient hooks hold their engine weakly]); values
    that take no weak reference (an int slot index) are held as given."""
    target = weakref.WeakMethod(method)
    held = [_weakly(value) for value in leading]

    def hook(*args: Any) -> None:
        bound = target()
        if bound is None:
            return
        values = [get() for get in held]
        if any(value is None for value in values):
            return
        bound(*values, *args)

    return hook


def _weakly(value: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(value)
    except TypeError:  # an int or a str: refers to nothing
        return lambda: value
