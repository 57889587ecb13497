"""Hugging Face `transformers` in and out of rayzero (extra `hf`: `pip install 'rayzero[hf]'`).

In: `from_pretrained(AutoModelForCausalLM, "path/to/model")` builds the model and loads a pretrained
safetensors checkpoint (one file, or shards with `model.safetensors.index.json`). With a ZeRO-3
config it builds under `rayzero.zero.Init` (parameters partitioned as they are created, nothing
random drawn for weights that are loaded anyway) and each rank reads, with `os.pread`, only the
byte ranges of its own partition of each tensor: no rank ever holds the whole model, nor maps the
files (a memory map would count every touched page against the process). Other stages load whole
tensors. `load_pretrained_weights(model, path)` does the loading part for a model built by hand.

Out: `engine.save_16bit_model(dir, "model.safetensors")` (with `config.json`) and
`rayzero checkpoint consolidate --hf OUT` write directories `from_pretrained` loads.

The model "auto"s of a DeepSpeed config (bucket sizes, persistence threshold) are resolved by
`rayzero.initialize` from `model.config.hidden_size`; the trainer "auto"s from `rayzero.fit(...,
trainer={...})` / `rayzero run --trainer KEY=VALUE`, with HF `TrainingArguments` names.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rayzero.checkpoint.consolidate import ShardFileIndex
from rayzero.checkpoint.shard_file import _FROM_CODE
from rayzero.config.environment import CONFIG
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.partition import split_evenly
from rayzero.engine.stage3.parameters import lookup
from rayzero.integrations.random_streams import streams_kept

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class LoadReport:
    """What `load_pretrained_weights` did."""

    loaded: list[str] = field(default_factory=list)
    """Parameter / buffer names filled from the checkpoint."""
    partitioned: int = 0
    """How many of them were ZeRO-3 partitions (only this rank's range read)."""
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint files."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors the model has no place for (warned about)."""


def _weight_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """tensor name -> the safetensors file holding it."""
    directory = Path(path)
    if directory.is_file():
        return dict.fromkeys(ShardFileIndex(str(directory)).header, str(directory))
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: str(directory / file) for name, file in weight_map.items()}
    if (directory / WEIGHTS).is_file():
        index = ShardFileIndex(str(directory / WEIGHTS))
        index.close()
        return dict.fromkeys(index.header, str(directory / WEIGHTS))
    raise RayZeroValueError(
        f"{directory}: no {WEIGHTS} nor {INDEX}: give a Hugging Face model directory saved with safetensors "
        "(save_pretrained's default), or one .safetensors file")


def _checkpoint_name(name: str, available: dict[str, str], prefix: str) -> str | None:
    """The checkpoint's name for model tensor `name`, allowing for the base-model prefix either way
    (a `...ForCausalLM` checkpoint loaded into the base model and the reverse, as from_pretrained)."""
    if name in available:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in available:
        return name[len(prefix) + 1:]
    if prefix and f"{prefix}.{name}" in available:
        return f"{prefix}.{name}"
    return None


def load_pretrained_weights(model: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True) -> LoadReport:
    """Fill `model`'s parameters and persistent buffers from a safetensors checkpoint.

    ZeRO-3 partitioned parameters (built under `rayzero.zero.Init`) get only this rank's range, read
    straight from the file; others get the whole tensor. `strict`: a parameter the checkpoint lacks
    (tied weights aside: they are one tensor) is an error naming it; extra checkpoint tensors warn.
    """
    available = _weight_files(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    report = LoadReport()
    indexes: dict[str, ShardFileIndex] = {}
    used: set[str] = set()
    missing: list[str] = []
    buffers = [(name, buf) for name, buf in model.named_buffers() if _is_persistent(model, name)]
    try:
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *buffers]:
                key = _checkpoint_name(name, available, prefix)
                if key is None:
                    missing.append(name)
                    continue
                file = available[key]
                if file not in indexes:
                    indexes[file] = ShardFileIndex(file)
                report.bytes_read += _load_one(indexes[file], key, tensor, report)
                used.add(key)
                report.loaded.append(name)
    finally:
        for index in indexes.values():
            index.close()
    report.unexpected = sorted(set(available) - used)
    if report.unexpected:
        logger.warning("%s: %d checkpoint tensor(s) not used by %s: %s", path, len(report.unexpected),
                       type(model).__name__, ", ".join(report.unexpected[:8]))
    if missing and strict:
        raise RayZeroValueError(
            f"{path} has no weights for {len(missing)} tensor(s) of {type(model).__name__}: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; check the checkpoint matches the "
            "model class, or pass strict=False to keep their initial values")
    return report


