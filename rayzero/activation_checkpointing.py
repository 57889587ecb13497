"""Activation checkpointing (recompute activations in backward instead of keeping them) with DeepSpeed's
API (`deepspeed.checkpointing`); `rayzero.checkpointing` offers the same functions under DeepSpeed's name.

    import rayzero.activation_checkpointing as checkpointing   # was: deepspeed.checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    hidden = checkpointing.checkpoint(block, hidden)

`rayzero.initialize` configures it from the config's `activation_checkpointing` section when the
config has one. See rayzero/engine/activation_checkpointing.py for what each setting does here.
(Saving training state is the other kind of checkpoint: `rayzero/checkpoint/`, `engine.save_checkpoint`.)
"""
from __future__ import annotations

from rayzero.engine.activation_checkpointing import (
    CheckpointingSettings,
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
    settings,
)

__all__ = ["CheckpointingSettings", "checkpoint", "configure", "is_configured", "non_reentrant_checkpoint",
           "reset", "settings"]
