"""Cross-field rules: what no single field can check on its own.

Errors go to `problems` (the load fails), warnings to `notes` (the load succeeds and says what it
ignored). Rules read the validated model, so values are already normalised.
"""
from __future__ import annotations

from typing import Any, Iterator

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rayzero.config.base import NOT_STAGE3, REMOVED, STAGE3_ONLY, UNIMPLEMENTED
from rayzero.config.convert import to_problem
from rayzero.config.errors import Problem, as_json, nearest
from rayzero.config.model import RayZeroConfig
from rayzero.config.params import OPTIMIZER_PARAMS, RECOGNISED_OPTIMIZERS, SCHEDULER_PARAMS
from rayzero.config.sections import AUTOCAST_DTYPES
from rayzero.config.unimplemented import tensor_parallel_degree

_ZERO = "zero_optimization"


def check_rules(config: RayZeroConfig, notes: list[str], problems: list[Problem]) -> None:
    """Append every cross-field error to `problems` and every warning to `notes`.
    Precision rules run later (`check_resolved`): "auto" may decide fp16, bf16 and amp."""
    _offload(config, notes, problems)
    _removed(config, notes, problems)
    _flagged_fields(config, notes)
    zero = config.zero_optimization
    if zero.stage == 0 and "overlap_comm" in zero.model_fields_set:
        notes.append(f"ignored: `{_ZERO}.overlap_comm` = {str(zero.overlap_comm).lower()} at ZeRO stage 0: stage 0 "
                     "all-reduces each bucket as soon as backward fills it (like DDP), whatever this key says")
    if config.zero_optimization.load_from_fp32_weights is False:
        notes.append(f"ignored: `{_ZERO}.load_from_fp32_weights` = false: rayzero always restores fp32 master "
                     "weights from the checkpoint's fp32 copy when it has one (rebuilding them from 16-bit "
                     "weights would lose precision)")
    if config.gradient_allreduce_op == "sum" and zero.stage == 3:
        problems.append(Problem("gradient_allreduce_op", "sum", "summed gradients are not supported with ZeRO "
                                "stage 3 (DeepSpeed refuses this too)", 'use "mean", or ZeRO stage 0-2'))
    _optimizer(config, notes, problems)
    _scheduler(config, problems)
    autocast = config.torch_autocast
    if autocast is not None and autocast.enabled and AUTOCAST_DTYPES.get(autocast.dtype) == "fp32":
        notes.append("ignored: `torch_autocast` with dtype float32: torch.autocast computes only in bfloat16 or "
                     "float16 and turns itself off for float32, so the forward runs in the parameters' dtype")


def check_resolved(config: RayZeroConfig, problems: list[Problem], notes: list[str] | None = None) -> None:
    """Rules that need "auto" values resolved first."""
    _precision(config, problems)
    _param_dtype(config, problems)
    if notes is not None:
        _grad_accum_dtype(config, notes)


def _grad_accum_dtype(config: RayZeroConfig, notes: list[str]) -> None:
    asked = config.data_types.grad_accum_dtype
    if asked is None or isinstance(config.fp16.enabled, str) or isinstance(config.bf16.enabled, str):
        return
    stage = config.zero_optimization.stage
    # stages 2-3 reduce each micro step into fp32 master gradients; stages 0-1 accumulate in the
    # compute dtype, or in fp32 when asked ([Note: fp32 gradient accumulation] in rayzero/engine/bucketed/strategy.py)
    done = "fp32" if stage >= 2 or asked == "fp32" else config.compute_dtype
    if asked != done:
        notes.append(f"ignored: `data_types.grad_accum_dtype` = {asked!r}: at ZeRO stage {stage} with "
                     f"{config.compute_dtype} compute rayzero accumulates gradients in {done} "
                     + ("(each micro step is reduced into the fp32 master gradients)" if stage >= 2 else
                        "(stages 0-1 accumulate in the compute dtype, or in fp32 when asked)"))


def _param_dtype(config: RayZeroConfig, problems: list[Problem]) -> None:
    asked = config.data_types.param_dtype
    if asked is None or isinstance(config.fp16.enabled, str) or isinstance(config.bf16.enabled, str):
        return
    if asked != config.compute_dtype:
        problems.append(Problem(
            "data_types.param_dtype", asked, f"the model computes in {config.compute_dtype} "
            "(the fp16 / bf16 sections decide it; DeepSpeed refuses a different param_dtype too)",
            f'leave data_types.param_dtype out, or enable the matching precision: "{asked}": {{"enabled": true}}'
            if asked != "fp32" else "leave data_types.param_dtype out, or disable fp16 and bf16"))


def _precision(config: RayZeroConfig, problems: list[Problem]) -> None:
    if config.amp is not None and config.amp.enabled is True:
        problems.append(Problem(
            "amp.enabled", True, "NVIDIA apex AMP is not supported by rayzero",
            'use "fp16": {"enabled": true} (same dynamic loss scaling) or "bf16": {"enabled": true}, '
            "and remove the amp section"))
    if config.fp16.enabled is True and config.bf16.enabled is True:
        problems.append(Problem(
            "fp16.enabled", True, "fp16 and bf16 cannot both be enabled (bf16.enabled is true too)",
            "set one of fp16.enabled / bf16.enabled to false"))


