"""`deepspeed` inside `rayzero run` scripts: DeepSpeed's API on rayzero's engine.

Not DeepSpeed: see [Note: the DeepSpeed compatibility layer] in rayzero/compat/__init__.py and
docs/deepspeed-api.md for what each name maps to. This directory is on the path only in script runs.
"""
from rayzero.compat import install as _install
from rayzero.compat.engine import DeepSpeedEngine, initialize
from rayzero.compat.refused import INFERENCE, PARALLELISM, refused
from rayzero.engine.api import add_config_arguments

from . import comm, ops, runtime, utils  # noqa: F401  (deepspeed.comm, deepspeed.runtime.lr_schedules, ...)
from .accelerator import get_accelerator
from .comm import init_distributed
from .runtime import zero
from .runtime.activation_checkpointing import checkpointing
from .utils import log_dist, logger

__version__ = version = "0.19.8+rayzero"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

tp_model_init = refused("deepspeed.tp_model_init", PARALLELISM)
init_inference = refused("deepspeed.init_inference", INFERENCE)
PipelineModule = refused("deepspeed.PipelineModule", PARALLELISM)
PipelineEngine = refused("deepspeed.PipelineEngine", PARALLELISM)
InferenceEngine = refused("deepspeed.InferenceEngine", INFERENCE)

_install()

__all__ = ["DeepSpeedEngine", "add_config_arguments", "checkpointing", "comm", "get_accelerator", "init_distributed",
           "initialize", "log_dist", "logger", "zero"]
