"""Per-rank random number generator state, as JSON (a manifest never holds pickles).

Restoring at another world size: rank r < saved world size gets saved rank r's exact state (so a
same-size resume is bitwise identical); a new rank r >= saved world size gets generators seeded
deterministically from (saved rank 0's torch seed, r), so it neither repeats another rank's stream
nor depends on when it started.
"""
from __future__ import annotations

import base64
import binascii
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError


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
    """Restore this rank's generators from the saved ranks' states (see the module docstring).
    A malformed state raises RayZeroValueError before any generator is touched."""
    if not states:
        warnings.warn("checkpoint holds no RNG state; random streams continue from the current state", stacklevel=2)
        return
    if rank < len(states):
        for apply in _parse(states[rank], rank):
            apply()
        return
    try:
        seed = (int(states[0].get("torch_seed", 0)) * 1_000_003 + rank) % (2**63)
    except (AttributeError, TypeError, ValueError, OverflowError):
        raise RayZeroValueError(f"checkpoint RNG state of rank 0: torch_seed = {states[0]!r:.80} is not an "
                                "integer") from None
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def _parse(state: dict[str, Any], rank: int) -> list[Callable[[], None]]:
    """Check every generator state of one saved rank on a scratch generator; return the setters.
    Nothing is applied until all of them parsed, so a bad state leaves the generators as they were."""
    setters: list[Callable[[], None]] = []
    part = "torch"
    if not isinstance(state, dict):
        raise RayZeroValueError(f"checkpoint RNG state of rank {rank} is missing or not an object ({state!r:.60}); "
                                "the checkpoint's manifest was damaged or edited")
    try:
        torch_state = _decode(state["torch"])
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"{torch_state.numel()} bytes, expected {torch.get_rng_state().numel()}")
        setters.append(lambda: torch.set_rng_state(torch_state))
        if "cuda" in state and torch.cuda.is_available():
            part = "cuda"
            cuda_state = _decode(state["cuda"])
            setters.append(lambda: torch.cuda.set_rng_state(cuda_state))
        part = "python"
        version, internal, gauss = state["python"]
        python_state = (version, tuple(internal), gauss)
        random.Random().setstate(python_state)
        setters.append(lambda: random.setstate(python_state))
        if "numpy" in state:
            part = "numpy"
            setters.extend(_numpy_setter(state["numpy"]))
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, binascii.Error) as error:
        raise RayZeroValueError(f"checkpoint RNG state of rank {rank} is malformed ({part}: {error}); the "
                                "checkpoint's manifest was damaged or edited") from None
    return setters


def _numpy_setter(saved: Any) -> list[Callable[[], None]]:
    try:
        import numpy
    except ImportError:
        return []
    kind, keys, position, has_gauss, cached = saved
    numpy_state = (kind, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached)
    numpy.random.RandomState().set_state(numpy_state)
    return [lambda: numpy.random.set_state(numpy_state)]
