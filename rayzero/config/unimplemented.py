"""Top-level DeepSpeed keys rayzero recognises but does not implement (the features DeepSpeed 0.19
removed are in removed.py).

Recognised keys are accepted (so a DeepSpeed file loads unchanged) and each one present produces a
warning naming it, unless its value asks DeepSpeed for nothing (rules.py); none of them changes what
rayzero does. Those whose absence would train something else (tensor and sequence parallelism of
degree > 1) are refused before training instead ([Note: valid vs runnable] in runnable.py).
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from rayzero.config.base import UNIMPLEMENTED, Bool, ConfigModel, Int

_TODO = {UNIMPLEMENTED: True}


def _todo() -> Any:
    return Field(None, json_schema_extra=_TODO)


class CompileConfig(ConfigModel):
    """DeepSpeed's `compile` section (DeepCompile), with DeepSpeed 0.19's keys; recognised, not implemented.
    It does not take torch.compile's arguments (`backend`, `disable`): DeepSpeed refuses those here."""

    deepcompile: Bool = Field(False, json_schema_extra=_TODO)
    """Compile the model with DeepSpeed's ZeRO-aware compiler passes."""
    autoep_non_moe: Bool = Field(False, json_schema_extra=_TODO)
    """DeepCompile for the non-MoE part of an AutoEP model."""
    free_activation: Bool = Field(False, json_schema_extra=_TODO)
    """Free activations early."""
    free_activation_threshold: Int = Field(10 * 1024 * 1024, json_schema_extra=_TODO)
    """Smallest activation (bytes) freed early."""
    offload_activation: Bool = Field(False, json_schema_extra=_TODO)
    """Offload activations to the host between forward and backward."""
    offload_activation_pin_memory: Bool = Field(True, json_schema_extra=_TODO)
    """Pin the host buffers of offloaded activations."""
    offload_opt_states: Bool = Field(False, json_schema_extra=_TODO)
    """Offload optimizer states during forward/backward."""
    double_buffer: Bool = Field(True, json_schema_extra=_TODO)
    """Double-buffer offloaded optimizer states."""
    symmetric_memory: Bool = Field(False, json_schema_extra=_TODO)
    """Use symmetric memory for collectives."""
    debug_log: Bool = Field(False, json_schema_extra=_TODO)
    """Log the compiler passes."""
    offload_parameters: Bool = Field(False, json_schema_extra=_TODO)
    """Offload parameters during forward/backward."""
    sync_before_reduce: Bool = Field(False, json_schema_extra=_TODO)
    """Synchronise the device before each reduce."""
    sync_after_reduce: Bool = Field(False, json_schema_extra=_TODO)
    """Synchronise the device after each reduce."""
    sync_before_allgather: Bool = Field(False, json_schema_extra=_TODO)
    """Synchronise the device before each all-gather."""
    sync_after_allgather: Bool = Field(False, json_schema_extra=_TODO)
    """Synchronise the device after each all-gather."""
    keep_int_input_tensors: Bool = Field(True, json_schema_extra=_TODO)
    """Keep integer input tensors alive."""
    keep_all_input_tensors: Bool = Field(False, json_schema_extra=_TODO)
    """Keep every input tensor alive."""
    passes: Optional[list[str]] = Field(None, json_schema_extra=_TODO)
    """Compiler passes to run."""


class UnimplementedSections(ConfigModel):
    """DeepSpeed top-level keys accepted with a warning."""

    prescale_gradients: Optional[Any] = _todo()
    """Scale gradients before all-reduce instead of after; recognised, not implemented."""
    gradient_predivide_factor: Optional[Any] = _todo()
    """Divide gradients by this before all-reduce; recognised, not implemented."""
    zero_force_ds_cpu_optimizer: Optional[Any] = _todo()
    """Insist on DeepSpeed's CPU Adam with offload; recognised, not implemented."""
    memory_breakdown: Optional[Any] = _todo()
    """Print memory use at each step; recognised, not implemented."""
    dump_state: Optional[Any] = _todo()
    """Print the engine state after initialisation; recognised, not implemented."""
    seq_parallel_communication_data_type: Optional[Any] = _todo()
    """Sequence-parallel communication dtype; recognised, not implemented."""
    flops_profiler: Optional[Any] = _todo()
    """DeepSpeed's FLOPS profiler; recognised, not implemented."""
    comet: Optional[Any] = _todo()
    """Comet monitor; recognised, not implemented."""
    comms_logger: Optional[Any] = _todo()
    """Per-collective logging; recognised, not implemented (the comm layer counts bytes itself)."""
    autotuning: Optional[Any] = _todo()
    """DeepSpeed autotuner; recognised, not implemented."""
    pipeline: Optional[Any] = _todo()
    """Pipeline parallelism; recognised, not implemented."""
    data_efficiency: Optional[Any] = _todo()
    """Data sampling/routing library; recognised, not implemented."""
    weight_quantization: Optional[Any] = _todo()
    """Post-training weight quantisation; recognised, not implemented."""
    hybrid_engine: Optional[Any] = _todo()
    """RLHF hybrid engine; recognised, not implemented."""
    dataloader_drop_last: Optional[Any] = _todo()
    """Drop the last incomplete batch of DeepSpeed's loader; recognised, not implemented."""
    disable_allgather: Optional[Any] = _todo()
    """Legacy stage-1 switch; recognised, not implemented."""
    compile: Optional[CompileConfig] = None
    """DeepSpeed's DeepCompile options (not torch.compile's); recognised, not implemented."""
    timers: Optional[Any] = _todo()
    """Throughput timers; recognised, not implemented."""
    use_data_before_expert_parallelism: Optional[Any] = _todo()
    """MoE data/expert parallel group order; recognised, not implemented."""
    tensor_parallel: Optional[dict[str, Any]] = _todo()
    """AutoTP training (`autotp_size`, ...); recognised, not implemented: `autotp_size` > 1 is refused
    before training (it would change the number of data-parallel replicas), 1 is accepted."""
    expert_parallel: Optional[Any] = _todo()
    """AutoEP expert parallelism; recognised, not implemented."""
    sequence_parallel_size: Optional[Any] = _todo()
    """Ulysses sequence-parallel degree; recognised, not implemented: > 1 is refused before training."""
    disable_python_gc: Optional[Any] = _todo()
    """Disable Python's garbage collector during training; recognised, not implemented."""
    managed_gradient_accumulation: Optional[Any] = _todo()
    """Let DeepSpeed decide gradient-accumulation boundaries; recognised, not implemented."""
    log_level: Optional[Any] = _todo()
    """DeepSpeed's logger level; recognised, not implemented (use the `rayzero` logger)."""
    vocabulary_size: Optional[Any] = _todo()
    """Vocabulary size, for a tensor-core alignment warning; recognised, not implemented."""


def tensor_parallel_degree(section: Any) -> int:
    """The AutoTP degree a `tensor_parallel` section asks for (`autotp_size`, or the older
    `tp.tp_size` / `tensor_parallel.tp_size`); 1 when it asks for none."""
    if not isinstance(section, dict):
        return 1
    for outer, inner in ((None, "autotp_size"), ("tp", "tp_size"), ("tensor_parallel", "tp_size")):
        node = section.get(outer) if outer else section
        value = node.get(inner) if isinstance(node, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return max(1, int(value))
    return 1
