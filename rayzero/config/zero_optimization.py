"""`zero_optimization`: every field of DeepSpeed's ZeRO config.

Attribute names and defaults follow deepspeed/runtime/zero/config.py (`DeepSpeedZeroConfig`); the
JSON key is the alias where DeepSpeed's differs (`stage3_prefetch_bucket_size` for the attribute
`prefetch_bucket_size`). Both spellings are accepted on input; output uses DeepSpeed's JSON key.
The deprecated keys (`cpu_offload`, ...) are migrated before validation (see migrate.py).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from pydantic import Field, model_validator

from rayzero.config.base import (
    NOT_STAGE3,
    STAGE3_ONLY,
    UNIMPLEMENTED,
    AutoCount,
    AutoPositive,
    Bool,
    ConfigModel,
    Int,
)
from rayzero.config.offload import OffloadOptimizerConfig, OffloadParamConfig

_S3 = {STAGE3_ONLY: True}
_TODO = {UNIMPLEMENTED: True}


class ZeroConfig(ConfigModel):
    """ZeRO: partition optimizer state (stage 1), gradients (2) and parameters (3) across ranks."""

    stage: Int = Field(0, ge=0, le=3)
    """0 disabled (data parallel), 1 optimizer state, 2 + gradients, 3 + parameters are partitioned."""
    contiguous_gradients: Bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: Bool = True
    """Average gradients with reduce-scatter (each rank receives its shard) instead of all-reduce."""
    reduce_bucket_size: AutoPositive = 500_000_000
    """Elements reduced at once (at least 1, as DeepSpeed); "auto" = hidden_size² (needs the model's hidden size)."""
    use_multi_rank_bucket_allreduce: Bool = Field(True, json_schema_extra=_TODO)
    """Combine reduction buckets destined for several ranks into one all-reduce; recognised, not implemented."""
    allgather_partitions: Bool = Field(True, json_schema_extra={NOT_STAGE3: True, **_TODO})
    """Stages 1-2: all-gather updated parameters (True) or broadcast them one rank at a time (False);
    recognised, not implemented: rayzero always all-gathers (same result, one collective per bucket)."""
    allgather_bucket_size: AutoCount = Field(500_000_000, json_schema_extra={NOT_STAGE3: True, **_TODO})
    """Stages 1-2: elements all-gathered at once after the step; recognised, not implemented: rayzero
    all-gathers per reduce bucket (`reduce_bucket_size`)."""
    overlap_comm: Optional[Bool] = None
    """Overlap gradient reduction with the backward pass. Unset: true at stage 3, false below."""
    load_from_fp32_weights: Bool = True
    """On load, initialise fp32 master weights from the checkpoint's fp32 copy (not the 16-bit weights).
    rayzero always does when the checkpoint has them: `false` is warned about and ignored."""
    elastic_checkpoint: Bool = False
    """Allow loading optimizer state saved at another world size (rayzero always reshards)."""
    offload_param: Optional[OffloadParamConfig] = Field(None, json_schema_extra=_S3)
    """Stage 3: offload parameter shards to CPU or NVMe."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Offload optimizer state and the optimizer step to CPU or NVMe (stages 1-3)."""
    zenflow: Optional[dict[str, Any]] = Field(None, json_schema_extra=_TODO)
    """ZenFlow stall-free offload options; recognised, not implemented: refused before training (it
    applies part of each update steps late)."""
    sub_group_size: Int = Field(1_000_000_000, ge=0, json_schema_extra=_S3)
    """Stage 3: elements per optimizer sub-group; with NVMe optimizer offload (any stage) the tile the
    step swaps in and out, which bounds the host memory the step needs."""
    prefetch_bucket_size: AutoCount = Field(
        50_000_000, alias="stage3_prefetch_bucket_size", json_schema_extra=_S3
    )
    """Stage 3: elements of upcoming parameters to prefetch; "auto" = 0.9·hidden_size²."""
    param_persistence_threshold: AutoCount = Field(
        100_000, alias="stage3_param_persistence_threshold", json_schema_extra=_S3
    )
    """Stage 3: parameters smaller than this stay gathered (not partitioned); "auto" = 10·hidden_size."""
    model_persistence_threshold: Int = Field(
        sys.maxsize, ge=0, alias="stage3_model_persistence_threshold", json_schema_extra=_S3
    )
    """Stage 3: cap on the total elements kept persistent by `param_persistence_threshold`."""
    max_live_parameters: Int = Field(
        1_000_000_000, ge=0, alias="stage3_max_live_parameters", json_schema_extra=_S3
    )
    """Stage 3: most gathered parameter elements held at once before releasing."""
    max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, alias="stage3_max_reuse_distance", json_schema_extra=_S3
    )
    """Stage 3: keep a parameter gathered if it is used again within this many elements of fetches."""
    gather_16bit_weights_on_model_save: Bool = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save", json_schema_extra=_S3
    )
    """Stage 3: gather full 16-bit weights into one state dict when saving the model."""
    module_granularity_threshold: Int = Field(
        0, ge=0, alias="stage3_module_granularity_threshold", json_schema_extra={**_S3, **_TODO}
    )
    """Stage 3: fetch small modules' parameters as one leaf to cut hook overhead; recognised, not implemented."""
    use_all_reduce_for_fetch_params: Bool = Field(
        False, alias="stage3_use_all_reduce_for_fetch_params", json_schema_extra={**_S3, **_TODO}
    )
    """Stage 3: gather parameters with all-reduce instead of all-gather; recognised, not implemented."""
    allgather_sequential: Bool = Field(
        False, alias="stage3_allgather_sequential", json_schema_extra={**_S3, **_TODO}
    )
    """Stage 3: all-gather parameters one at a time instead of bucketed; recognised, not implemented."""
    partition_stream_chunk_size: Int = Field(
        0, ge=0, alias="stage3_partition_stream_chunk_size", json_schema_extra={**_S3, **_TODO}
    )
    """Stage 3: partition huge parameters through chunks of this size at init; recognised, not implemented."""
    ignore_unused_parameters: Bool = True
    """Stage 2-3: tolerate parameters that get no gradient in a step instead of failing."""
    legacy_stage1: Bool = Field(False, json_schema_extra=_TODO)
    """DeepSpeed's pre-0.3 stage 1 implementation; recognised, not implemented."""
    round_robin_gradients: Bool = Field(False, json_schema_extra=_TODO)
    """Stage 1-2 with CPU offload: spread gradient copies to CPU across ranks in turn; recognised,
    not implemented."""
    zero_hpz_partition_size: Int = Field(1, ge=0, json_schema_extra=_S3)
    """ZeRO++ hpZ: ranks per secondary weight partition (the ranks of a node, usually). After its forward
    each parameter keeps a 1/K piece over these ranks, so backward gathers it inside the group; 0 or 1 off.
    Must divide the world size without splitting a node."""
    zero_quantized_weights: Bool = Field(False, json_schema_extra=_S3)
    """ZeRO++ qwZ: parameter all-gathers carry int8 blocks and their scales instead of the compute dtype."""
    zero_quantized_nontrainable_weights: Bool = Field(False, json_schema_extra=_S3)
    """ZeRO++: frozen parameters are stored int8-quantized (a quarter of fp32's memory) and gathered so."""
    zero_quantized_gradients: Bool = Field(False, json_schema_extra=_S3)
    """ZeRO++ qgZ: each gradient bucket is reduced by two int4 all-to-alls (inside each node, then across
    nodes) instead of a reduce-scatter."""
    zeropp_loco_param: Optional[dict[str, Any]] = Field(None, json_schema_extra=_TODO)
    """ZeRO++ LoCo error-feedback parameters (`err_beta`, `reset_T`); recognised, not implemented."""
    mics_shard_size: Int = Field(-1, json_schema_extra=_S3)
    """MiCS: shard parameters, gradients and optimizer state within groups of this many consecutive ranks
    and replicate across the groups (-1 off). Must divide the world size without splitting a node.
    (DeepSpeed 0.19 removed MiCS; rayzero keeps DeepSpeed 0.18's meaning.)"""
    mics_hierarchical_params_gather: Bool = Field(False, json_schema_extra=_S3)
    """MiCS: when a shard group spans nodes, gather across nodes first (ranks of the same local index),
    then inside each node."""
    memory_efficient_linear: Bool = Field(True, json_schema_extra=_TODO)
    """Stage 3: DeepSpeed's memory-efficient linear autograd function; recognised, not implemented."""
    pipeline_loading_checkpoint: Bool = Field(False, json_schema_extra=_TODO)
    """Pipelined checkpoint loading for inference; recognised, not implemented."""
    override_module_apply: Bool = Field(True, json_schema_extra=_TODO)
    """Stage 3: gather parameters inside `module.apply`; recognised, not implemented."""
    log_trace_cache_warnings: Bool = Field(False, json_schema_extra=_TODO)
    """Stage 3: log when the recorded module trace is invalidated; recognised, not implemented."""
    enable_sanity_checks: Bool = Field(False, json_schema_extra=_TODO)
    """DeepSpeed's internal debugging checks; recognised, not implemented."""
    save_muon_momentum_buffer_in_memory: Bool = Field(False, json_schema_extra=_TODO)
    """Muon with NVMe offload: keep the momentum buffer in memory; recognised, not implemented."""
    leaf_module: Optional[dict[str, Any]] = Field(None, json_schema_extra=_TODO)
    """Stage 3: modules fetched as one unit (`classes`, `names`, ...); recognised, not implemented."""

    @model_validator(mode="after")
    def _default_overlap_comm(self) -> "ZeroConfig":
        # DeepSpeed's default depends on the stage: overlapping pays off when parameters are
        # partitioned (stage 3) and costs extra buffers below it.
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        return self

    @property
    def offload_param_device(self) -> str:
        """Where parameter shards live (`none`, `cpu` or `nvme`)."""
        return self.offload_param.device.value if self.offload_param else "none"

    @property
    def offload_optimizer_device(self) -> str:
        """Where optimizer state lives (`none`, `cpu` or `nvme`)."""
        return self.offload_optimizer.device.value if self.offload_optimizer else "none"
