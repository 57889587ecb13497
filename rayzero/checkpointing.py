"""`rayzero.checkpointing`: activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`).

    import rayzero.checkpointing as checkpointing   # was: deepspeed.checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    hidden = checkpointing.checkpoint(block, hidden)

`rayzero.initialize` configures it from the config's `activation_checkpointing` section when the
config has one. See rayzero/engine/activation_checkpointing.py for what each setting does here.
(`rayzero.engine.checkpoint_io` is the other kind of checkpoint: saving training state.)
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
