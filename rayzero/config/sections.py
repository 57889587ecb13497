"""Top-level sections other than `zero_optimization`: precision, optimizer, scheduler, aio,
activation checkpointing, checkpoint and elasticity.

Attribute names and defaults follow DeepSpeed (runtime/precision_config.py, swap_tensor/aio_config.py,
activation_checkpointing/config.py, checkpoint_engine config, elasticity/config.py).
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal, Optional, Union

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from typing_extensions import Annotated

from rayzero.config.base import (
    UNIMPLEMENTED,
    AutoBool,
    Bool,
    ConfigModel,
    Float,
    Int,
)

_TODO = {UNIMPLEMENTED: True}


def _uri_or_absolute_path(value: str) -> str:
    # Checked by form only: which schemes work depends on the pyarrow build of the node that uploads.
    if not re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://.|/)", value):
        raise ValueError("expected a pyarrow.fs URI such as file:///abs/path, s3://bucket/prefix, "
                         "gs://bucket/prefix or hdfs://host/path (or an absolute local path)")
    return value


class FP16Config(ConfigModel):
    """fp16 mixed precision with a dynamic (or static) loss scale; fp32 master weights always."""

    enabled: AutoBool = False
    """Compute in fp16. "auto" = the trainer's `fp16` argument."""
    auto_cast: Bool = False
    """Cast floating tensors among the forward's positional inputs to fp16 (DeepSpeed's
    `_cast_inputs_half`); without it inputs are passed as given."""
    loss_scale: Float = Field(0.0, ge=0.0)
    """0 = dynamic loss scaling; a positive value = that static loss scale."""
    initial_scale_power: Int = Field(16, ge=0)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Int = Field(1000, ge=1)
    """Steps without overflow before the dynamic loss scale is doubled."""
    hysteresis: Int = Field(2, ge=1)
    """Overflows tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: Float = Field(1.0, gt=0.0)
    """The dynamic loss scale never drops below this."""
    fp16_master_weights_and_grads: Bool = Field(False, json_schema_extra=_TODO)
    """Keep master weights and gradients in fp16 (CPU offload only); recognised, not implemented."""


class BF16Config(ConfigModel):
    """bf16 mixed precision: no loss scale needed; fp32 master weights always."""

    enabled: AutoBool = False
    """Compute in bf16. "auto" = the trainer's `bf16` argument."""
    immediate_grad_update: Bool = Field(False, json_schema_extra=_TODO)
    """Apply gradients to fp32 accumulators as soon as they are produced; recognised, not implemented."""
    check_grad_overflow: Bool = Field(True, json_schema_extra=_TODO)
    """Check bf16 gradients for inf/nan (DeepSpeed 0.19 default true); recognised, not implemented."""
    bf16_master_weights_and_grads: Bool = Field(False, json_schema_extra=_TODO)
    """Keep master weights and gradients in bf16 (ZeRO 1-3); recognised, not implemented: rayzero
    keeps fp32 master weights (more precise, 2 more bytes per parameter per rank's shard)."""
    bf16_optimizer_states: Bool = Field(False, json_schema_extra=_TODO)
    """Keep optimizer states in bf16 (needs bf16_master_weights_and_grads); recognised, not
    implemented: rayzero keeps fp32 optimizer state."""


class AmpConfig(ConfigModel):
    """NVIDIA apex AMP. Recognised but refused when enabled: use `fp16` or `bf16` instead."""

    model_config = ConfigDict(extra="allow")  # the rest are apex.amp.initialize keyword arguments

    enabled: AutoBool = False
    """Use apex AMP. rayzero refuses `true`: apex is unmaintained; `fp16`/`bf16` cover it."""
    opt_level: Optional[str] = None
    """apex optimisation level (O0-O3). "auto" = the trainer's `fp16_opt_level`."""


AUTOCAST_DTYPES = {
    "torch.float16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "torch.bfloat16": "bf16", "bf16": "bf16", "bfloat16": "bf16",
    "torch.float32": "fp32", "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "torch.int8": "int8", "int8": "int8",
}
"""Every spelling DeepSpeed 0.19's `DtypeEnum` accepts for `torch_autocast.dtype` -> its short name."""


