"""Top-level DeepSpeed keys rayzero recognises but does not implement.

They are accepted (so a DeepSpeed file loads unchanged) and each one present produces a warning
naming it; none of them changes what rayzero does.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from rayzero.config.base import UNIMPLEMENTED, ConfigModel

_TODO = {UNIMPLEMENTED: True}


def _todo() -> Any:
    return Field(None, json_schema_extra=_TODO)


class UnimplementedSections(ConfigModel):
    """DeepSpeed top-level keys accepted with a warning."""

    prescale_gradients: Optional[Any] = _todo()
    """Scale gradients before all-reduce instead of after; recognised, not implemented."""
    gradient_predivide_factor: Optional[Any] = _todo()
    """Divide gradients by this before all-reduce; recognised, not implemented."""
    sparse_gradients: Optional[Any] = _todo()
    """Sparse all-reduce for embedding gradients; recognised, not implemented."""
    zero_force_ds_cpu_optimizer: Optional[Any] = _todo()
    """Insist on DeepSpeed's CPU Adam with offload; recognised, not implemented."""
    memory_breakdown: Optional[Any] = _todo()
    """Print memory use at each step; recognised, not implemented."""
    dump_state: Optional[Any] = _todo()
    """Print the engine state after initialisation; recognised, not implemented."""
    data_types: Optional[Any] = _todo()
    """`grad_accum_dtype` for gradient accumulation; recognised, not implemented."""
    seq_parallel_communication_data_type: Optional[Any] = _todo()
    """Sequence-parallel communication dtype; recognised, not implemented."""
    flops_profiler: Optional[Any] = _todo()
    """DeepSpeed's FLOPS profiler; recognised, not implemented."""
    tensorboard: Optional[Any] = _todo()
    """TensorBoard monitor; recognised, not implemented (use `rayzero.report`)."""
    wandb: Optional[Any] = _todo()
    """Weights & Biases monitor; recognised, not implemented (use `rayzero.report`)."""
    csv_monitor: Optional[Any] = _todo()
    """CSV monitor; recognised, not implemented (use `rayzero.report`)."""
    comet: Optional[Any] = _todo()
    """Comet monitor; recognised, not implemented."""
    comms_logger: Optional[Any] = _todo()
    """Per-collective logging; recognised, not implemented (the comm layer counts bytes itself)."""
    autotuning: Optional[Any] = _todo()
    """DeepSpeed autotuner; recognised, not implemented."""
    pipeline: Optional[Any] = _todo()
    """Pipeline parallelism; recognised, not implemented."""
    sparse_attention: Optional[Any] = _todo()
    """Sparse attention kernels; recognised, not implemented."""
    compression_training: Optional[Any] = _todo()
    """Compression-aware training; recognised, not implemented."""
    data_efficiency: Optional[Any] = _todo()
    """Data sampling/routing library; recognised, not implemented."""
    curriculum_learning: Optional[Any] = _todo()
    """Curriculum learning; recognised, not implemented."""
    eigenvalue: Optional[Any] = _todo()
    """Eigenvalue computation for quantisation; recognised, not implemented."""
    progressive_layer_drop: Optional[Any] = _todo()
    """Progressive layer dropping; recognised, not implemented."""
    quantize_training: Optional[Any] = _todo()
    """Quantisation-aware training; recognised, not implemented."""
    weight_quantization: Optional[Any] = _todo()
    """Post-training weight quantisation; recognised, not implemented."""
    hybrid_engine: Optional[Any] = _todo()
    """RLHF hybrid engine; recognised, not implemented."""
    nebula: Optional[Any] = _todo()
    """Azure Nebula checkpointing; recognised, not implemented."""
    dataloader_drop_last: Optional[Any] = _todo()
    """Drop the last incomplete batch of DeepSpeed's loader; recognised, not implemented."""
    disable_allgather: Optional[Any] = _todo()
    """Legacy stage-1 switch; recognised, not implemented."""
    torch_autocast: Optional[Any] = _todo()
    """torch.autocast integration; recognised, not implemented."""
    compile: Optional[Any] = _todo()
    """torch.compile integration; recognised, not implemented."""
    timers: Optional[Any] = _todo()
    """Throughput timers; recognised, not implemented."""
    graph_harvesting: Optional[Any] = _todo()
    """CUDA-graph harvesting; recognised, not implemented."""
    use_data_before_expert_parallelism: Optional[Any] = _todo()
    """MoE data/expert parallel group order; recognised, not implemented."""
