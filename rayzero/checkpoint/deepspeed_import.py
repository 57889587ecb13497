"""`rayzero checkpoint import-deepspeed DS_CHECKPOINT OUT`: bring a DeepSpeed ZeRO checkpoint along.

Reads a DeepSpeed (0.19.x) ZeRO stage 1, 2 or 3 checkpoint — model states, the fp32 master
partitions, the optimizer's per-element state (Adam's exp_avg / exp_avg_sq), its step and
hyperparameters, the lr scheduler position, loss scale and sample count — and writes one rayzero
checkpoint with whole tensors. `load_checkpoint` reshards it online, so the run continues at any
world size and stage.

[Note: reading DeepSpeed's pickles]
DeepSpeed's files are `torch.save` pickles, and pickles can run code. They are read with
`torch.load(weights_only=True)`; the few non-tensor globals DeepSpeed 0.19 puts in them
(`ZeroStageEnum`, `LossScaler` / `DynamicLossScaler`, `fragment_address`) are allowlisted by
name and rebuilt as the inert stand-ins below, so neither DeepSpeed nor anything else is imported
or run. Any other global is refused with a message naming it.

The layouts follow DeepSpeed's own `zero_to_fp32.py`: stages 1-2 keep, per param group, one flat
fp32 vector split evenly across ranks (parameters in `param_shapes` order, with
`param_alignment_paddings`); stage 3 splits every parameter on its own into ceil(numel / world)
pieces, each rank's pieces concatenated (over `sub_group_size` groups) in `param_shapes` order.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroError, RayZeroValueError
from rayzero.config.names import check_name


# ---- inert stand-ins for DeepSpeed's pickled globals ([Note: reading DeepSpeed's pickles]) -----
class _Inert:
    """Holds whatever the pickle gives it; has no behaviour."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class ZeroStage(_Inert):
    """deepspeed.runtime.zero.config.ZeroStageEnum(value)."""


class LossScalerState(_Inert):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler attributes."""


class FragmentAddress(_Inert):
    """deepspeed.utils.tensor_fragment.fragment_address(numel, start)."""


_ALLOWED = [
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_deepspeed_file(path: str) -> dict[str, Any]:
    """One DeepSpeed checkpoint file, read without running any of its code."""
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle errors come in many types
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        if found:
            raise RayZeroValueError(
                f"{path} needs the Python global {found.group(1)}, which is not among the DeepSpeed checkpoint "
                f"globals rayzero reads ({', '.join(sorted({name for _, name in _ALLOWED}))}); the file was not "
                "loaded and none of its code ran. Convert it with DeepSpeed's zero_to_fp32.py, or report the "
                "global if this is a plain DeepSpeed checkpoint") from None
        raise RayZeroValueError(f"{path}: not a readable DeepSpeed checkpoint file ({error})") from None


# ---- locating the files ----------------------------------------------------------------------
def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def resolve_tag_dir(location: str, tag: str | None = None) -> str:
    """A DeepSpeed save dir (with `latest`) or one `global_stepN` dir -> the tag dir to read. The tag
    (`--tag`, or what `latest` says) is checked as a name ([Note: names that become paths]): it
    becomes the imported checkpoint's tag directory."""
    if tag is not None:
        location = os.path.join(location, check_name(tag, "--tag"))
    elif os.path.isfile(os.path.join(location, "latest")):
        latest = os.path.join(location, "latest")
        with open(latest, "rb") as handle:
            named = handle.read(1024).decode("utf-8", "replace").strip()
        location = os.path.join(location, check_name(named, f"the tag in {latest}"))
    if not glob.glob(os.path.join(location, "*_optim_states.pt")):
        raise RayZeroValueError(
            f"{location}: no DeepSpeed *_optim_states.pt files; give the directory passed to "
            "engine.save_checkpoint (it holds `latest`) or one of its global_stepN directories")
    return location


@dataclass
class DeepSpeedCheckpoint:
    stage: int
    world_size: int
    model: dict[str, Any]  # rank 0's model states file
    model_files: list[dict[str, Any]]
    optim: list[dict[str, Any]]  # each rank's "optimizer_state_dict"
    tag: str


