"""The checkpoint layer's settings, read from the config's `checkpoint` section and the environment.

The DeepSpeed config's `checkpoint` section (rayzero.config.sections.CheckpointConfig) is the one
source of truth; fields it does not define yet fall back to the defaults below and to the
environment variables the Ray workers set, so nothing here is a second copy of a config setting.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

CHECKPOINT_DIR_ENV = "RAYZERO_CHECKPOINT_DIR"
"""Default save directory when `save_checkpoint(save_dir=None)`; set by the Ray worker."""
NODE_LOCAL_DIR_ENV = "RAYZERO_NODE_LOCAL_DIR"
"""This node's local disk root (distinct per node, even for fake nodes on one machine)."""
DURABLE_URI_ENV = "RAYZERO_DURABLE_URI"
"""Durable copy target (pyarrow.fs URI) when the config names none."""


@dataclass(frozen=True)
class CheckpointOptions:
    node_local: bool = False
    """Shards go to each node's own disk; replicas to other nodes keep a lost node's shards."""
    replicas: int = 1
    """With node-local storage: how many other nodes keep a copy of each node's shards."""
    durable_uri: str | None = None
    """pyarrow.fs URI (file://, s3://, gs://, hdfs://) receiving a background copy of each checkpoint."""
    keep_last: int = 3
    """Committed checkpoints kept per storage location (and in the durable copy); 0 keeps all."""
    async_save: bool = True
    """Write and upload in a background thread; save_checkpoint blocks only to snapshot the state."""
    upload_threads: int = 8
    """Threads copying files to the durable URI."""
    fsync: bool = True
    """fsync every file before the commit (a checkpoint must survive a power loss, not only a crash)."""
    tag_validation: str = "Warn"
    """Ignore, Warn or Fail when ranks pass different tags (DeepSpeed's `checkpoint.tag_validation`)."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"checkpoint.replicas = {self.replicas}: must be >= 0 (1 survives one lost node)")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last = {self.keep_last}: must be >= 0 (0 keeps every checkpoint)")
        if self.upload_threads < 1:
            raise ValueError(f"checkpoint.upload_threads = {self.upload_threads}: must be >= 1")

    @classmethod
    def from_config(cls, config: Any = None, **overrides: Any) -> CheckpointOptions:
        """Options from a RayZeroConfig (or None), its `checkpoint` section, then the environment."""
        section = getattr(config, "checkpoint", None)
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            source = "use_node_local_storage" if name == "node_local" else name
            value = getattr(section, source, None) if section is not None else None
            if value is not None:
                values[name] = value.value if hasattr(value, "value") else value
        if values.get("durable_uri") is None and os.environ.get(DURABLE_URI_ENV):
            values["durable_uri"] = os.environ[DURABLE_URI_ENV]
        values.update(overrides)
        return cls(**values)


def default_save_dir(options: CheckpointOptions) -> str:
    """Where `save_checkpoint(save_dir=None)` writes: RAYZERO_CHECKPOINT_DIR, else (node-local
    storage) RAYZERO_NODE_LOCAL_DIR/checkpoints."""
    if os.environ.get(CHECKPOINT_DIR_ENV):
        return os.environ[CHECKPOINT_DIR_ENV]
    if options.node_local and os.environ.get(NODE_LOCAL_DIR_ENV):
        return os.path.join(os.environ[NODE_LOCAL_DIR_ENV], "checkpoints")
    raise ValueError(
        "save_checkpoint/load_checkpoint got save_dir=None and no default is set: pass a directory, "
        f"or set {CHECKPOINT_DIR_ENV} (rayzero.fit sets it for you)")


def config_digest(config: Any) -> str:
    """A short digest of the training config, recorded in the manifest to spot a changed config."""
    if config is None:
        return ""
    if hasattr(config, "model_dump_json"):
        text = config.model_dump_json()
    else:
        text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
