"""Gradient hooks that hold their engine weakly.

[Note: gradient hooks hold their engine weakly]
A post-accumulate-grad hook lives on the parameter, in a dict that torch's C++ autograd side also
references; Python's cycle collector cannot see that reference, so a hook that holds the strategy
(which holds the module, its buffers and the optimizer state) keeps all of it alive for as long as
the process runs, even after the user dropped the engine and the model without `close()`. Seen on
an H200 in bench/gpu.py: each engine built after another started with the last one's GPU memory
still allocated. The hooks therefore hold the strategy (and its bucket or partition entry) through
weak references: the engine's owner decides its lifetime, and a hook whose engine is gone does
nothing. `close()` still removes the hooks (engine.py). Used by bucketed/strategy.py and
stage3/hooks.py; tests/unit/test_weak_hooks.py builds and drops each stage's engine.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any], *leading: Any) -> Callable[..., None]:
    """A hook calling `method(*leading, *args)` while `method`'s object lives, which it holds
    weakly ([Note: gradient hooks hold their engine weakly]). `leading` is held as given: it must not
    refer back to that object (a bucket or a partition entry does not)."""
    target = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        bound = target()
        if bound is not None:
            bound(*leading, *args)

    return hook
