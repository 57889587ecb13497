"""Small frozen policies the engine is built from, each read once from the config."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.buffers import place_buffers

if TYPE_CHECKING:
    from rayzero.config.model import RayZeroConfig
    from rayzero.config.zero_optimization import ZeroConfig
    from rayzero.engine.autocast import AutocastPolicy


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtype computes, which reduces gradients, and that masters are always fp32."""

    precision: Precision
    param_dtype: torch.dtype
    """dtype of the module's parameters during forward/backward (buffers: `buffer_dtype`)."""
    reduce_dtype: torch.dtype
    """dtype gradients travel in (`communication_data_type`; default: param_dtype)."""
    master_dtype: torch.dtype = torch.float32
    """Master weights and optimizer state: fp32 always, as in DeepSpeed."""
    accumulate_dtype: torch.dtype | None = None
    """dtype gradients accumulate in across micro steps at stages 0-1 (`data_types.grad_accum_dtype`);
    None: param_dtype (the gradients themselves). Stages 2-3 accumulate into fp32 master gradients."""
    autocast: AutocastPolicy | None = None
    """`torch_autocast`: the forward's autocast dtype and which parameters communicate in it
    ([Note: torch_autocast] in autocast.py); None without it."""
    buffer_dtype: torch.dtype | None = None
    """`data_types.buffer_dtype`: None, floating buffers keep their dtype ([Note: buffers keep their dtype])."""
    keep_in_fp32: str | tuple[str, ...] = "auto"
    """`data_types.keep_in_fp32_modules`: buffers kept in fp32 ("auto": the model's transformers lists)."""

    def place_buffers(self, module: torch.nn.Module, device: torch.device | None = None) -> None:
        """The module's floating buffers in their dtypes ([Note: buffers keep their dtype])."""
        place_buffers(module, self.param_dtype, self.buffer_dtype, self.keep_in_fp32, device)

    def wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ZeRO stages 1-3 reduce `param`'s gradient in (stage 3 also gathers it in that
        dtype): per parameter under torch_autocast, else `reduce_dtype`. Stage 0 uses `reduce_dtype`."""
        if self.autocast is None:
            return self.reduce_dtype
        return self.autocast.wire_dtype(param, self.param_dtype)

    @property
    def scales_loss(self) -> bool:
        """fp16 compute (the fp16 section, or torch_autocast in float16): a dynamic loss scale, and
        an overflow check before each step."""
        return self.precision is Precision.FP16 or (self.autocast is not None and self.autocast.scales_loss)

    @classmethod
    def from_config(cls, cfg: RayZeroConfig, autocast: AutocastPolicy | None = None) -> MixedPrecisionPolicy:
        # Defaults live in rayzero.config only: every key read here exists on a loaded config.
        fp16, bf16 = bool(cfg.fp16.enabled), bool(cfg.bf16.enabled)
        if fp16 and bf16:
            raise RayZeroValueError("fp16.enabled and bf16.enabled are both true: enable at most one of them")
        precision = Precision.FP16 if fp16 else Precision.BF16 if bf16 else Precision.FP32
        param_dtype = _DTYPES[precision.value]
        comm = cfg.communication_data_type
        if comm is not None and not isinstance(comm, str):
            comm = getattr(comm, "value", str(comm))
        if comm is None:
            reduce_dtype = param_dtype
        elif comm in _DTYPES:
            reduce_dtype = _DTYPES[comm]
        else:
            raise RayZeroValueError(f"communication_data_type={comm!r} is not supported: use fp32, fp16 or bf16")
        # Only fp32 accumulation of 16-bit gradients is honoured (the config warns about other asks).
        fp32_accumulation = cfg.data_types.grad_accum_dtype == "fp32" and param_dtype != torch.float32
        keep = cfg.data_types.keep_in_fp32_modules
        return cls(precision, param_dtype, reduce_dtype,
                   accumulate_dtype=torch.float32 if fp32_accumulation else None, autocast=autocast,
                   buffer_dtype=_DTYPES[cfg.data_types.buffer_dtype] if cfg.data_types.buffer_dtype else None,
                   keep_in_fp32="auto" if keep is None or isinstance(keep, str) else tuple(keep))


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are bucketed and reduced (`zero_optimization` keys, DeepSpeed's names)."""

    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    ignore_unused_parameters: bool

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> ReducePolicy:
        bucket = zero.reduce_bucket_size
        if not isinstance(bucket, int):
            raise RayZeroValueError(  # noqa: TRY004 - a config value, reported like every config error
                f"zero_optimization.reduce_bucket_size={bucket!r} was not resolved to an element count: "
                "pass hidden_size to load_config or set a number")
        # overlap_comm is resolved by the config (None -> stage == 3, as DeepSpeed)
        return cls(int(bucket), bool(zero.overlap_comm), bool(zero.contiguous_gradients),
                   bool(zero.reduce_scatter), bool(zero.ignore_unused_parameters))