def _is_persistent(model: torch.nn.Module, name: str) -> bool:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return leaf not in owner._non_persistent_buffers_set


def _load_one(index: ShardFileIndex, key: str, tensor: torch.Tensor, report: LoadReport) -> int:
    entry = index.header[key]
    stored = _FROM_CODE[entry["dtype"]]
    shape = tuple(entry["shape"])
    partition = lookup(tensor)
    if partition is not None:
        partitions, param = partition
        if tuple(param.shape) != shape:
            raise RayZeroValueError(f"{index.path}: {key} has shape {list(shape)}, the model's is {list(param.shape)}")
        start, end = split_evenly(param.numel, partitions.comm.world_size, partitions.comm.rank)
        piece = torch.empty(end - start, dtype=stored)
        index.read_into(key, start, end, piece)  # only this rank's bytes
        partitions.write_shard(param, piece)
        report.partitioned += 1
        return piece.numel() * stored.itemsize
    if tuple(tensor.shape) != shape:
        raise RayZeroValueError(f"{index.path}: {key} has shape {list(shape)}, the model's is {list(tensor.shape)}")
    whole = torch.empty(tensor.numel(), dtype=stored)
    index.read_into(key, 0, tensor.numel(), whole)
    tensor.copy_(whole.reshape(shape))
    return whole.numel() * stored.itemsize


def _zeros(module: torch.nn.Module) -> None:
    """Init for modules whose weights are loaded next: no random numbers, any module type."""
    for param in module.parameters(recurse=False):
        param.zero_()
    for buf in module.buffers(recurse=False):
        buf.zero_()


def from_pretrained(model_class: Any, path: str | os.PathLike[str], config: Any = None, strict: bool = True,
                    **model_kwargs: Any) -> torch.nn.Module:
    """`model_class.from_config(AutoConfig.from_pretrained(path))`, with the weights of `path` loaded.

    `config` is the DeepSpeed config (default: the run's, $RAYZERO_CONFIG): with ZeRO stage 3 the model
    is built partitioned under `rayzero.zero.Init` and each rank reads only its partitions. Nothing
    is downloaded: `path` is a local directory.
    """
    from transformers import AutoConfig

    from rayzero.engine.stage3.zero_init import Init, _zero_stage

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config is None:
        config = CONFIG.get()
    build = getattr(model_class, "from_config", None) or model_class
    # The skeleton's random initial values are replaced by the checkpoint's: drawing them must not move
    # the program's streams, as transformers' own from_pretrained draws nothing for a complete
    # checkpoint ([Note: the user's random streams])
    with streams_kept():
        if _zero_stage(config) == 3:
            with Init(config=config, param_init_fn=_zeros):
                model = build(hf_config, **model_kwargs)
            # buffers the model computes in __init__ (rotary tables, masks) were zeroed above: rebuild them
            _restore_computed_buffers(model, hf_config, build, model_kwargs)
        else:
            model = build(hf_config, **model_kwargs)
    load_pretrained_weights(model, path, strict=strict)
    return model


def _restore_computed_buffers(model: torch.nn.Module, hf_config: Any, build: Any, kwargs: dict[str, Any]) -> None:
    """Non-persistent buffers hold values computed at construction, not weights: take them from a
    meta-free build of the module skeleton only when there are any (they are small)."""
    names = [name for name, _ in model.named_buffers() if not _is_persistent(model, name)]
    if not names:
        return
    with torch.device("cpu"):
        reference_buffers = _buffers_only(build, hf_config, kwargs, names)
    for name, value in reference_buffers.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[leaf] = value.to(owner._buffers[leaf].device)


def _buffers_only(build: Any, hf_config: Any, kwargs: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    # Parameters are created on the meta device (no memory); buffers computed in __init__ are kept.
    # torch.device("meta") would make the buffers meta too, so parameters are redirected instead.
    from torch.nn.modules import module as torch_module

    def to_meta(module: torch.nn.Module, name: str, param: Any) -> Any:
        if param is not None and not param.is_meta:
            return torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return None

    handle = torch_module.register_module_parameter_registration_hook(to_meta)
    try:
        reference = build(hf_config, **kwargs)
    finally:
        handle.remove()
    found = dict(reference.named_buffers())
    return {name: found[name] for name in names if name in found and not found[name].is_meta}