def _autocast_dtype(value: Any) -> Any:
    if value not in AUTOCAST_DTYPES:
        raise ValueError(f"expected one of DeepSpeed's dtype names ({', '.join(AUTOCAST_DTYPES)})")
    return value


class TorchAutocastConfig(ConfigModel):
    """DeepSpeed 0.19's torch.autocast mixed precision ([Note: torch_autocast] in
    rayzero/engine/autocast.py): parameters, masters and optimizer state stay as they are (fp32 unless
    bf16/fp16 is enabled too); the forward runs under `torch.autocast(dtype)`, which runs each op in
    the dtype torch's autocast lists give it."""

    enabled: Bool = False
    """Run the forward under torch.autocast."""
    dtype: Annotated[Optional[str], AfterValidator(lambda v: v if v is None else _autocast_dtype(v))] = None
    """The lower precision: "bfloat16" or "float16" (any DeepSpeed dtype name, e.g. "torch.bfloat16",
    "bf16"). Unset = torch.autocast's default for the device (bfloat16 on CPU, float16 on CUDA).
    float16 adds a dynamic loss scale with torch GradScaler's settings (2**16, x2 after 2000 steps
    without overflow, /2 and the step skipped on one)."""
    lower_precision_safe_modules: Optional[list[str]] = None
    """Module classes (import paths, e.g. "torch.nn.Linear") whose parameters' gradients are reduced,
    and at stage 3 gathered, in `dtype` at ZeRO stages 1-3 (the others in their own dtype); an exact
    class match, as DeepSpeed. Unset = torch.nn's Linear, Conv1d, Conv2d, Conv3d."""


class OptimizerConfig(ConfigModel):
    """The optimizer rayzero builds (DeepSpeed's `optimizer` block); its `params` are checked per type."""

    type: str
    """Optimizer name: Adam, AdamW, SGD (built in), or another DeepSpeed/torch.optim name (warned)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer; any may be "auto" (from the trainer's arguments)."""
    legacy_fusion: Bool = Field(False, json_schema_extra=_TODO)
    """DeepSpeed's legacy fused fp16 optimizer; recognised, not implemented."""


class SchedulerConfig(ConfigModel):
    """The learning-rate scheduler (DeepSpeed's `scheduler` block); its `params` are checked per type."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest (DeepSpeed's names)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler, DeepSpeed's names; any may be "auto"."""


class AioConfig(ConfigModel):
    """Asynchronous file I/O used by NVMe offload (thread-pooled reads and writes)."""

    io_backend: str = Field(
        "async_io", pattern="^(async_io|aio|async|deepnvme|posix|sync|simple)$"
    )
    """DeepSpeed's I/O backend name (`async_io` or `posix`, with aliases). rayzero always uses a
    thread pool of positional reads/writes; both names are accepted."""
    block_size: Int = Field(1_048_576, ge=1)
    """Bytes per I/O request."""
    queue_depth: Int = Field(8, ge=1)
    """Requests in flight per thread."""
    intra_op_parallelism: Int = Field(1, ge=1)
    """I/O threads per read or write (`thread_count`, DeepSpeed's legacy name, is accepted)."""
    single_submit: Bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: Bool = True
    """Submit new requests while earlier ones complete."""
    use_gds: Bool = Field(False, json_schema_extra=_TODO)
    """NVIDIA GPUDirect Storage; recognised, not implemented."""


def _false_is_none(value: Any) -> Any:
    # Several published configs write `"number_checkpoints": false` meaning "not set".
    return None if value is False else value


class ActivationCheckpointingConfig(ConfigModel):
    """DeepSpeed's activation-checkpointing options, used by `rayzero.activation_checkpointing.checkpoint`
    (`rayzero.initialize` applies this section when the config has it)."""

    partition_activations: Bool = False
    """Split checkpointed activations across model-parallel ranks; rayzero has no model parallelism
    (size 1), where DeepSpeed's partition is the whole tensor: same behaviour."""
    contiguous_memory_optimization: Bool = Field(False, json_schema_extra=_TODO)
    """Copy partitioned checkpoints into one contiguous buffer (needs partition_activations and
    number_checkpoints, as DeepSpeed); recognised, not implemented (memory layout only)."""
    cpu_checkpointing: Bool = False
    """Keep checkpointed activations (each region's inputs) in CPU memory until the recompute."""
    number_checkpoints: Annotated[Optional[Int], BeforeValidator(_false_is_none)] = None
    """Number of checkpoints, to size the contiguous buffer."""
    synchronize_checkpoint_boundary: Bool = False
    """Synchronise the accelerator before and after each checkpointed region."""
    profile: Bool = False
    """Log the forward time of each checkpointed region."""


