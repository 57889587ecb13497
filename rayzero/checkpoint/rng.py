"""Per-rank random number generator state, as JSON (a manifest never holds pickles).

Restoring at another world size: rank r < saved world size gets saved rank r's exact state (so a
same-size resume is bitwise identical); a new rank r >= saved world size gets generators seeded
deterministically from (saved rank 0's torch seed, r), so it neither repeats another rank's stream
nor depends on when it started.
"""
from __future__ import annotations

import base64
import random
import warnings
from typing import Any

import torch


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's torch CPU, CUDA (current device), Python and numpy generator states."""
    state: dict[str, Any] = {"torch": _encode(torch.get_rng_state()), "torch_seed": torch.initial_seed()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _encode(torch.cuda.get_rng_state())
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    try:
        import numpy

        kind, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def restore(states: list[dict[str, Any]], rank: int) -> None:
    """Restore this rank's generators from the saved ranks' states (see the module docstring)."""
    if not states:
        warnings.warn("checkpoint holds no RNG state; random streams continue from the current state", stacklevel=2)
        return
    if rank < len(states):
        _apply(states[rank])
        return
    seed = (int(states[0].get("torch_seed", 0)) * 1_000_003 + rank) % (2**63)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def _apply(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(state["cuda"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy

            kind, keys, position, has_gauss, cached = state["numpy"]
            numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached))
        except ImportError:
            pass
