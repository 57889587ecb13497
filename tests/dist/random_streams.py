"""The global random generators of a rank, read with each library's own API (the tests' oracle is the
same program under DDP; nothing of rayzero's reads them here): [Note: the user's random streams]."""
from __future__ import annotations

import random
from typing import Any

import numpy
import torch


def random_states() -> dict[str, Any]:
    """torch's CPU generator, every CUDA device's once CUDA is initialised, numpy's and Python's."""
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    states = {"torch": torch.get_rng_state().numpy().tobytes(),
              "numpy": (kind, keys.tobytes(), int(position), int(has_gauss), float(cached)),
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [torch.cuda.get_rng_state(device).numpy().tobytes()
                          for device in range(torch.cuda.device_count())]
    return states


def moved_streams(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The generators whose state differs (empty: every stream where DDP's is)."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    return [name for name in expected if actual[name] != expected[name]]