def _dtype_name(value: Any) -> Any:
    """A floating dtype as DeepSpeed's DtypeEnum spells it (`AUTOCAST_DTYPES`) -> "fp16" / "bf16" / "fp32"."""
    name = AUTOCAST_DTYPES.get(value) if isinstance(value, str) else None
    if name in (None, "int8"):
        accepted = ", ".join(repr(alias) for alias, short in AUTOCAST_DTYPES.items() if short != "int8")
        raise ValueError(f"{value!r} is not a dtype rayzero knows; use one of {accepted}")
    return name


DtypeName = Annotated[str, BeforeValidator(_dtype_name)]
"""A dtype as DeepSpeed's config spells it, kept as "fp16", "bf16" or "fp32"."""


class DataTypesConfig(ConfigModel):
    """DeepSpeed's `data_types` section."""

    grad_accum_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None
    """dtype gradients accumulate in across micro steps. rayzero accumulates in fp32 at ZeRO stages
    2-3 (each micro step is reduced into the fp32 master gradients); at stages 0-1 in the compute
    dtype, or in fp32 when this says "fp32" (DeepSpeed's BF16_Optimizer); a different request is
    warned about."""
    param_dtype: Optional[DtypeName] = None
    """dtype the model's parameters compute in: the fp16/bf16 mode's; another value is an error
    (DeepSpeed asserts the same)."""
    buffer_dtype: Optional[DtypeName] = None
    """dtype floating buffers are cast to. None (DeepSpeed 0.19.8's default): each keeps the dtype it
    was built or loaded in (a rotary `inv_freq` stays fp32 under bf16) ([Note: buffers keep their dtype])."""
    keep_in_fp32_modules: Union[Literal["auto"], list[str], None] = None
    """Buffers kept in (or put back to) fp32 under fp16/bf16: "auto" (or unset) takes the names a transformers
    model lists (`_keep_in_fp32_modules_strict`, and `_keep_in_fp32_modules` under fp16), a list
    gives name patterns (`*` for any characters, matched anywhere in the buffer's full name), []
    keeps none. As DeepSpeed 0.19.8's `data_types.keep_in_fp32_modules`."""


class TagValidation(str, Enum):
    """What to do when ranks disagree on a checkpoint tag."""

    Ignore = "Ignore"
    Warn = "Warn"
    Fail = "Fail"


def _checkpoint_interval(value: Any) -> str | float | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(f"{value!r}: give \"auto\" (rayzero chooses), a number of seconds > 0, or null (the loop saves)")


