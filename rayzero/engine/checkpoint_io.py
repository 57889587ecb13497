"""The engine's checkpoint methods: DeepSpeed's signatures over the checkpoint layer.

`ZeroEngine.save_checkpoint / load_checkpoint / save_16bit_model` delegate here. The engine
describes its state as flat ranges (`state_shards()`, [Note: flat-range partitioning]); the
checkpoint layer writes and reshards them; this module adds what only the engine knows: the
default tag, which tensors to skip for `load_optimizer_states=False` / `load_module_only=True`, the
data position ([Note: data position]) and the 16-bit export.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
import weakref
from typing import Any

import torch

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.loader import NoCheckpointError
from rayzero.checkpoint.options import CheckpointOptions, config_digest
from rayzero.checkpoint.saver import SaveTimings
from rayzero.checkpoint.types import LazyPiece, ShardSpec
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.optim_state import ensure_optimizer_state

logger = logging.getLogger(__name__)


def checkpointer_of(engine: Any) -> Checkpointer:
    """The engine's Checkpointer, built from its config's `checkpoint` section on first use."""
    if getattr(engine, "checkpointer", None) is None:
        checkpointer = Checkpointer(CheckpointOptions.from_config(engine.config))
        # Every update of the saved state goes through the optimizer step (the engine publishes
        # compute weights from the masters after it), so one pre-hook is the snapshot fence.
        engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: checkpointer.fence())
        checkpointer.use_fence()
        engine.checkpointer = checkpointer
        # [Note: async save completion]: a loop that returns without wait_for_checkpoint() still
        # commits its last save, once its engine is released or the interpreter exits. The callback
        # holds the checkpointer, never the engine (that would keep the engine alive forever).
        weakref.finalize(engine, checkpointer.complete_pending, "the engine was released")
    return engine.checkpointer


def _global_batch_size(engine: Any) -> int:
    configured = getattr(engine.config, "train_batch_size", None)
    if isinstance(configured, int):
        return configured
    micro = engine.step_policy.micro_batch_size or 1
    return micro * engine.step_policy.gradient_accumulation_steps * engine.comm.world_size


def _json_able(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as error:
        raise RayZeroValueError(f"{what} must be JSON-serialisable (a checkpoint never stores pickles, so loading "
                         f"it cannot run code): {error}. Convert tensors with .tolist() or save them "
                         "as part of the model") from error


def save_checkpoint(engine: Any, save_dir: str | None = None, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False, asynchronous: bool | None = None) -> bool:
    """Save a sharded checkpoint to save_dir/tag (default `global_step{N}`); collective.

    With `checkpoint.async_save` (default) this returns once the state is snapshotted; the files
    are written, replicated and uploaded in the background. `save_latest` is always honoured as
    True: `latest` only ever names a committed checkpoint ([Note: commit protocol]).
    """
    offload = engine.strategy.offload
    if offload.streams_checkpoints:  # NVMe state is read piece by piece as it is written ([Note: streamed save])
        return _save_checkpoint(engine, save_dir, tag, client_state, exclude_frozen_parameters, asynchronous)
    with offload.resident(engine.optimizer):
        return _save_checkpoint(engine, save_dir, tag, client_state, exclude_frozen_parameters, asynchronous)


def _save_checkpoint(engine: Any, save_dir: str | None, tag: str | None, client_state: dict[str, Any] | None,
                     exclude_frozen_parameters: bool, asynchronous: bool | None) -> bool:
    checkpointer = checkpointer_of(engine)
    tag = tag or f"global_step{engine.global_steps}"
    shards = engine.state_shards()
    if exclude_frozen_parameters:
        trainable = {f"module/{name}" for name, param in engine.module.named_parameters() if param.requires_grad}
        buffers = {f"module/{name}" for name, _ in engine.module.named_buffers()}
        shards = [s for s in shards if not s.spec.name.startswith("module/") or s.spec.name in trainable | buffers]
    extra = engine.extra_state()
    batch = _global_batch_size(engine)
    extra["data_position"] = {"consumed_samples": engine.global_steps * batch, "train_batch_size": batch}
    # shards hold a tied weight once, under its first name; consolidate writes the other names too
    extra["tied_parameters"] = _tied_aliases(engine.module)
    hf_config = _hf_config(engine.module)
    if hf_config is not None:  # `rayzero checkpoint consolidate --hf` writes it as config.json
        extra["hf_config"] = hf_config
    checkpointer.save(save_dir, tag, engine.global_steps, engine.strategy.stage, shards, extra,
                      _json_able(client_state, "client_state"), config_digest(engine.config), asynchronous)
    return True


def wait_for_checkpoint(engine: Any) -> SaveTimings:
    """Block until the background save (if any) is committed and uploaded; its phase timings.
    Idempotent: call it from every exit path (`close()`, after the loop); a failed save raises once."""
    if getattr(engine, "checkpointer", None) is None:  # never saved: nothing to wait for, no group to build
        return SaveTimings()
    return engine.checkpointer.wait()


def load_checkpoint(engine: Any, load_dir: str | None = None, tag: str | None = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
    """Resume from the newest checkpoint complete in some tier (or `tag`), at this engine's world
    size and stage; returns (checkpoint path, client_state), or (None, None) when there is none."""
    if custom_load_fn is not None:
        raise RayZeroValueError("load_checkpoint(custom_load_fn=...) is not supported: rayzero reshards the "
                         "checkpoint itself; load the state you need with engine.load_state_shards")
    with engine.strategy.offload.resident(engine.optimizer):  # NVMe-swapped state loads in memory
        return _load_checkpoint(engine, load_dir, tag, load_module_strict, load_optimizer_states,
                                load_lr_scheduler_states, load_module_only)


def _load_checkpoint(engine: Any, load_dir: str | None, tag: str | None, load_module_strict: bool,
                     load_optimizer_states: bool, load_lr_scheduler_states: bool,
                     load_module_only: bool) -> tuple[str | None, dict[str, Any] | None]:
    checkpointer = checkpointer_of(engine)
    # A fresh optimizer has no state yet; create it (zeros) so the specs list every optim/ range.
    ensure_optimizer_state(engine.optimizer)
    current = {shard.spec.name: shard for shard in engine.state_shards()}
    keep_optimizer = load_module_only or not load_optimizer_states
    needed = [shard.spec for name, shard in current.items()
              if not (keep_optimizer and name.startswith("optim/")) and not (load_module_only and name.startswith("master/"))]
    try:
        # the live state's own views: files stream straight into place (bounded memory, no copy)
        # (a piece that lives on NVMe, a LazyPiece, is read into memory and written back instead)
        destinations = {spec.name: current[spec.name].local for spec in needed
                        if isinstance(current[spec.name].local, torch.Tensor)}
        loaded = checkpointer.load(load_dir, needed, tag=tag, restore_rng=not load_module_only,
                                   destinations=destinations)
    except NoCheckpointError as error:
        warnings.warn(f"load_checkpoint found nothing to load: {error}", stacklevel=2)
        return None, None

    def read(spec: ShardSpec) -> torch.Tensor:
        if spec.name.startswith("optim/") and keep_optimizer:  # unchanged
            if spec.name in current:
                return current[spec.name].local.detach().clone()
            return torch.zeros(spec.flat_end - spec.flat_start, dtype=spec.dtype)  # created empty by the engine
        if spec.name.startswith("master/") and (load_module_only or not loaded.has(spec.name)):
            raise KeyError(spec.name)  # the engine rebuilds masters from the loaded module weights
        if not loaded.has(spec.name) and spec.name.startswith("module/") and not load_module_strict:
            return current[spec.name].local.detach().clone()
        return loaded.read(spec)

    engine.load_state_shards(read)
    manifest = loaded.manifest
    if not load_module_only:
        extra = dict(manifest.extra_state)
        if not load_lr_scheduler_states:
            extra["lr_scheduler"] = None
        if not load_optimizer_states:
            extra.pop("optimizer", None)
        engine.load_extra_state(extra)
        _restore_data_position(engine, extra.get("data_position"))
    loaded.release()
    logger.info("loaded checkpoint %s (saved at world size %d, stage %d; now %d, stage %d; source %s)",
                loaded.path, manifest.world_size, manifest.stage, engine.comm.world_size,
                engine.strategy.stage, loaded.source)
    return loaded.path, dict(manifest.client_state)


def _restore_data_position(engine: Any, position: dict[str, Any] | None) -> None:
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    if position is None or not hasattr(sampler, "set_position"):
        return
    if position.get("train_batch_size") != sampler.global_batch_size:
        warnings.warn(f"the checkpoint was taken with global batch {position.get('train_batch_size')}, the "
                      f"sampler now uses {sampler.global_batch_size}: the data position is kept in samples, "
                      "so step boundaries shift", stacklevel=3)
    sampler.set_position(position["consumed_samples"])


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Write the full module state dict in its compute dtype on rank 0 (DeepSpeed's shape).

    Stage 3 holds only pieces of each weight, so it writes only when
    `zero_optimization.stage3_gather_16bit_weights_on_model_save` is true (else warns and returns
    False, as DeepSpeed does). `.safetensors` file names write safetensors, others a plain tensor
    dict loadable with `torch.load(weights_only=True)`. Weights are gathered one tensor at a time.
    """
    shards = [s for s in engine.state_shards() if s.spec.name.startswith("module/")]
    partitioned = any(not s.spec.is_full for s in shards)
    if partitioned and not getattr(engine.config.zero_optimization, "gather_16bit_weights_on_model_save", False):
        warnings.warn("save_16bit_model did nothing: the weights are partitioned (stage 3) and "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save is false; set it to true, "
                      "or use `rayzero checkpoint consolidate` on a checkpoint", stacklevel=2)
        return False
    comm = checkpointer_of(engine).comm
    comm.barrier() if comm.group is not None else None
    frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad}
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        name = shard.spec.name.removeprefix("module/")
        if exclude_frozen_parameters and name in frozen:
            continue
        # a shard swapped to NVMe (offload_param) is read now, one at a time
        mine = shard.local.materialize() if isinstance(shard.local, LazyPiece) else shard.local.detach().cpu()
        if shard.spec.is_full or comm.group is None:
            local = mine
        else:  # assemble this tensor's pieces on every rank (one tensor in memory at a time)
            pieces = comm.all_gather_object((shard.spec.flat_start, shard.spec.flat_end, mine))
            local = torch.empty(shard.spec.global_numel, dtype=shard.spec.dtype)
            for start, end, piece in pieces:
                local[start:end] = piece
        if comm.rank == 0:
            state[name] = local.reshape(shard.spec.global_shape).clone()
    if comm.rank == 0:
        aliases = _tied_aliases(engine.module)
        for alias, first in aliases.items():
            if first in state:
                state[alias] = state[first]
        os.makedirs(save_dir, exist_ok=True)
        if hasattr(getattr(engine.module, "config", None), "save_pretrained"):
            engine.module.config.save_pretrained(save_dir)  # config.json: from_pretrained(save_dir) loads it
        path = os.path.join(save_dir, save_filename)
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file({name: tensor.contiguous() for name, tensor in state.items() if name not in aliases}, path)
        else:
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
    comm.barrier() if comm.group is not None else None
    return True


def _hf_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config as JSON-able data (None for other models)."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return json.loads(to_json()) if callable(to_json) else None


def _tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Later names of tied parameters -> the first name (the one the shards use)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


__all__ = ["load_checkpoint", "save_16bit_model", "save_checkpoint", "wait_for_checkpoint"]
