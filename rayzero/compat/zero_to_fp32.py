"""`deepspeed.utils.zero_to_fp32`: full fp32 weights out of a rayzero checkpoint, DeepSpeed's signatures.

DeepSpeed reassembles its own per-rank pickles; here the checkpoint's manifest already says where
every piece of every tensor lives, so these functions are `rayzero checkpoint consolidate` (bounded
memory, one tensor at a time, fp32 from the master copy) behind DeepSpeed's names. `checkpoint_dir`
is the directory holding `latest` and the tag directories (an HF Trainer's `checkpoint-N`), or one
tag directory. Run as a script it takes DeepSpeed's `zero_to_fp32.py` arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
from typing import Any

import torch

from rayzero.checkpoint.consolidate import consolidate, plan
from rayzero.checkpoint.manifest import read_manifest, resolve_tag_dir
from rayzero.compat.refused import refuse

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def _tag_dir(checkpoint_dir: str, tag: str | None, exclude_frozen_parameters: bool) -> str:
    if exclude_frozen_parameters:
        refuse("zero_to_fp32(exclude_frozen_parameters=True)",
               "a rayzero checkpoint stores frozen parameters and buffers alike as module tensors; "
               "drop the frozen names from the state dict after loading it")
    return os.path.join(checkpoint_dir, tag) if tag else resolve_tag_dir(checkpoint_dir)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state dict, fp32 where the checkpoint holds master weights, in memory
    (`lazy_mode` is accepted; the tensors are read at once)."""
    from safetensors.torch import load_file

    tag_dir = _tag_dir(checkpoint_dir, tag, exclude_frozen_parameters)
    with tempfile.TemporaryDirectory(prefix="rayzero-zero-to-fp32-") as scratch:
        path = os.path.join(scratch, "model.safetensors")
        consolidate(tag_dir, path)
        return load_file(path)


def _shard_bytes(max_shard_size: int | str | None) -> float:
    if max_shard_size is None:
        return math.inf
    if isinstance(max_shard_size, int):
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", max_shard_size)
    if match is None or match.group(2).upper() not in _UNITS:
        refuse(f"max_shard_size={max_shard_size!r}", "write a size such as '5GB', '500MB' or a number of bytes")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write `pytorch_model.bin` (or `model.safetensors` with `safe_serialization`) into
    `output_dir`, split into numbered files plus an index past `max_shard_size`, as DeepSpeed does;
    returns the file names written."""
    tag_dir = _tag_dir(checkpoint_dir, tag, exclude_frozen_parameters)
    manifest = read_manifest(tag_dir)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    limit = _shard_bytes(max_shard_size)
    groups: list[list[str]] = [[]]
    filled = 0
    for tensor in plan(manifest):
        size = math.prod(tensor.shape) * tensor.stored_dtype.itemsize
        if groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(tensor.key)
        filled += size
    os.makedirs(output_dir, exist_ok=True)
    fmt = "safetensors" if safe_serialization else "torch"
    if len(groups) == 1:
        consolidate(tag_dir, os.path.join(output_dir, weights), fmt=fmt)
        return [weights]
    stem, suffix = os.path.splitext(weights)
    names = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{suffix}" for i in range(len(groups))]
    for name, group in zip(names, groups):
        consolidate(tag_dir, os.path.join(output_dir, name), fmt=fmt, keys=set(group))
    index = {"metadata": {}, "weight_map": {key: name for name, group in zip(names, groups) for key in group}}
    index_name = f"{weights}.index.json"
    with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=2, sort_keys=True)
    return [*names, index_name]


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
                                         ) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU, as DeepSpeed does) and
    return it; `strict=False` as there, so a model with extra buffers still loads."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description="Consolidate a rayzero checkpoint into fp32 weights "
                                     "(DeepSpeed's zero_to_fp32.py arguments)")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    return convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                      args.safe_serialization, args.tag,
                                                      args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
