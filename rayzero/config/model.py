"""`RayZeroConfig`: the whole DeepSpeed JSON config as one validated model.

[Note: config attribute names]
Attribute names are DeepSpeed's own pydantic attribute names (`zero_optimization.prefetch_bucket_size`),
and DeepSpeed's JSON keys are aliases where they differ (`stage3_prefetch_bucket_size`). Input accepts
both; `to_deepspeed_dict()` writes DeepSpeed's JSON keys, so its output feeds DeepSpeed unchanged.
Other layers read attributes; build instances with `load_config` (it migrates, checks cross-field
rules and resolves "auto") rather than the constructor.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BeforeValidator, Field, PrivateAttr

from rayzero.config.base import AUTO, AutoNonNegativeFloat, AutoPositive, Bool, Int
from rayzero.config.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from rayzero.config.removed import RemovedFeatures
from rayzero.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    AmpConfig,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    ElasticityConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TorchAutocastConfig,
)
from rayzero.config.unimplemented import UnimplementedSections
from rayzero.config.zero_optimization import ZeroConfig


def _lower(value: Any) -> Any:
    """DeepSpeed lower-cases this key's value before checking it."""
    return value.lower() if isinstance(value, str) else value


class RayZeroConfig(UnimplementedSections, RemovedFeatures):
    """A DeepSpeed-compatible training configuration."""

    train_batch_size: Optional[AutoPositive] = None
    """Global batch per optimizer step = micro batch × gradient accumulation × world size.
    "auto" = derived from the other two and the world size."""
    train_micro_batch_size_per_gpu: Optional[AutoPositive] = None
    """Samples per rank per forward/backward. "auto" = the trainer's `per_device_train_batch_size`, or without one
    train_batch_size ÷ (gradient accumulation × world size)."""
    gradient_accumulation_steps: Optional[AutoPositive] = None
    """Micro batches accumulated per optimizer step. "auto" = the trainer's `gradient_accumulation_steps`, or
    without one train_batch_size ÷ (micro batch × world size)."""
    gradient_clipping: AutoNonNegativeFloat = 1.0
    """Clip the global gradient norm to this (0 = off). 1.0 matches DeepSpeed 0.19's default.
    "auto" = the trainer's `max_grad_norm`."""
    steps_per_print: Optional[Int] = Field(None, ge=1)
    """Log `step, skipped, lr, mom` from rank 0 every this many optimizer steps (None = never, as
    DeepSpeed 0.19)."""
    wall_clock_breakdown: Bool = False
    """Time forward, backward (its autograd and communication parts) and step in the engine; log them
    at every accumulation boundary (and to the monitors, DeepSpeed's `elapsed_time_ms_*` tags)."""
    optimizer: Optional[OptimizerConfig] = None
    """The optimizer to build; absent = the one passed to `rayzero.initialize`."""
    scheduler: Optional[SchedulerConfig] = None
    """The learning-rate scheduler to build; absent = the one passed in, or none."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision (`bfloat16` is accepted as its older name)."""
    amp: Optional[AmpConfig] = None
    """NVIDIA apex AMP: recognised, refused when enabled."""
    torch_autocast: Optional[TorchAutocastConfig] = None
    """torch.autocast mixed precision (DeepSpeed 0.19's `torch_autocast`)."""
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = "mean"
    """How data-parallel gradients combine: `mean` over ranks (the default), or `sum` (each rank's
    gradient added, N times larger at N ranks; ZeRO stages 0-2 only, as in DeepSpeed)."""
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = None
    """dtype of gradient reductions; unset = the compute dtype."""
    zero_allow_untested_optimizer: Bool = False
    """Allow a client optimizer that ZeRO was not tested with."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Async I/O for NVMe offload."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing options."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint writing options."""
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """DeepSpeed elasticity, honoured by rayzero's elastic controller (DeepSpeed 0.19 removed it)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Gradient-accumulation and load dtypes (DeepSpeed's `data_types`)."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor (DeepSpeed's tags, rank 0)."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor (DeepSpeed's file layout, rank 0)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor (rank 0; only when wandb is installed)."""

    # Warnings and "auto" resolutions from load_config, for the CLI and logs; not configuration,
    # so they are neither serialised nor compared.
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """Every warning and resolution produced while loading, in order."""
        return self._notes

    @property
    def compute_dtype(self) -> str:
        """`fp16`, `bf16` or `fp32`: the dtype of forward/backward."""
        if self.fp16.enabled is True:
            return "fp16"
        if self.bf16.enabled is True:
            return "bf16"
        return "fp32"

    @classmethod
    def from_lightning(cls, world_size: int | None = None, hidden_size: int | None = None,
                       **kwargs: Any) -> "RayZeroConfig":
        """Build from Lightning `DeepSpeedStrategy(...)` keywords (every `__init__` parameter, with
        Lightning's defaults) plus the Trainer's `precision`, `accumulate_grad_batches` and
        `gradient_clip_val`, and optionally `strategy="deepspeed_stage_3_offload"` (Lightning's
        registered names); gives the same config as the DeepSpeed JSON Lightning would generate."""
        from rayzero.config.lightning import from_lightning

        return from_lightning(world_size=world_size, hidden_size=hidden_size, **kwargs)

    def to_deepspeed_dict(self) -> dict[str, Any]:
        """The normalised config with DeepSpeed's JSON keys; `load_config` of it gives this config back."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def unresolved_autos(self) -> list[str]:
        """Dotted paths of values still "auto"."""
        found: list[str] = []

        def walk(node: Any, path: str) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{path}.{key}" if path else key)
            elif isinstance(node, list):
                for index, value in enumerate(node):
                    walk(value, f"{path}[{index}]")
            elif node == AUTO:
                found.append(path)

        walk(self.to_deepspeed_dict(), "")
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RayZeroConfig):
            return NotImplemented
        return self.to_deepspeed_dict() == other.to_deepspeed_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable model