def _offload(config: RayZeroConfig, notes: list[str], problems: list[Problem]) -> None:
    zero = config.zero_optimization
    # DeepSpeed reads offload_param and the partial-offload ratio at stage 3 only and ignores them
    # below it: warn and drop them, so nothing downstream acts on a setting DeepSpeed ignores.
    if zero.offload_param is not None and zero.stage != 3:
        if zero.offload_param_device != "none":
            notes.append(f"ignored: `{_ZERO}.offload_param` (device {zero.offload_param_device!r}) only applies to "
                         f"ZeRO stage 3 (stage is {zero.stage}): parameters stay where they are. Set "
                         f'"{_ZERO}.stage": 3 to offload them, or remove offload_param')
        zero.offload_param = None
    optimizer = zero.offload_optimizer
    if optimizer is not None and optimizer.ratio < 1.0:
        # DeepSpeed 0.19.8 refuses it below stage 3 (zero/config.py offload_ratio_check: "Partial
        # offloading only supported for ZeRO Stage 3"); offloading everything instead would hold
        # more in host memory than the run was sized for, so it is refused here too.
        if zero.stage != 3:
            problems.append(Problem(
                f"{_ZERO}.offload_optimizer.ratio", optimizer.ratio,
                f"partial optimizer offload (ratio < 1) works at ZeRO stage 3 only (stage is {zero.stage}); "
                "DeepSpeed refuses it too",
                f'set ratio to 1.0 (offload all optimizer state), or "{_ZERO}.stage": 3'))
        elif optimizer.device.value == "nvme":
            problems.append(Problem(
                f"{_ZERO}.offload_optimizer.ratio", optimizer.ratio,
                "partial optimizer offload (ratio < 1) works with device \"cpu\" only",
                'set ratio to 1.0, or use "device": "cpu"'))
    for name in ("offload_param", "offload_optimizer"):
        section = getattr(zero, name)
        if section is not None and section.device.value == "nvme" and not section.nvme_path:
            problems.append(Problem(
                f"{_ZERO}.{name}.nvme_path", None, 'device "nvme" needs a directory for the swap files',
                f'add "nvme_path": "/local_nvme" (a directory on a fast local NVMe drive) to {_ZERO}.{name}'))


def _enabled(section: Any) -> bool:
    """Whether a removed feature's leftover section turns it on: `true`, `enabled: true` anywhere
    inside, or a non-empty block with no `enabled` key at all (sparse_attention is on by presence)."""
    def any_enabled(node: Any) -> bool | None:
        if isinstance(node, dict):
            found = None
            for key, value in node.items():
                if key == "enabled":
                    flag = value is True or (isinstance(value, str) and value.lower() == "true")
                    found = bool(found) or flag
                else:
                    inner = any_enabled(value)
                    if inner is not None:
                        found = bool(found) or inner
            return found
        return None
    if isinstance(section, bool):
        return section
    flag = any_enabled(section)
    return bool(section) if flag is None else flag


def _removed(config: RayZeroConfig, notes: list[str], problems: list[Problem]) -> None:
    """DeepSpeed 0.19 removed these training features and refuses their keys: an enabled one would
    change the math, so it is refused here too; a disabled leftover is only noted."""
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        what = extra.get(REMOVED)
        value = getattr(config, name)
        if not what or value is None:
            continue
        if _enabled(value):
            problems.append(Problem(name, value, f"{what} was removed in DeepSpeed 0.19 and rayzero does not "
                                    "implement it: training would silently differ from what this section asks",
                                    f"remove `{name}` (train without it)"))
        else:
            notes.append(f"ignored: `{name}` is disabled; {what} was removed in DeepSpeed 0.19 (which refuses the "
                         "key): remove it")
    # `elasticity` is a deliberate difference: DeepSpeed 0.19 refuses `enabled: true` (it removed
    # elastic training); rayzero's controller honours the block (rayzero/controller/elastic.py).


