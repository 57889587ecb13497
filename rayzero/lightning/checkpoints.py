"""Lightning checkpoints as rayzero checkpoints: the trainer state in the manifest, the newest one found
for a restart, and a full state dict loaded into an engine.

[Note: Lightning checkpoints]
`trainer.save_checkpoint(path)` / `ModelCheckpoint` write what DeepSpeedStrategy writes: a directory
`path/` holding one sharded checkpoint under the tag `checkpoint` (plus `latest`), through the
engine's own `save_checkpoint`, so it reshards at load and `rayzero checkpoint consolidate path`
reads it. Lightning's checkpoint dict minus `state_dict` and `optimizer_states` (the engine's shards
hold those) is the checkpoint's `client_state`, which lives in the manifest as JSON: nothing in a
checkpoint runs code when it loads. Lightning's dict holds a few things JSON has no word for (tensors
such as ModelCheckpoint's `best_model_score`, tuples, non-string keys, infinities); `encode_state`
tags them and `decode_state` rebuilds them exactly. Hyperparameters that are not plain data (objects
given to `save_hyperparameters`) are left out with a warning: resuming never needs them (the script
builds the module), only `load_from_checkpoint` would, and that cannot read a sharded checkpoint anyway.
"""
from __future__ import annotations

import glob
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rayzero.checkpoint.manifest import read_manifest, resolve_tag_dir
from rayzero.checkpoint.types import ShardSpec
from rayzero.config.errors import RayZeroValueError

logger = logging.getLogger(__name__)

TAG = "checkpoint"
"""The tag under a Lightning checkpoint directory (DeepSpeedStrategy's)."""
MARKER = "rayzero_lightning"
"""client_state key that marks a checkpoint written by RayZeroStrategy (its value: the format version)."""
PLANNED_STOP = "rayzero_planned_stop"
"""Checkpoint key set in the checkpoint a planned stop writes ([Note: Lightning planned stops])."""
_OPTIONAL = ("hyper_parameters", "datamodule_hyper_parameters")
"""Keys dropped (with a warning) rather than refused when they hold something JSON cannot carry."""


def encode_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict as JSON-able data, without the weights and optimizer states."""
    out: dict[str, Any] = {MARKER: 1}
    for key, value in checkpoint.items():
        if key in ("state_dict", "optimizer_states"):
            continue
        try:
            out[key] = _encode(value, key)
        except TypeError as error:
            if key not in _OPTIONAL:
                raise RayZeroValueError(
                    f"trainer.save_checkpoint: the checkpoint entry {key!r} cannot be stored ({error}); rayzero keeps "
                    "the trainer state as JSON (loading a checkpoint never runs code). Keep numbers, strings, "
                    "lists, dicts and tensors in callback and datamodule state_dicts") from None
            logger.warning("trainer.save_checkpoint left %r out of the checkpoint (%s); resuming does not need "
                           "it", key, error)
    return out


def decode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict `encode_state` was given (minus the weights and optimizer states)."""
    return {key: _decode(value) for key, value in state.items() if key != MARKER}


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _encode(value.detach().cpu().tolist(), where), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(item, where) for item in value]}
    if isinstance(value, list):
        return [_encode(item, where) for item in value]
    if isinstance(value, os.PathLike):
        return {"__path__": os.fspath(value)}
    if isinstance(value, Mapping):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: _encode(item, f"{where}.{key}") for key, item in value.items()}
        return {"__items__": [[_encode(key, where), _encode(item, f"{where}[{key!r}]")] for key, item in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "__float__" in value:
        return float(value["__float__"])
    if "__tensor__" in value:
        return torch.tensor(_decode(value["__tensor__"]), dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    if "__tuple__" in value:
        return tuple(_decode(item) for item in value["__tuple__"])
    if "__path__" in value:
        return value["__path__"]
    if "__items__" in value:
        return {_decode(key): _decode(item) for key, item in value["__items__"]}
    return {key: _decode(item) for key, item in value.items()}


def is_rayzero_checkpoint(path: str) -> bool:
    """A local directory holding a committed rayzero checkpoint (a save directory or a tag)."""
    try:
        return os.path.isdir(path) and read_manifest(resolve_tag_dir(path)) is not None
    except (OSError, ValueError):
        return False


def lightning_progress(path: str) -> tuple[int, bool, float] | None:
    """(trainer global_step, written by a planned stop, commit time) of a committed RayZeroStrategy
    checkpoint at `path`, else None."""
    if not is_rayzero_checkpoint(path):
        return None
    manifest = read_manifest(resolve_tag_dir(path))
    if manifest is None or MARKER not in manifest.client_state:
        return None
    state = manifest.client_state
    return int(state.get("global_step", 0)), bool(state.get(PLANNED_STOP)), float(manifest.created_unix)


def newest_lightning_checkpoint(candidates: Iterable[str]) -> str | None:
    """The candidate (a checkpoint directory, or a directory of them) whose Lightning checkpoint is
    furthest along: the highest global step; at one step a planned stop's (the others a stop leaves
    were written after Lightning ended the epoch early: resuming from them would skip its rest), then
    the latest commit."""
    found: dict[str, tuple[int, bool, float]] = {}
    for candidate in candidates:
        if not candidate or "://" in candidate or not os.path.isdir(candidate):
            continue  # remote storage is not searched: pass ckpt_path= for a checkpoint there
        entries = [candidate] if is_rayzero_checkpoint(candidate) else glob.glob(os.path.join(candidate, "*"))
        for entry in entries:
            real = os.path.realpath(entry)  # ModelCheckpoint's `last.ckpt` may link to another file
            if real not in found and (progress := lightning_progress(real)) is not None:
                found[real] = progress
    if not found:
        return None
    return max(found, key=lambda path: found[path])


def load_full_state_dict(engine: Any, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Put a full (unsharded) state dict, keyed as `module.state_dict()`, into the engine's weights at
    any stage; fp32 masters are taken from it too, optimizer state is left as it is."""
    with engine.strategy.offload.resident(engine.optimizer):  # NVMe-swapped state is read in memory
        _load_full_state_dict(engine, state_dict, strict)


def _load_full_state_dict(engine: Any, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
    current = {shard.spec.name: shard for shard in engine.state_shards()}
    names = {name.removeprefix("module/") for name in current if name.startswith("module/")}
    if strict:
        missing, unexpected = sorted(names - set(state_dict)), sorted(set(state_dict) - names)
        if missing or unexpected:
            raise RayZeroValueError(
                f"the checkpoint's state_dict does not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; set LightningModule.strict_loading = False to load it partially")

    def read(spec: ShardSpec) -> torch.Tensor:
        kind, _, rest = spec.name.partition("/")
        name = rest.split("/", 1)[1] if kind == "optim" else rest
        if kind in ("module", "master") and name in state_dict:
            return state_dict[name].detach().reshape(-1)[spec.flat_start:spec.flat_end].to(spec.dtype)
        if kind == "master":
            raise KeyError(spec.name)  # the engine rebuilds the master from the loaded weight
        return current[spec.name].local.detach().clone()  # optimizer state, or a key the file lacks

    engine.load_state_shards(read)