def read_checkpoint(tag_dir: str) -> DeepSpeedCheckpoint:
    optim_paths = sorted(glob.glob(os.path.join(tag_dir, "*_optim_states.pt")), key=_natural)
    if any(os.path.basename(p).startswith(("bf16_", "fp16_")) for p in optim_paths):
        raise RayZeroValueError(f"{tag_dir}: DeepSpeed's bf16/fp16 pipeline-optimizer checkpoints are not "
                                "supported; convert with DeepSpeed's ds_to_universal.py first")
    model_paths = sorted(glob.glob(os.path.join(tag_dir, "*_model_states.pt")), key=_natural)
    optim = [load_deepspeed_file(path)["optimizer_state_dict"] for path in optim_paths]
    stage_value = optim[0].get("zero_stage")
    if stage_value is None:
        raise RayZeroValueError(f"{optim_paths[0]} is not a ZeRO checkpoint (no zero_stage)")
    stage = int(stage_value.args[0]) if isinstance(stage_value, ZeroStage) else int(stage_value)
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim):
        raise RayZeroValueError(f"{tag_dir}: the checkpoint was written by {world} ranks but holds "
                                f"{len(optim)} optimizer files; a rank's save is missing")
    models = [load_deepspeed_file(path) for path in model_paths]
    if not models:
        raise RayZeroValueError(f"{tag_dir}: no DeepSpeed *_model_states.pt file; a DeepSpeed save always writes one")
    tag = check_name(os.path.basename(tag_dir.rstrip("/")), f"the tag directory name of {tag_dir}")
    return DeepSpeedCheckpoint(stage, world, models[0], models, optim, tag)


# ---- reassembling whole tensors ------------------------------------------------------------------
def _elementwise_keys(state: dict[str, Any], numel: int) -> list[str]:
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel)


def _consumed(tag_dir: str, group: int, used: int, available: int, align: int = 1) -> None:
    """DeepSpeed's zero_to_fp32 sanity check: the parameter shapes account for every element of the
    flat partition (aligned as DeepSpeed aligns it); anything else would misplace every later weight."""
    def aligned(count: int) -> int:
        return align * math.ceil(count / align)

    if aligned(used) != aligned(available):
        raise RayZeroValueError(f"{tag_dir}: param group {group}: the parameter shapes use {used} elements of the "
                                f"{available} in the fp32 partitions; the model states and optimizer files do not match")


