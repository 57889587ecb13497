"""Consolidate a sharded checkpoint into one state dict keyed by the module's parameter names.

Runs with no cluster and no GPU, in bounded memory: the output header is known from the manifest,
so tensors are assembled one at a time from byte ranges of the shard files (`os.pread`, no whole
file in memory) and streamed out. Weights come from the fp32 master copy where the checkpoint has
one (`master/<name>`), else from the module copy (`module/<name>`: buffers, frozen parameters).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from rayzero.checkpoint.manifest import Manifest, load_manifest, resolve_tag_dir
from rayzero.checkpoint.reshard import plan_read
from rayzero.checkpoint.shard_file import (
    _FROM_CODE,
    SafetensorsWriter,
    ShardMismatchError,
    dtype_from_name,
    read_header,
)
from rayzero.config.errors import RayZeroValueError


class ShardFileIndex:
    """Random access to the tensors of one shard file by reading only their bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.header, self.data_start = read_header(path)  # checked against the file: ShardMismatchError
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise ShardMismatchError(path, f"it cannot be read ({error.strerror or error}); run "
                                           "`rayzero checkpoint verify`") from None

    def read_into(self, name: str, begin: int, end: int, out: torch.Tensor) -> None:
        """Elements [begin, end) of stored tensor `name` into `out` (same dtype, end - begin elements)."""
        entry = self.header.get(name)
        dtype = _FROM_CODE[entry["dtype"]] if entry is not None else None
        size = dtype.itemsize if dtype is not None else 1
        if dtype != out.dtype or not 0 <= begin <= end <= (entry["data_offsets"][1] - entry["data_offsets"][0]) // size:
            raise ShardMismatchError(self.path, f"it holds no {out.dtype} elements [{begin}, {end}) of {name!r}")
        target = memoryview(out.view(torch.uint8).numpy()).cast("B")
        position = self.data_start + entry["data_offsets"][0] + begin * size
        done = 0
        while done < (end - begin) * size:
            count = os.preadv(self.fd, [target[done:]], position + done)
            if count <= 0:
                raise ShardMismatchError(self.path, f"short read of {name!r} (file truncated? run "
                                                    "`rayzero checkpoint verify`)")
            done += count

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class ConsolidatedTensor:
    key: str
    """Module parameter/buffer name, e.g. `layers.0.weight`."""
    source: str
    """The manifest tensor it is read from (`master/...` or `module/...`)."""
    shape: tuple[int, ...]
    stored_dtype: torch.dtype


def plan(manifest: Manifest) -> list[ConsolidatedTensor]:
    out = []
    for name, entry in sorted(manifest.tensors.items()):
        if not name.startswith("module/"):
            continue
        key = name.removeprefix("module/")
        source = f"master/{key}" if f"master/{key}" in manifest.tensors else name
        chosen = manifest.tensors[source]
        out.append(ConsolidatedTensor(key, source, tuple(chosen.shape), dtype_from_name(chosen.dtype)))
    # tied weights (alias -> first name) are stored once; a plain module's state_dict names both
    by_key = {tensor.key: tensor for tensor in out}
    for alias, first in sorted(manifest.extra_state.get("tied_parameters", {}).items()):
        if first in by_key and alias not in by_key:
            out.append(ConsolidatedTensor(alias, by_key[first].source, by_key[first].shape, by_key[first].stored_dtype))
    return out