class CheckpointConfig(ConfigModel):
    """Where and how checkpoints are written."""

    tag_validation: TagValidation = TagValidation.Warn
    """Check that every rank saves under the same tag: Ignore, Warn or Fail."""
    load_universal: Bool = False
    """Load a DeepSpeed universal checkpoint; rayzero checkpoints reshard on load anyway."""
    use_node_local_storage: Bool = False
    """Every node writes its ranks' shards to its own local disk (no shared filesystem needed)."""
    parallel_write: Optional[dict[str, Any]] = Field(None, json_schema_extra=_TODO)
    """Pipeline-stage parallel writes (`pipeline_stage`); recognised, not implemented."""
    writer: Optional[dict[str, Any]] = Field(None, json_schema_extra=_TODO)
    """DeepSpeed's FastPersist writer options; recognised, not implemented."""
    # rayzero's checkpoint tiers (not DeepSpeed keys). Each has an environment override read by
    # rayzero.checkpoint.options (environment > config > default), e.g. for a Ray worker or a pod.
    replicas: Int = Field(1, ge=0)
    """With `use_node_local_storage`: how many other nodes keep a copy of each node's shards (1
    survives one lost node with no shared filesystem; 0 keeps no copy). Env override
    `RAYZERO_CHECKPOINT_REPLICAS`."""
    durable_uri: Annotated[str, AfterValidator(_uri_or_absolute_path)] | None = None
    """pyarrow.fs URI (file:///abs/path, s3://bucket/prefix, gs://..., hdfs://...) receiving a
    background copy of every committed checkpoint; null = none. Env override `RAYZERO_DURABLE_URI`."""
    keep_last: Int = Field(3, ge=0)
    """Committed checkpoints of the run kept per storage location and in the durable copy, counted
    across the run's invocations (older ones of the run are deleted after each commit; nothing
    another run or a user wrote is); 0 keeps every checkpoint. Env override `RAYZERO_CHECKPOINT_KEEP_LAST`."""
    async_save: Bool = True
    """Write, replicate and upload in the background: `save_checkpoint` blocks only to snapshot the
    state; false returns with the checkpoint committed on local disk. Env override
    `RAYZERO_CHECKPOINT_ASYNC_SAVE` (true/false)."""
    upload_threads: Int = Field(8, ge=1)
    """Threads copying files to `durable_uri` in parallel. Env override
    `RAYZERO_CHECKPOINT_UPLOAD_THREADS`."""
    timeout_s: Float = Field(1800.0, gt=0)
    """Seconds a checkpoint collective waits for the slowest rank (a barrier waits for its whole
    shard write and replicas). Env override `RAYZERO_CHECKPOINT_TIMEOUT_S`."""
    interval: Annotated[Union[str, float, None], BeforeValidator(_checkpoint_interval)] = None
    """When rayzero itself checkpoints a running `rayzero.fit` / `rayzero run`, at the next step
    boundary every rank reaches (as `rayzero checkpoint now` does): null (default) leaves it to the
    loop; a number of seconds between checkpoints; "auto" chooses it from the numbers, Young/Daly's
    sqrt(2 x C x M) with C the measured save stall (a moving average; 5 s until one is measured) and
    M the mean time between failures, from the larger of two failure rates over the n failures the
    run has seen in its W seconds of wall time (all its calls, a killed driver counting as one): the
    fleet prior below updated with the run's count, (1 + n) / (M0 + W), and the run's own record,
    (n + 1/2) / W. So a run that fails often is believed after its first failure (the prior cannot
    outweigh it), and before any failure the interval is at most 2 sqrt(C x W): the first checkpoint
    comes once the run has been up about 4C, and the interval grows with the square root of its age
    until W passes M0, when the fleet's rate governs ([Note: a checkpoint interval from the numbers]
    in rayzero/controller/interval.py says why). The loop's own saves go on as they are. `rayzero
    status` shows the interval in use and its inputs."""
    failures_per_node_day: Float = Field(419 / (54 * 2048), gt=0)
    """The prior failure rate for `interval: "auto"`, per node and day: Llama 3's 419 unexpected
    interruptions over 54 days on 2,048 nodes by default. M0 = 1 / (nodes x rate), worth one failure:
    it governs a run that has been up longer than M0 with no more failures than the fleet's."""


class ElasticityConfig(ConfigModel):
    """DeepSpeed elasticity: batch sizes that stay valid as the GPU count changes."""

    enabled: Bool = False
    """DeepSpeed's elastic batch computation (its v0.1/v0.2 algorithm; DeepSpeed 0.19 removed it and
    refuses `true`): rayzero's controller picks the global batch and micro batch per world size from
    this block when a run resizes (rayzero/controller/elastic.py)."""
    max_train_batch_size: Int = Field(2000, ge=1)
    """Largest acceptable global batch."""
    micro_batch_sizes: list[Int] = Field(default_factory=lambda: [2, 4, 6])
    """Acceptable micro-batch sizes per GPU."""
    min_gpus: Int = Field(1, ge=1)
    """Fewest GPUs to plan for."""
    max_gpus: Int = Field(10_000, ge=1)
    """Most GPUs to plan for."""
    min_time: Int = Field(0, ge=0)
    """Minimum minutes between scaling decisions."""
    version: Float = 0.2
    """Elasticity algorithm version."""
    ignore_non_elastic_batch_info: Bool = False
    """Ignore the top-level batch keys when elasticity is enabled."""
    prefer_larger_batch: Bool = True
    """Prefer the larger of two equally valid global batches."""
    num_gpus_per_node: Int = Field(1, ge=1)
    """GPUs per node (version 0.2)."""
    model_parallel_size: Int = Field(1, ge=1)
    """Model-parallel degree (version 0.2)."""
