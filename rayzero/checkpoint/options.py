"""The checkpoint layer's settings, read from the config's `checkpoint` section and the environment.

[Note: checkpoint settings precedence]
The DeepSpeed config's `checkpoint` section (rayzero.config.sections.CheckpointConfig) is where a
user sets the tiers; the defaults below are the same as that section's. An environment variable
overrides the config (the Ray worker, a pod spec or a one-off run can redirect or tune saves
without editing the job's JSON), and keyword overrides of `from_config` override both:
keyword > environment > config > default. Environment values are checked like config values
and rejected naming the variable.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from rayzero.config import environment
from rayzero.config.environment import Variable
from rayzero.config.errors import RayZeroValueError

# option name -> the environment variable overriding it; see [Note: checkpoint settings precedence]
_ENV_OVERRIDES: dict[str, Variable[Any]] = {
    "replicas": environment.CHECKPOINT_REPLICAS,
    "durable_uri": environment.DURABLE_URI,
    "keep_last": environment.CHECKPOINT_KEEP_LAST,
    "async_save": environment.CHECKPOINT_ASYNC_SAVE,
    "upload_threads": environment.CHECKPOINT_UPLOAD_THREADS,
    "timeout_s": environment.CHECKPOINT_TIMEOUT_S,
}


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
    timeout_s: float = 1800.0
    """Timeout of the checkpoint process group: a barrier waits for the slowest rank's shard write."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise RayZeroValueError(f"checkpoint.replicas = {self.replicas}: must be >= 0 (1 survives one lost node)")
        if self.keep_last < 0:
            raise RayZeroValueError(f"checkpoint.keep_last = {self.keep_last}: must be >= 0 (0 keeps every checkpoint)")
        if self.upload_threads < 1:
            raise RayZeroValueError(f"checkpoint.upload_threads = {self.upload_threads}: must be >= 1")
        if not self.timeout_s > 0:
            raise RayZeroValueError(f"checkpoint.timeout_s = {self.timeout_s}: must be > 0 seconds")

    @classmethod
    def from_config(cls, config: Any = None, **overrides: Any) -> CheckpointOptions:
        """Options from a RayZeroConfig (or None): keyword overrides, then the environment, then its
        `checkpoint` section, then the defaults ([Note: checkpoint settings precedence])."""
        section = getattr(config, "checkpoint", None)
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            source = "use_node_local_storage" if name == "node_local" else name
            value = getattr(section, source, None) if section is not None else None
            if value is not None:
                values[name] = value.value if hasattr(value, "value") else value
        from_environment = environment_overrides()
        values.update(from_environment)
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as error:
            for name in from_environment:
                if name not in overrides and str(error).startswith(f"checkpoint.{name} "):
                    raise RayZeroValueError(f"{error} (set by the environment variable {_ENV_OVERRIDES[name].name})") from None
            raise


def environment_overrides(environ: Any = None) -> dict[str, Any]:
    """The checkpoint settings set through environment variables (unset or blank ones skipped,
    except RAYZERO_DURABLE_URI="" which turns the configured durable copy off)."""
    found: dict[str, Any] = {}
    for name, variable in _ENV_OVERRIDES.items():
        text = variable.text(environ)
        if text is None:
            continue
        try:
            found[name] = variable.parse(text.strip())
        except (ValueError, KeyError):
            raise RayZeroValueError(f"environment variable {variable.name} = {text!r} is not a valid checkpoint.{name}: "
                             f"expected {_EXPECTED[name]}; fix or unset it") from None
    return found


_EXPECTED = {"replicas": "an integer >= 0", "durable_uri": "a pyarrow.fs URI", "keep_last": "an integer >= 0",
             "async_save": "true or false", "upload_threads": "an integer >= 1", "timeout_s": "seconds > 0"}


def default_save_dir(options: CheckpointOptions) -> str:
    """Where `save_checkpoint(save_dir=None)` writes: RAYZERO_CHECKPOINT_DIR, else (node-local
    storage) RAYZERO_NODE_LOCAL_DIR/checkpoints."""
    checkpoint_dir, node_local_dir = environment.CHECKPOINT_DIR.get(), environment.NODE_LOCAL_DIR.get()
    if checkpoint_dir:
        return checkpoint_dir
    if options.node_local and node_local_dir:
        return os.path.join(node_local_dir, "checkpoints")
    raise RayZeroValueError(
        "save_checkpoint/load_checkpoint got save_dir=None and no default is set: pass a directory, "
        f"or set {environment.CHECKPOINT_DIR.name} (rayzero.fit sets it for you)")


def config_digest(config: Any) -> str:
    """A short digest of the training config, recorded in the manifest to spot a changed config."""
    if config is None:
        return ""
    if hasattr(config, "model_dump_json"):
        text = config.model_dump_json()
    else:
        text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