def consolidate(checkpoint: str, output: str, dtype: torch.dtype | None = None, fmt: str = "safetensors",
                keys: set[str] | None = None) -> int:
    """Write the consolidated state dict of `checkpoint` (save dir or tag dir) to `output`; returns
    the number of tensors written. `keys`: only these module names (one file of a sharded output)."""
    if fmt not in ("safetensors", "torch"):
        raise RayZeroValueError(f"--format {fmt!r}: use safetensors or torch")
    tag_dir = resolve_tag_dir(checkpoint)
    manifest = load_manifest(tag_dir)
    tensors = [t for t in plan(manifest) if keys is None or t.key in keys]
    if not tensors:
        raise RayZeroValueError(f"{tag_dir} holds no module/ tensors to consolidate")
    out_dtypes = {t.key: dtype or t.stored_dtype for t in tensors}
    # widest first keeps every tensor aligned in the output (torch format views one mapped buffer)
    tensors.sort(key=lambda t: -out_dtypes[t.key].itemsize)
    files: dict[str, ShardFileIndex] = {}
    data_path = output + ".data.tmp" if fmt == "torch" else output
    writer = SafetensorsWriter(data_path, [(t.key, out_dtypes[t.key], t.shape) for t in tensors], fsync=False)
    try:
        for t in tensors:
            entry = manifest.tensors[t.source]
            full = torch.empty(entry.numel, dtype=t.stored_dtype)
            for step in plan_read(t.source, entry, 0, entry.numel):
                if step.piece.file not in files:
                    files[step.piece.file] = ShardFileIndex(os.path.join(tag_dir, step.piece.file))
                length = step.source_end - step.source_start
                files[step.piece.file].read_into(t.source, step.source_start, step.source_end,
                                                 full[step.target_start:step.target_start + length])
            writer.write(t.key, full.to(out_dtypes[t.key]))
            del full
        writer.close()
    except BaseException:
        writer.abort()  # nothing partial: the output appears whole or not at all
        raise
    finally:
        for index in files.values():
            index.close()
    if fmt == "torch":
        _safetensors_to_torch(data_path, output)
    return len(tensors)


def _safetensors_to_torch(source: str, output: str) -> None:
    """Re-wrap a streamed safetensors file as a torch.save dict of tensors, through a memory map of
    the data (page cache, not private memory), so this step is bounded too."""
    index = ShardFileIndex(source)
    index.close()
    storage = torch.UntypedStorage.from_file(source, shared=True, nbytes=os.path.getsize(source))
    state = {}
    for name, entry in index.header.items():
        dtype = _FROM_CODE[entry["dtype"]]
        begin = index.data_start + entry["data_offsets"][0]
        assert begin % dtype.itemsize == 0, "widest-first order keeps every tensor aligned"
        view = torch.empty(0, dtype=dtype)
        view.set_(storage, begin // dtype.itemsize, tuple(entry["shape"]))
        state[name] = view
    torch.save(state, output + ".tmp")
    os.replace(output + ".tmp", output)
    os.remove(source)



HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def consolidate_hf(checkpoint: str, out_dir: str, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = 5 * 10**9, hf_config: dict | None = None) -> list[str]:
    """Write a directory `transformers`' `from_pretrained` loads: config.json, the weights as
    `model.safetensors` (or `model-0000i-of-0000n.safetensors` files and their index when larger than
    `max_shard_bytes`, as `save_pretrained` splits them), tied weights stored once under their first
    name (from_pretrained ties them again, following `tie_word_embeddings`). The config comes from
    `hf_config` or, else, the one the engine recorded in the checkpoint (`model.config`). Streams
    one tensor at a time like `consolidate`. Returns the files written."""
    tag_dir = resolve_tag_dir(checkpoint)
    manifest = load_manifest(tag_dir)
    config = hf_config or manifest.extra_state.get("hf_config")
    if not config:
        raise RayZeroValueError(
            f"{tag_dir} records no Hugging Face model config (the model had no `.config` when it was saved); "
            "pass --hf-config PATH (a config.json, or the model directory holding it)")
    tensors = plan(manifest)
    aliases = set(manifest.extra_state.get("tied_parameters", {}))
    if config.get("tie_word_embeddings", True):
        tensors = [t for t in tensors if t.key not in aliases]
    if not tensors:
        raise RayZeroValueError(f"{tag_dir} holds no module/ tensors to consolidate")
    sizes = {t.key: math.prod(t.shape) * (dtype or t.stored_dtype).itemsize for t in tensors}
    groups: list[list[str]] = [[]]
    filled = 0
    for t in tensors:  # in name order, like save_pretrained's
        if groups[-1] and filled + sizes[t.key] > max_shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(t.key)
        filled += sizes[t.key]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if len(groups) == 1:
        names = [HF_WEIGHTS]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups):
        consolidate(tag_dir, os.path.join(out_dir, name), dtype, "safetensors", keys=set(group))
        written.append(name)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {key: name for name, group in zip(names, groups) for key in group}}
        _write_json(os.path.join(out_dir, HF_INDEX), index)
        written.append(HF_INDEX)
    config = dict(config)
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    _write_json(os.path.join(out_dir, "config.json"), config)
    written.append("config.json")
    return written


def _write_json(path: str, value: dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
