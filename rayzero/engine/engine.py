"""`ZeroEngine`: the training-step driver users hold. Small on purpose — the stage logic lives in the
strategy (strategy.py), numerics in the policies and the loss scaler.

[Note: engine step]
  engine(*inputs)      strategy.before_forward(); module(*inputs) (floating positional inputs
                       cast to fp16 only with fp16.auto_cast, as DeepSpeed), under torch.autocast
                       with torch_autocast ([Note: torch_autocast] in autocast.py)
  engine.backward(l)   strategy.before_backward(boundary); (scale · l / gas).backward() — the
                       strategy's hooks reduce buckets as gradients appear; strategy.after_backward()
  engine.step()        not at a boundary: count the micro step, nothing else. At a boundary:
                       finish_gradients() -> norm (one control all-reduce, only when fp16 or
                       clipping need it) -> overflow? skip, lower the scale : unscale+clip in one
                       multiply, optimizer_step() (offload backend + publish weights), lr step ->
                       zero_grad() -> global_steps += 1 (skipped steps count, as in DeepSpeed).
"""
from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.engine import activation_checkpointing, optim_state
from rayzero.engine.autocast import forward_region
from rayzero.engine.buffers import mixed_dtype_note
from rayzero.engine.comm import Communicator
from rayzero.engine.distributed import compute_device
from rayzero.engine.engine_accessors import DeepSpeedAccessors
from rayzero.engine.monitor import StepTimers, build_monitor, progress_line
from rayzero.engine.policies import MixedPrecisionPolicy, Precision
from rayzero.engine.strategy import ZeroStrategy
from rayzero.engine.wrapping import ensure_not_wrapped, register, unregister

logger = logging.getLogger(__name__)


class StepBoundaryHook(Protocol):
    """[Note: step boundary hook] The runtime that started this process (rayzero's Ray worker)
    watches every engine through this: `after_step` runs once per optimizer step, after the update,
    on every rank at the same step — the one place all ranks can agree to checkpoint (planned stops,
    resizes, `checkpoint now`); `before_forward` lets it end a loop that was told to stop. The
    engine never imports the runtime (layers); the worker installs the hook with
    `set_step_boundary_hook`. Under plain torchrun none is installed and both calls cost nothing."""

    def before_forward(self, engine: ZeroEngine) -> None: ...

    def after_step(self, engine: ZeroEngine) -> None: ...

    def should_stop(self) -> bool: ...

    saving: bool  # set while the loop waits on a save: the runtime must not call that a hang

    def save_stalled(self, seconds: float) -> None: ...

    def saving_into(self, save_dir: str) -> None:
        """The loop saves a checkpoint into `save_dir`, a directory of its own choosing (an HF
        Trainer's `checkpoint-N`): the runtime lists it for committed checkpoints too."""


_STEP_BOUNDARY_HOOK: StepBoundaryHook | None = None  # process-wide, like the default process group


def set_step_boundary_hook(hook: StepBoundaryHook | None) -> None:
    """Install (or remove, with None) the process's step-boundary hook ([Note: step boundary hook])."""
    global _STEP_BOUNDARY_HOOK
    _STEP_BOUNDARY_HOOK = hook


@contextlib.contextmanager
def _stall_counted() -> Iterator[None]:
    """Time the loop spends waiting on a save, told to the runtime's hook (goodput's checkpoint stall)."""
    hook = _STEP_BOUNDARY_HOOK
    started = time.perf_counter()
    if hook is None:
        yield
        return
    was_saving, hook.saving = getattr(hook, "saving", False), True  # a long save is not a hang
    try:
        yield
    finally:
        hook.saving = was_saving
        hook.save_stalled(time.perf_counter() - started)