def _stage12(ds: DeepSpeedCheckpoint, tag_dir: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """name -> {"master": fp32, "<state key>": ...}, and the base optimizer state of rank 0."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    base0 = ds.optim[0]["base_optimizer_state"]
    paddings = ds.optim[0].get("param_alignment_paddings")
    for group, shapes in enumerate(ds.model["param_shapes"]):
        flats = {"master": torch.cat([o["single_partition_of_fp32_groups"][group] for o in ds.optim])}
        rank_state = base0["state"].get(group, {})
        for key in _elementwise_keys(rank_state, ds.optim[0]["single_partition_of_fp32_groups"][group].numel()):
            flats[key] = torch.cat([o["base_optimizer_state"]["state"][group][key] for o in ds.optim])
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            out[name] = {key: flat[offset:offset + numel].reshape(tuple(shape)).clone() for key, flat in flats.items()}
            offset += numel + (paddings[group][index] if paddings else 0)
        _consumed(tag_dir, group, offset, flats["master"].numel(), align=2 * ds.world_size)
    return out, base0


def _stage3(ds: DeepSpeedCheckpoint, tag_dir: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    base0 = ds.optim[0]["optimizer_state_dict"]
    per_rank: dict[str, list[torch.Tensor]] = {"master": [torch.cat(list(o["fp32_flat_groups"])) for o in ds.optim]}
    sub_groups = sorted(base0["state"])
    first = base0["state"][sub_groups[0]] if sub_groups else {}
    for key in _elementwise_keys(first, ds.optim[0]["fp32_flat_groups"][0].numel()):
        per_rank[key] = [torch.cat([o["optimizer_state_dict"]["state"][g][key] for g in sub_groups]) for o in ds.optim]
    out: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for shapes in ds.model["param_shapes"]:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / ds.world_size)
            out[name] = {key: torch.cat([flat[offset:offset + piece] for flat in flats])[:numel].reshape(tuple(shape))
                         for key, flats in per_rank.items()}
            offset += piece
    _consumed(tag_dir, 0, offset, per_rank["master"][0].numel())
    return out, base0


def _frozen(ds: DeepSpeedCheckpoint) -> dict[str, torch.Tensor]:
    shapes = ds.model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if ds.stage <= 2:
        return {name: ds.model["module"][name] for name in shapes}
    out = {}
    for name, shape in shapes.items():
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in ds.model_files]
        out[name] = torch.cat(pieces)[:math.prod(shape)].reshape(tuple(shape))
    return out


_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov", "maximize")


def _compute_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    if (ds_config.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled") is True:
        return torch.bfloat16
    return torch.float32


def _loss_scaler(optim: dict[str, Any]) -> dict[str, Any]:
    scaler = optim.get("loss_scaler")
    values = getattr(scaler, "__dict__", {})
    if optim.get("dynamic_loss_scale"):
        return {"type": "dynamic", "cur_scale": float(values.get("cur_scale", 2.0**16)),
                "cur_iter": int(values.get("cur_iter", 0)),
                "last_overflow_iter": int(values.get("last_overflow_iter", -1)),
                "cur_hysteresis": int(values.get("cur_hysteresis", 2)), "overflow_count": 0}
    return {"type": "static", "cur_scale": float(values.get("cur_scale", 1.0)), "overflow_count": 0}


def import_deepspeed(location: str, output: str, tag: str | None = None) -> str:
    """Convert the DeepSpeed checkpoint at `location` into a rayzero checkpoint under save dir
    `output`; returns the written tag directory."""
    tag_dir = resolve_tag_dir(location, tag)
    try:
        shards, steps, extra, ds = _convert(tag_dir)
    except RayZeroError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as error:
        # DeepSpeed's files are nested pickled dicts; one of another layout (or damaged) fails somewhere
        # in the reassembly: say where and what, never a bare traceback ([Note: reading DeepSpeed's pickles])
        what = f"missing key {error.args[0]!r}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise RayZeroValueError(
            f"{tag_dir}: not a DeepSpeed ZeRO 1-3 checkpoint rayzero can import ({what}); check that DeepSpeed's "
            "zero_to_fp32.py reads it, or re-save it with DeepSpeed 0.19") from None
    checkpointer = Checkpointer(CheckpointOptions())
    written = checkpointer.save(output, ds.tag, steps, ds.stage, shards, extra, {}, "", asynchronous=False)
    checkpointer.wait()
    return written


def _convert(tag_dir: str) -> tuple[list[ShardedTensor], int, dict[str, Any], DeepSpeedCheckpoint]:
    """Read and reassemble: (whole-tensor shards, global steps, the engine's extra state, the checkpoint)."""
    ds = read_checkpoint(tag_dir)
    tensors, base = _stage12(ds, tag_dir) if ds.stage <= 2 else _stage3(ds, tag_dir)
    ds_config = ds.model.get("ds_config") or {}
    dtype = _compute_dtype(ds_config)
    module_state = ds.model.get("module") or {}
    shards: list[ShardedTensor] = []

    def add(name: str, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1).contiguous()
        shards.append(ShardedTensor(ShardSpec(name, tuple(value.shape), flat.dtype, 0, flat.numel()), flat))

    for name, values in tensors.items():
        saved = module_state.get(name)
        module_copy = saved if ds.stage <= 2 and isinstance(saved, torch.Tensor) and saved.numel() else None
        add(f"module/{name}", module_copy if module_copy is not None else values["master"].to(dtype))
        add(f"master/{name}", values["master"].float())
        for key, value in values.items():
            if key != "master":
                add(f"optim/{key}/{name}", value)
    for name, value in _frozen(ds).items():
        add(f"module/{name}", value)
    for name in ds.model.get("buffer_names") or []:
        if name in module_state:
            add(f"module/{name}", module_state[name])

    steps = int(ds.model.get("global_steps", 0))
    group_states = [base["state"][key] for key in sorted(base["state"])]
    step_value = next((s["step"] for s in group_states if "step" in s), None)
    scalar = [{"step": float(step_value)}] if step_value is not None else [{}]
    hyper = []
    for group in base.get("param_groups", []):
        hyper.append({key: list(value) if isinstance(value, tuple) else value
                      for key, value in group.items() if key in _HYPERPARAMETERS})
    scheduler = ds.model.get("lr_scheduler")
    accumulation = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
    samples = int(ds.model.get("global_samples", 0))
    batch = samples // steps if steps else int(ds_config.get("train_batch_size", 0) or 0)
    extra = {
        "global_steps": steps, "micro_steps": steps * accumulation,
        "skipped_steps": int(ds.model.get("skipped_steps", 0)),
        "loss_scaler": _loss_scaler(ds.optim[0]),
        # DeepSpeed's schedulers count last_batch_iteration from -1, torch's last_epoch from 0
        "lr_scheduler": ({"last_epoch": int(scheduler["last_batch_iteration"]) + 1}
                         if isinstance(scheduler, dict) and "last_batch_iteration" in scheduler else None),
        "optimizer": {"param_groups": hyper, "scalar_state": scalar * max(1, len(hyper))},
        "stage": ds.stage, "world_size": ds.world_size,
        "data_position": {"consumed_samples": samples, "train_batch_size": batch},
        "tied_parameters": {alias: first for alias, first in (ds.model.get("shared_params") or {}).items()},
        "imported_from": {"deepspeed_checkpoint": os.path.abspath(tag_dir),
                          "ds_version": str(ds.model.get("ds_version", "")), "ds_config": ds_config},
    }
    json.dumps(extra, allow_nan=True)  # TypeError for anything a manifest cannot hold (caught above)
    return shards, steps, extra, ds
