"""The training features DeepSpeed 0.19 removed, as top-level keys.

Each changes the math when enabled, so an enabled one is refused, as DeepSpeed refuses it
(rules.py); a disabled leftover is accepted with a note (DeepSpeed 0.19 refuses even that: a
deliberate, harmless difference).
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from rayzero.config.base import REMOVED, ConfigModel


def _removed(what: str) -> Any:
    return Field(None, json_schema_extra={REMOVED: what})


class RemovedFeatures(ConfigModel):
    """DeepSpeed top-level keys of removed features: refused when enabled."""

    sparse_gradients: Optional[Any] = _removed("Sparse compression of dense embedding gradients")
    """Sparse compression of dense embedding gradients: removed in DeepSpeed 0.19; refused when enabled."""
    sparse_attention: Optional[Any] = _removed("DeepSpeed Sparse Attention")
    """DeepSpeed Sparse Attention: removed in DeepSpeed 0.19; refused when enabled."""
    compression_training: Optional[Any] = _removed("The DeepSpeed compression library")
    """The DeepSpeed compression library: removed in DeepSpeed 0.19; refused when enabled."""
    curriculum_learning: Optional[Any] = _removed("Legacy top-level curriculum learning")
    """Legacy top-level curriculum learning: removed in DeepSpeed 0.19; refused when enabled."""
    eigenvalue: Optional[Any] = _removed("Eigenvalue-based Mixture-of-Quantization")
    """Eigenvalue-based Mixture-of-Quantization: removed in DeepSpeed 0.19; refused when enabled."""
    progressive_layer_drop: Optional[Any] = _removed("Progressive Layer Dropping")
    """Progressive Layer Dropping: removed in DeepSpeed 0.19; refused when enabled."""
    quantize_training: Optional[Any] = _removed("Mixture-of-Quantization (quantize_training)")
    """Mixture-of-Quantization (quantize_training): removed in DeepSpeed 0.19; refused when enabled."""
    nebula: Optional[Any] = _removed("Nebula checkpointing")
    """Nebula checkpointing: removed in DeepSpeed 0.19; refused when enabled."""
    graph_harvesting: Optional[Any] = _removed("Graph harvesting")
    """Graph harvesting: removed in DeepSpeed 0.19; refused when enabled."""