def _walk(model: BaseModel, path: str) -> Iterator[tuple[str, FieldInfo, Any]]:
    """(JSON key path, field info, value) for every field, depth first."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = f"{path}.{field.alias or name}" if path else (field.alias or name)
        yield key, field, value
        if isinstance(value, BaseModel):
            yield from _walk(value, key)


def _is_default(field: FieldInfo, value: Any) -> bool:
    default = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel) and isinstance(default, BaseModel):
        return value == default
    return value == default or (value is None and default is None)


def _flagged_fields(config: RayZeroConfig, notes: list[str]) -> None:
    stage = config.zero_optimization.stage
    for key, field, value in _walk(config, ""):
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if not extra or _is_default(field, value):
            continue
        # a key that does not apply at stage 3 gets that note below, not a second one
        if extra.get(UNIMPLEMENTED) and not _asks_nothing(key, value) and not (extra.get(NOT_STAGE3) and stage == 3):
            notes.append(f"recognised but not implemented: `{key}` = {_short(value)} is accepted and ignored")
        # offload_param below stage 3 gets its own note and ratio below stage 3 is an error (see _offload).
        # NVMe optimizer offload tiles its swap by sub_group_size at every stage ([Note: NVMe tiles]).
        nvme_tiles = key == "zero_optimization.sub_group_size" and \
            config.zero_optimization.offload_optimizer_device == "nvme"
        if extra.get(STAGE3_ONLY) and stage < 3 and not key.endswith(("offload_param", ".ratio")) and not nvme_tiles:
            notes.append(f"ignored: `{key}` = {_short(value)} only applies to ZeRO stage 3 (stage is {stage})")
        if extra.get(NOT_STAGE3) and stage == 3:
            notes.append(f"ignored: `{key}` = {_short(value)} does not apply to ZeRO stage 3 "
                         "(stage 3 gathers parameters with stage3_prefetch_bucket_size)")


_NOTHING_ASKED: dict[str, tuple[Any, ...]] = {
    "prescale_gradients": (False,), "gradient_predivide_factor": (1.0,), "memory_breakdown": (False,),
    "dump_state": (False,), "dataloader_drop_last": (False,), "disable_allgather": (False,),
    "use_data_before_expert_parallelism": (False,), "sequence_parallel_size": (1,),
    "zero_force_ds_cpu_optimizer": (True, False),  # rayzero's CPU step takes any optimizer either way
}
"""Values of recognised, unimplemented keys that ask DeepSpeed for nothing (its defaults, mostly):
written out by many real configs, they need no warning."""


def _asks_nothing(key: str, value: Any) -> bool:
    """Whether a recognised but unimplemented key's value leaves DeepSpeed doing what rayzero does:
    a listed value, a section with `"enabled": false`, or AutoTP of degree 1."""
    if isinstance(value, dict):
        if "enabled" in value:
            return str(value["enabled"]).lower() == "false"
        if key == "tensor_parallel":
            return tensor_parallel_degree(value) == 1
        return False
    # booleans by identity (1 is not `true` here), numbers by value (1 is 1.0)
    return any(value is nothing if isinstance(value, bool) or isinstance(nothing, bool) else value == nothing
               for nothing in _NOTHING_ASKED.get(key, ()))


def _short(value: Any) -> str:
    text = repr(value.value if hasattr(value, "value") else value)
    if isinstance(value, BaseModel):
        text = str(value.model_dump(mode="json", by_alias=True, exclude_defaults=True))
    return text if len(text) <= 60 else text[:57] + "..."


def _check_params(section: Any, model: type[BaseModel], path: str, problems: list[Problem]) -> None:
    """Validate `section.params` against `model`; on success store the normalised params."""
    try:
        parsed = model.model_validate(section.params)
    except ValidationError as error:
        problems.extend(to_problem(item, model, (path, "params")) for item in error.errors(include_url=False))
        return
    section.params = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _optimizer(config: RayZeroConfig, notes: list[str], problems: list[Problem]) -> None:
    if config.optimizer is None:
        return
    name = config.optimizer.type
    if "max_grad_norm" in config.optimizer.params:
        # DeepSpeed 0.19's engine refuses this key for every optimizer type it builds from the config
        # (runtime/engine.py, _configure_basic_optimizer); its config parser does not look at params.
        # With a client optimizer DeepSpeed ignores the section, which rayzero refuses (both given).
        clipping = as_json(config.gradient_clipping)
        problems.append(Problem(
            "optimizer.params.max_grad_norm", config.optimizer.params["max_grad_norm"],
            "not an optimizer parameter: gradient clipping is the top-level `gradient_clipping` "
            "(DeepSpeed refuses this key too when it builds the optimizer)",
            f"remove it; `gradient_clipping` is {clipping} here"))
        config.optimizer.params = {k: v for k, v in config.optimizer.params.items() if k != "max_grad_norm"}
    model = OPTIMIZER_PARAMS.get(name.lower())
    if model is not None:
        _check_params(config.optimizer, model, "optimizer", problems)
    elif name.lower() in RECOGNISED_OPTIMIZERS:
        pass  # valid DeepSpeed; whether this build can run it is rayzero.config.runnable's call
    else:
        known = ["Adam", "AdamW", "SGD", *sorted(RECOGNISED_OPTIMIZERS)]
        guess = nearest(name.lower(), [k.lower() for k in known])
        fix = (f"did you mean {next(k for k in known if k.lower() == guess)!r}?" if guess
               else "use Adam, AdamW or SGD, or pass an optimizer object to rayzero.initialize")
        problems.append(Problem("optimizer.type", name, "unknown optimizer", fix))


def _scheduler(config: RayZeroConfig, problems: list[Problem]) -> None:
    if config.scheduler is None:
        return
    name = config.scheduler.type
    model = SCHEDULER_PARAMS.get(name)
    if model is None:
        guess = nearest(name, list(SCHEDULER_PARAMS))
        fix = f"did you mean {guess!r}?" if guess else f"use one of: {', '.join(SCHEDULER_PARAMS)}"
        problems.append(Problem("scheduler.type", name, "unknown scheduler", fix))
        return
    _check_params(config.scheduler, model, "scheduler", problems)