class Phase(enum.Enum):
    """Where the engine is inside one micro step (guards against calls out of order)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class StepPolicy:
    """The per-step numbers from the config."""

    gradient_accumulation_steps: int
    gradient_clipping: float
    """Global norm cap, 0 = off."""
    micro_batch_size: int | None


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """DeepSpeed's `_cast_inputs_half`: floating tensors to `dtype`, containers rebuilt, rest as is."""
    if isinstance(value, (list, tuple)):
        return value.__class__(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class ZeroEngine(DeepSpeedAccessors):
    """Runs forward, backward and the optimizer step of one rank (see [Note: engine step]);
    DeepSpeed's accessors (`get_lr`, `train_batch_size`, ...) come from engine_accessors.py."""

    def __init__(self, module: torch.nn.Module, strategy: ZeroStrategy, comm: Communicator,
                 precision: MixedPrecisionPolicy, step_policy: StepPolicy, loss_scaler: Any,
                 lr_scheduler: Any, config: Any) -> None:
        self.module = module
        self.strategy = strategy
        self.comm = comm
        self.precision = precision
        self.step_policy = step_policy
        self.loss_scaler = loss_scaler  # static 1.0 unless fp16
        self.lr_scheduler = lr_scheduler
        self.config = config  # the resolved RayZeroConfig, for the checkpoint layer and logs
        self.closed = False  # close() hands the module back ([Note: one engine per module] in wrapping.py)
        self.compiled = None  # what compile() did (compile.py), undone by close()
        self._forwarded = False  # the first forward looks for modules compiled in place (compile.py)
        ensure_not_wrapped(module)
        register(self)
        self.global_steps = 0  # optimizer steps, skipped ones included (DeepSpeed's count)
        self.micro_steps = 0  # backward passes completed by step()
        self.skipped_steps = 0  # fp16 overflows
        self.last_step_overflowed = False
        self.step_applied = False  # the last step() updated the weights (DeepSpeed's was_step_applied)
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary's, once called
        self.last_grad_norm: float | None = None  # unscaled, before clipping; None when not computed
        self.phase = Phase.IDLE
        self.checkpointer = None  # built by rayzero.engine.checkpoint_io on the first save/load
        self.resumed = False  # steps() loaded the resume point, or decided there was none to load
        self.resumed_client_state: dict[str, Any] | None = None  # what that checkpoint's loop saved
        # initialize(training_data=...)'s loader (DeepSpeed's name): load_checkpoint restores its
        # sampler's position ([Note: data position]).
        self.training_dataloader: torch.utils.data.DataLoader | None = None
        # Reporting as DeepSpeed reports ([Note: monitor events]).
        self.global_samples = 0  # samples trained, the monitors' step axis
        self.timers = StepTimers(bool(config.wall_clock_breakdown), compute_device())
        self.monitor = build_monitor(config, comm.rank)
        self._window_losses: list[torch.Tensor] = []  # this window's losses, for train_loss
        if "activation_checkpointing" in config.model_fields_set:
            # [Note: activation checkpointing settings]: the config's section, as if configure() was called
            activation_checkpointing.configure_from_section(config.activation_checkpointing)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if _STEP_BOUNDARY_HOOK is not None:
            _STEP_BOUNDARY_HOOK.before_forward(self)
        if not self._forwarded:  # blocks compiled in place by someone else ([Note: compiling stage 3])
            from rayzero.engine.compile import adopt_compiled_modules
            self._forwarded = True
            adopt_compiled_modules(self)
        self.strategy.before_forward()
        # Inputs are cast only as DeepSpeed casts them: with fp16.auto_cast, every floating tensor
        # among the positional inputs (nested lists/tuples/dicts too) to fp16; keyword arguments and
        # everything under bf16 are left alone (a float regression target keeps its precision).
        if self.precision.precision is Precision.FP16 and self._auto_cast:
            inputs = _cast_floats(inputs, torch.float16)
        self.phase = Phase.FORWARD
        with self.timers.time("forward"), forward_region(self.precision.autocast, compute_device().type):
            try:
                return self.module(*inputs, **kwargs)
            except RuntimeError as error:
                note = mixed_dtype_note(self.module, self.precision.param_dtype, self.precision.buffer_dtype, error)
                if note is not None:
                    error.add_note(note)
                raise

    @property
    def _auto_cast(self) -> bool:
        return bool(self.config.fp16.auto_cast)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backward of `loss` averaged over the accumulation window (unless `scale_wrt_gas=False`),
        reducing gradients on the way."""
        if not torch.is_grad_enabled() or not loss.requires_grad:
            raise RayZeroValueError("engine.backward(loss) needs a loss that requires grad: call it on the output "
                             "of engine(...) outside torch.no_grad()")
        with self.timers.time("backward"):
            self._backward(loss, retain_graph, scale_wrt_gas)
        if self.monitor.enabled:
            self._window_losses.append(loss.detach())

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> None:
        self.strategy.before_backward(self.is_gradient_accumulation_boundary())
        # [Note: gradient averaging] Dividing the loss (a scalar) by gas × world makes every
        # gradient come out of backward already scaled, so summing reductions yield the mean with
        # no extra pass over Ψ elements; DeepSpeed's gradient_predivide_factor does the same.
        # `gradient_allreduce_op: "sum"` (stages 0-2; the config refuses it at stage 3) keeps the
        # plain sum of the ranks' gradients, as DeepSpeed's all-reduce without its average.
        # Under a loss scale (fp16) the world part waits for the unscale multiply instead (no extra
        # pass either): DeepSpeed averages after its reductions, so its fp16 gradients in backward
        # are world times the mean, and these must overflow at the same loss scale as DeepSpeed's.
        divisor = 1.0 if self.precision.scales_loss else self._average_divisor()
        if scale_wrt_gas:
            divisor *= self.step_policy.gradient_accumulation_steps
        scaled = loss.float() / divisor if divisor != 1.0 else loss.float()
        with self.timers.time("backward_inner"):
            self.loss_scaler.scale_loss(scaled).backward(retain_graph=retain_graph)
        with self.timers.time("backward_allreduce"):
            self.strategy.after_backward()
        self.phase = Phase.BACKWARD

    def _average_divisor(self) -> float:
        """The divisor that makes summed gradients the mean over ranks ([Note: gradient averaging])."""
        divisor = self.strategy.loss_divisor()
        if self.config.gradient_allreduce_op == "sum":
            divisor /= self.comm.world_size
        return divisor

    def step(self) -> None:
        """Optimizer step at an accumulation boundary; otherwise only counts the micro step."""
        if self.phase is not Phase.BACKWARD:
            raise RayZeroRuntimeError("engine.step() called without engine.backward(loss) since the last step")
        self.phase = Phase.IDLE
        self.step_applied = False
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        with self.timers.time("backward_allreduce"):
            self.strategy.finish_gradients()
        with self.timers.time("step"):
            self.last_step_overflowed = self._apply_update()
            self.step_applied = not self.last_step_overflowed
            self.strategy.zero_grad()
        self._report()
        self.micro_steps += 1
        self.global_steps += 1
        self.comm.begin_step()
        if _STEP_BOUNDARY_HOOK is not None:
            _STEP_BOUNDARY_HOOK.after_step(self)

    def _report(self) -> None:
        """Progress line, timers and monitor events at a boundary ([Note: monitor events])."""
        self.global_samples += self.train_batch_size() or 0
        every = self.config.steps_per_print
        if every and self.comm.rank == 0 and (self.global_steps + 1) % every == 0:
            logger.info(progress_line(self.global_steps + 1, self.skipped_steps, self.optimizer))
        timings = self.timers.take() if self.timers.enabled else None
        if timings is not None:  # the offloaded step's parts (issue 9): d2h, cpu_step, h2d, nvme read/write
            timings.update({f"offload_{name}": seconds * 1000.0 for name, seconds in self.offload_breakdown().items()})
        if timings is not None and self.comm.rank == 0:
            logger.info("rank 0 step %d time (ms) | %s", self.global_steps + 1,
                        " | ".join(f"{name}: {value:.2f}" for name, value in timings.items()))
        if not self.monitor.enabled:
            return
        losses, self._window_losses = self._window_losses, []
        events = [("Train/Samples/lr", float(self.optimizer.param_groups[0]["lr"]), self.global_samples)]
        if losses:
            mean = float(torch.stack([loss.float() for loss in losses]).mean())
            events.insert(0, ("Train/Samples/train_loss", mean, self.global_samples))
        if self.precision.scales_loss:
            events.append(("Train/Samples/loss_scale", float(self.loss_scaler.loss_scale),
                           self.global_samples))
        if timings is not None:
            events += [(f"Train/Samples/elapsed_time_ms_{name}", value, self.global_samples)
                       for name, value in timings.items()]
        self.monitor.write_events(events)

    def _apply_update(self) -> bool:
        """Unscale, clip, step; returns True when the step was skipped for overflow."""
        fp16 = self.precision.scales_loss  # the fp16 section, or torch_autocast in float16
        clip = self.step_policy.gradient_clipping
        scale = float(self.loss_scaler.loss_scale)
        if fp16:  # the world part of the average was left for now ([Note: gradient averaging])
            scale *= self._average_divisor()
        self.last_grad_norm = None
        factor = 1.0 / scale
        if fp16 or clip > 0:
            norm = self.strategy.grad_norm(self.comm) / scale
            if fp16 and not math.isfinite(norm):
                self.loss_scaler.update_scale(True)
                self.skipped_steps += 1
                logger.warning("rank %d: fp16 gradients overflowed at step %d, step skipped; loss scale "
                               "now %s", self.comm.rank, self.global_steps, self.loss_scaler.loss_scale)
                return True
            self.last_grad_norm = norm
            if clip > 0:
                coefficient = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
                if coefficient < 1.0:
                    factor *= coefficient
        self.strategy.scale_gradients(factor)
        self.strategy.optimizer_step()
        if fp16:
            self.loss_scaler.update_scale(False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return False

    # ---- instrumentation --------------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind, for the last optimizer step ([Note: communication accounting])."""
        return self.comm.last_step()

    def layout(self) -> dict[str, Any]:
        """Where the ranks run and which groups this rank's state is sharded and replicated over
        (global ranks): `nodes` ('2 nodes x 4 ranks'), `node_of_rank`, `shard_group`, and at stage 3
        `replica_group` (MiCS), `hpz_group` (hpZ's secondary partition), `quantized_weights` and
        `quantized_gradients` ([Note: stage-3 layouts]). `rayzero status` shows it."""
        return self.strategy.describe_layout(self.comm)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by kind, plus `model_state` (their sum), `peak_rss` (peak process
        memory) and on CUDA `peak_device_allocated` (the allocator's peak on the engine's device;
        reset it with torch.cuda.reset_peak_memory_stats)."""
        stats = dict(self.strategy.memory_stats())
        stats["model_state"] = sum(stats.get(k, 0) for k in ("params", "grads", "master_weights",
                                                            "optimizer_state"))
        stats.update(self._placement(stats))
        stats["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        device = compute_device()  # the engine's device, not torch's current one (may differ)
        if device.type == "cuda":
            stats["peak_device_allocated"] = int(torch.cuda.max_memory_allocated(device))
        return stats

    def _placement(self, stats: dict[str, int]) -> dict[str, int]:
        """`device_bytes` / `host_bytes` / `nvme_bytes`: where the model state lives
        ([Note: offload placement] in offload/host.py)."""
        offload = self.strategy.offload
        where = {"device": 0, "host": 0, "nvme": 0}
        described = offload.describe()
        nvme = int(described.get("nvme_bytes", 0))
        state_home = "device" if offload.optimizer_home == "device" else "host"
        where[state_home] += stats.get("master_weights", 0) + stats.get("master_grads", 0)
        where[state_home] += max(stats.get("optimizer_state", 0) - nvme, 0)
        kept = offload.device_resident_bytes(self.strategy.optimizer)  # [Note: partial offload]
        where[state_home] -= kept
        where["device"] += kept
        where["nvme"] += nvme + int(described.get("nvme_param_bytes", 0))
        # Shards swapped to NVMe are counted above; `params` holds those kept in host memory
        # (max_in_cpu: [Note: NVMe parameter shards]).
        shards_home = {"nvme": "host"}.get(offload.param_home, offload.param_home) if self.strategy.stage == 3 \
            else "device"
        where[shards_home] += stats.get("params", 0)
        where["device"] += (stats.get("grads", 0) - stats.get("master_grads", 0) + stats.get("buffers", 0)
                            + stats.get("bucket_buffers", 0))
        return {f"{key}_bytes": value for key, value in where.items()}

    def offload_breakdown(self) -> dict[str, float]:
        """Seconds in the last optimizer step's offload parts (cpu_step, nvme_read, nvme_write)."""
        return self.strategy.offload.breakdown()

    # ---- checkpoint seam (rayzero/checkpoint/types.py) -------------------------------------
    def state_shards(self) -> list[ShardedTensor]:
        return self.strategy.state_shards()

    def load_state_shards(self, read: Callable[[ShardSpec], torch.Tensor]) -> None:
        self.strategy.load_state_shards(read)

    def extra_state(self) -> dict[str, Any]:
        """JSON-able state that is not a tensor shard."""
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "global_samples": self.global_samples,
            "loss_scaler": self.loss_scaler.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "optimizer": {"param_groups": optim_state.hyperparameters(self.optimizer),
                          "scalar_state": optim_state.scalar_state(self.optimizer)},
            "stage": self.strategy.stage,
            "world_size": self.comm.world_size,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.global_steps = int(state["global_steps"])
        # Realign to an accumulation boundary at *this* gradient_accumulation_steps: a run resumed at
        # another world size keeps its global batch with another gas ([Note: elastic batch] in
        # rayzero/controller/elastic.py), and the saved count would put the next boundary mid-window
        # (DeepSpeed does not restore a micro-step count at all).
        self.micro_steps = self.global_steps * self.step_policy.gradient_accumulation_steps
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.global_samples = int(state.get("global_samples", 0))  # absent in older checkpoints
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        optimizer_state = state.get("optimizer") or {}
        for group, saved in zip(self.optimizer.param_groups, optimizer_state.get("param_groups", [])):
            for key, value in saved.items():
                if key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
        if optimizer_state.get("scalar_state") is not None:
            optim_state.load_scalar_state(self.optimizer, optimizer_state["scalar_state"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def steps(self, total: int) -> Iterator[int]:
        """The loop that resumes by itself: `for step in engine.steps(total): ...` ([Note: a loop
        that resumes] in loop.py)."""
        from rayzero.engine.loop import steps

        hook = _STEP_BOUNDARY_HOOK
        return steps(self, total, hook.should_stop if hook is not None else (lambda: False))

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from rayzero.engine import checkpoint_io
        if kwargs.get("save_latest", True) is False or (len(args) >= 4 and args[3] is False):
            logger.warning("save_checkpoint(save_latest=False) is ignored: rayzero moves `latest` to every "
                           "committed checkpoint (it only ever names a complete one); pass a tag to "
                           "load_checkpoint to load another")
        save_dir = kwargs.get("save_dir", args[0] if args else None)
        hook = _STEP_BOUNDARY_HOOK
        if save_dir is not None and hook is not None:
            hook.saving_into(os.fspath(save_dir))
        with _stall_counted():
            return checkpoint_io.save_checkpoint(self, *args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from rayzero.engine import checkpoint_io
        return checkpoint_io.load_checkpoint(self, *args, **kwargs)

    def save_16bit_model(self, *args: Any, **kwargs: Any) -> Any:
        from rayzero.engine import checkpoint_io
        return checkpoint_io.save_16bit_model(self, *args, **kwargs)

    def wait_for_checkpoint(self) -> Any:
        """Block until the async save in flight is committed (and uploaded); its phase timings."""
        from rayzero.engine import checkpoint_io
        with _stall_counted():
            return checkpoint_io.wait_for_checkpoint(self)

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False, regions: Any = None) -> None:
        """DeepSpeed's `engine.compile`: torch.compile the model, whole at stages 0-2, block by block
        at stage 3 ([Note: compiling stage 3] in compile.py); `regions` names the blocks (module
        names, modules or classes) instead of the largest ModuleList's children. Once per engine."""
        from rayzero.engine.compile import compile_engine
        if self.compiled is None:
            self.compiled = compile_engine(self, backend, compile_kwargs, schedule, compiled_autograd_enabled,
                                           regions)

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    def close(self) -> None:
        """Finish an async checkpoint save in flight, then remove the strategy's hooks and hand the
        module back (idempotent)."""
        if self.closed:
            return
        if self.compiled is not None:
            self.compiled.undo()
        if self.checkpointer is not None:
            # The save runs in a background thread over its own gloo group: it must be committed
            # before the caller tears the process group down (the usual next call after close()).
            from rayzero.engine import checkpoint_io
            checkpoint_io.wait_for_checkpoint(self)
        self.monitor.close()
        self.strategy.close()
        self.strategy.offload.close()
        self.closed = True
        unregister(self)
