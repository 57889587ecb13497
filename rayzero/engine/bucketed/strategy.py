"""What stages 0, 1 and 2 share: parameters in padded flat bucket buffers, fp32 master tensors per
bucket, gradient hooks that launch one collective per bucket as soon as it is complete.

The stage classes (stage0.py, stage1.py, stage2.py) only decide how a bucket's gradients are reduced
and how updated weights return to the module; see [Note: bucket partitioning] in partition.py for
the layout and [Note: gradient hooks] below for the backward-time protocol.

[Note: gradient hooks]
Every trainable parameter gets a post-accumulate-grad hook, which fires once per backward after its
gradient is summed into `param.grad` (a tied weight fires once, with both uses summed). A bucket
whose last parameter fired is *complete*; complete buckets are launched strictly in bucket order,
so every rank issues the same collectives in the same order even if hooks fire in a different
order (NCCL requires that). A parameter that gets no gradient (unused in this forward) never fires:
`after_backward` launches the buckets still waiting, treating that gradient as zero, or raises when
`ignore_unused_parameters` is false. With `overlap_comm` the collectives run asynchronously while
backward continues; they are waited for before the step or before the next backward.

[Note: fp32 gradient accumulation]
Stages 0-1 keep full gradients between boundaries. By default `param.grad` is a view of the
bucket's flat gradient buffer, in the compute dtype, so autograd accumulates micro steps in place
(DeepSpeed's default: gradients accumulate in the model's dtype). With `data_types.grad_accum_dtype:
"fp32"` under bf16/fp16 (DeepSpeed's BF16_Optimizer) the buffer is fp32 instead and cannot be a
`.grad` of a 16-bit parameter: each micro step's 16-bit gradient is copied (first micro step of the
window) or added (later ones) into its fp32 slot by the hook, and `param.grad` is dropped at once.
The boundary reduction then sends the fp32 sums, cast to the communication dtype as DeepSpeed does.
"""
from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.engine.bucketed import state_shards
from rayzero.engine.offload.backend import StateKind
from rayzero.engine.offload.overlapped_step import run_step
from rayzero.engine.partition import BucketLayout, plan_buckets
from rayzero.engine.strategy import StrategyContext, ZeroStrategy
from rayzero.engine.weak_hooks import weak_hook

Finish = Callable[[], None]


@dataclass(eq=False)
class Bucket:
    """Runtime state of one bucket (layout: partition.BucketLayout)."""

    layout: BucketLayout
    """Slots and the reduce-scatter split across the real world size."""
    master_layout: BucketLayout
    """How the master is cut: `layout` when optimizer state is partitioned, one piece for stage 0."""
    group: int
    params: list[torch.nn.Parameter]
    """The bucket's parameters, by slot."""
    param_buffer: torch.Tensor
    """Compute-dtype flat buffer (padded) that the module's parameters are views of."""
    master: torch.Tensor
    """This rank's fp32 master piece of the bucket (a view of param_buffer when fp32 on-device)."""
    master_grad: torch.Tensor | None = None
    grad_buffer: torch.Tensor | None = None
    """Stages 0-1: compute-dtype flat gradients that `param.grad` are views of (fp32 sums that
    are not, with fp32 accumulation)."""
    grad_views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's slot of grad_buffer: its `.grad` itself, or its fp32 accumulator
    ([Note: fp32 gradient accumulation])."""
    accumulated: list[bool] = field(default_factory=list)
    """fp32 accumulation: which slots hold a gradient of the current window already."""
    fired: list[bool] = field(default_factory=list)
    remaining: int = 0
    master_range: tuple[int, int] = (0, 0)
    """[start, end) of `master` inside the bucket's flat buffer."""
    host_received: torch.Tensor | None = None
    """Stage 2 with master gradients on the host: the reduced shard copied there (pinned) before it
    is added, since torch adds only tensors on one device."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype its gradients are reduced in (one per bucket: [Note: torch_autocast] in autocast.py)."""


class BucketedStrategy(ZeroStrategy):
    """Base of stages 0-2 (see module docstring)."""

    partitions_optimizer_state: ClassVar[bool]
    """Stages 1-2: each rank keeps masters and optimizer state only for its slice of each bucket."""
    reduces_every_micro_step: ClassVar[bool] = False
    """Stage 2 reduces each micro-batch's gradients (nothing full-size is kept between them)."""
    keeps_full_gradients: ClassVar[bool] = True
    """Stages 0-1 accumulate into full flat gradient buffers that `param.grad` views."""
    always_overlaps: ClassVar[bool] = False
    """Stage 0 overlaps its all-reduces with backward like DDP (overlap_comm is a ZeRO key)."""
    reduces_per_parameter_dtype: ClassVar[bool] = True
    """Under torch_autocast stages 1-2 reduce each parameter in its own wire dtype (DeepSpeed's
    ZeRO optimizer); stage 0 reduces everything in `reduce_dtype` (DeepSpeed's engine all-reduce)."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.comm = ctx.comm
        self.module = ctx.module
        self.param_names = ctx.param_names  # checkpoint keys
        self.precision = ctx.precision
        self.policy = ctx.reduce
        self.offload = ctx.offload
        self.device = ctx.device
        world = ctx.comm.world_size
        self.master_rank = ctx.comm.rank if self.partitions_optimizer_state else 0
        # fp32 compute on the device where masters live: the master *is* the parameter (no copy).
        self.aliased = (ctx.precision.param_dtype == torch.float32 and ctx.offload.may_alias(ctx.device))
        # [Note: fp32 gradient accumulation]: stages 0-1 only (stages 2-3 accumulate into fp32 masters)
        self.separate_accumulator = self.keeps_full_gradients and ctx.precision.accumulate_dtype is not None
        self.buckets: list[Bucket] = []
        optimizer_groups = []
        for group_index, group in enumerate(ctx.param_groups):
            ordered = list(reversed(group["params"]))  # backward order, see [Note: bucket partitioning]
            masters = []
            for reduce_dtype, members in self._by_reduce_dtype(ordered):
                layout = plan_buckets([p.numel() for p in members], ctx.reduce.reduce_bucket_size, world,
                                      self._first_bucket_elements(members, group_index))
                for bucket_layout in layout.buckets:
                    bucket = self._build_bucket(group_index, bucket_layout, members, reduce_dtype)
                    self.buckets.append(bucket)
                    masters.append(bucket.master)
            hyper = {k: v for k, v in group.items() if k != "params"}
            optimizer_groups.append({**hyper, "params": masters})
        self._cast_untracked_state(ctx)
        for bucket in self.buckets:
            self._init_gradient_storage(bucket)
        self.optimizer = ctx.build_optimizer(optimizer_groups)
        self._reducing = False
        self._next_bucket = 0
        self._inflight: list[tuple[object, Finish]] = []
        self._boundary = False
        # [Note: step overlapped with backward]: with an offloaded optimizer a background thread
        # finishes each bucket (the device-to-host copy) as its reduction completes, and also steps
        # it at the boundary when the math allows (enable_step_overlap)
        self._stepper = self.offload.background_stepper()
        self._step_early = False
        self._backward_end = 0.0  # when the boundary backward returned (what the step did not hide)
        self._d2h = 0.0  # seconds in finish callbacks since the last step (offload breakdown)
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._make_hook(bucket, slot_index))
            for bucket in self.buckets for slot_index, param in enumerate(bucket.params)]

    # ---- construction -----------------------------------------------------------------------
    def _first_bucket_elements(self, ordered: list, group_index: int) -> int | None:
        """A smaller first bucket, so communication starts early in backward (stage 0: DDP's)."""
        return None

    def _by_reduce_dtype(self, ordered: list) -> list[tuple[torch.dtype, list]]:
        """`ordered` split by the dtype each gradient is reduced in, order kept within each: one
        bucket never mixes two (DeepSpeed keeps one bucket per communication dtype). Without
        torch_autocast (or at stage 0) that is one run of every parameter."""
        runs: dict[torch.dtype, list] = {}
        for param in ordered:
            dtype = self.precision.wire_dtype(param) if self.reduces_per_parameter_dtype \
                else self.precision.reduce_dtype
            runs.setdefault(dtype, []).append(param)
        return sorted(runs.items(), key=lambda run: str(run[0]))  # the same order on every rank

    def _build_bucket(self, group: int, layout: BucketLayout, ordered: list,
                      reduce_dtype: torch.dtype) -> Bucket:
        dtype = self.precision.param_dtype
        param_buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=self.device)
        master_layout = layout if self.partitions_optimizer_state else BucketLayout(layout.slots, 1)
        start, end = master_layout.shard_range(self.master_rank)
        if self.aliased:
            master = param_buffer[start:end]
        else:
            master = self.offload.allocate(StateKind.MASTER, end - start, self.precision.master_dtype)
        params = [ordered[slot.index] for slot in layout.slots]
        for slot, param in zip(layout.slots, params):
            flat = param.detach().reshape(-1)
            param_buffer[slot.offset:slot.end].copy_(flat)
            if not self.aliased:  # masters come from the fp32 values, before any downcast
                piece = master_layout.piece(slot, self.master_rank)
                master[piece.shard_offset:piece.shard_offset + piece.numel].copy_(
                    flat[piece.param_start:piece.param_end])
            param.data = param_buffer[slot.offset:slot.end].view_as(param)
        return Bucket(layout, master_layout, group, params, param_buffer, master,
                      fired=[False] * len(params), master_range=(start, end), reduce_dtype=reduce_dtype)

    def _cast_untracked_state(self, ctx: StrategyContext) -> None:
        """Frozen parameters compute in the compute dtype too; buffers keep theirs unless the config
        says otherwise ([Note: buffers keep their dtype])."""
        dtype = self.precision.param_dtype
        tracked = {id(p) for bucket in self.buckets for p in bucket.params}
        for param in self.module.parameters():
            if id(param) not in tracked and param.is_floating_point():
                param.data = param.data.to(dtype)
        self.precision.place_buffers(self.module)

    @abc.abstractmethod
    def _init_gradient_storage(self, bucket: Bucket) -> None:
        """Allocate bucket.grad_buffer / grad_views (stages 0-1) and bucket.master_grad."""

    def _attach_full_gradient_buffer(self, bucket: Bucket) -> None:
        """Stages 0-1: one full-size gradient buffer per bucket, each param's `.grad` a view of it,
        so autograd accumulates straight into the buffer the collective reduces (or, accumulating in
        fp32, the buffer of their fp32 sums: [Note: fp32 gradient accumulation])."""
        if self.separate_accumulator:
            bucket.grad_buffer = torch.zeros_like(bucket.param_buffer, dtype=self.precision.accumulate_dtype)
            bucket.grad_views = [bucket.grad_buffer[s.offset:s.end] for s in bucket.layout.slots]
            bucket.accumulated = [False] * len(bucket.params)
            return
        bucket.grad_buffer = torch.zeros_like(bucket.param_buffer)
        bucket.grad_views = [bucket.grad_buffer[s.offset:s.end].view_as(p)
                             for s, p in zip(bucket.layout.slots, bucket.params)]
        for param, view in zip(bucket.params, bucket.grad_views):
            param.grad = view

    @abc.abstractmethod
    def _reduce_bucket(self, bucket: Bucket, async_op: bool) -> tuple[object, Finish]:
        """Launch the bucket's collective; return its Work (or None) and what to do once done."""

    @abc.abstractmethod
    def _publish(self) -> None:
        """After the optimizer step: bring updated masters back into the parameter buffers."""

    # ---- backward ([Note: gradient hooks]) ---------------------------------------------------
    def _make_hook(self, bucket: Bucket, slot_index: int):
        # held weakly: [Note: gradient hooks hold their engine weakly]
        return weak_hook(self._grad_ready, bucket, slot_index)

    def _grad_ready(self, bucket: Bucket, slot_index: int, param: torch.Tensor) -> None:
        if not self._owns(bucket, slot_index, param):
            return
        if self.separate_accumulator:  # [Note: fp32 gradient accumulation]
            slot = bucket.grad_views[slot_index]
            if bucket.accumulated[slot_index]:
                slot.add_(param.grad.reshape(-1))
            else:
                slot.copy_(param.grad.reshape(-1))
                bucket.accumulated[slot_index] = True
            param.grad = None
        elif self.keeps_full_gradients:
            view = bucket.grad_views[slot_index]
            if param.grad is not view:  # first gradient of the window (or a user reset .grad)
                view.copy_(param.grad)
                param.grad = view
        if bucket.fired[slot_index]:
            if self._reducing:  # its bucket may already be on the wire: this gradient would be lost
                raise RayZeroRuntimeError(
                    f"parameter {self.param_names.get(id(param), '?')} received a gradient twice in one "
                    "backward pass (reentrant activation checkpointing runs a nested backward); use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
            return
        bucket.fired[slot_index] = True
        if self._reducing:
            bucket.remaining -= 1
            self._launch_complete_buckets()

    def _owns(self, bucket: Bucket, slot_index: int, param: torch.Tensor) -> bool:
        """False once a newer engine wrapped the same model (it re-pointed `param.data` at its own
        buffer): this strategy then removes its hooks instead of reducing a stranger's gradients."""
        start = bucket.param_buffer.data_ptr() + bucket.layout.slots[slot_index].offset * \
            bucket.param_buffer.element_size()
        if param.data_ptr() == start:
            return True
        self.close()
        return False

    def _launch_complete_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].remaining == 0:
            bucket = self.buckets[self._next_bucket]
            self._next_bucket += 1
            overlap = self.policy.overlap_comm or self.always_overlaps
            work, finish = self._reduce_bucket(bucket, async_op=overlap)
            if self._stepper is not None:
                self._inflight.append(self._stepper.submit(
                    self.optimizer, bucket.master, bucket.master_grad, work, lambda f=finish: self._timed_finish(f),
                    step=self._step_early and self._boundary))
            elif overlap:
                self._inflight.append((work, finish))
            else:
                self._timed_finish(finish)

    def _drain(self) -> None:
        for work, finish in self._inflight:
            if work is not None:
                work.wait()
            self._timed_finish(finish)
        self._inflight.clear()

    def _timed_finish(self, finish: Finish) -> None:
        """Run a bucket's finish callback (the reduced shard into its master gradient: the
        device-to-host copy under CPU offload), adding its time to this step's `d2h`."""
        start = time.perf_counter()
        finish()
        self._d2h += time.perf_counter() - start

    def before_backward(self, is_boundary: bool) -> None:
        self._drain()
        if self._stepper is not None:
            self._stepper.check_consumed()
        self._boundary = is_boundary
        self._reducing = is_boundary or self.reduces_every_micro_step
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.fired = [False] * len(bucket.params)
            bucket.remaining = len(bucket.params)

    def after_backward(self) -> None:
        unused = [self.param_names.get(id(p), "?") for bucket in self.buckets
                  for fired, p in zip(bucket.fired, bucket.params) if not fired]
        if unused and not self.policy.ignore_unused_parameters:
            raise RayZeroValueError(
                f"parameters {unused[:8]} received no gradient in this backward pass; "
                "set zero_optimization.ignore_unused_parameters=true to treat their gradient as zero, "
                "or set requires_grad=False on parameters the model does not use")
        if self.separate_accumulator:  # an unused parameter's slot must read zero, not last step's
            for bucket in self.buckets:
                for index, done in enumerate(bucket.accumulated):
                    if not done:
                        bucket.grad_views[index].zero_()
                        bucket.accumulated[index] = True
        elif self.keeps_full_gradients:
            for bucket in self.buckets:
                for param, view in zip(bucket.params, bucket.grad_views):
                    if param.grad is not view:
                        view.zero_()
                        param.grad = view
        if self._reducing:
            for bucket in self.buckets:  # unused gradients count as zero ([Note: gradient hooks])
                bucket.remaining = 0
            self._launch_complete_buckets()
        self._backward_end = time.perf_counter()

    def finish_gradients(self) -> None:
        self._drain()
        for bucket in self.buckets:
            bucket.master.grad = bucket.master_grad

    def master_gradients(self) -> list[torch.Tensor]:
        return [bucket.master_grad for bucket in self.buckets]

    # ---- step --------------------------------------------------------------------------------
    def enable_step_overlap(self) -> bool:
        """Step each bucket on the host while backward goes on, when the backend can
        ([Note: step overlapped with backward]; api.py decides the math allows it)."""
        self._step_early = self._stepper is not None and self._stepper.can_step
        return self._step_early

    def optimizer_step(self) -> None:
        run_step(self._stepper, self.offload, self.optimizer, self._backward_end, len(self.buckets), "buckets")
        start = time.perf_counter()
        self._publish()
        self.offload.record_transfers(self._d2h, time.perf_counter() - start)
        self._d2h = 0.0

    def zero_grad(self) -> None:
        """Stages 0-1: `.grad = None`, so the first backward of the next window hands over fresh
        gradients that the hook copies into the flat buffer (cheaper than zeroing Ψ elements and
        adding into them); master gradients are overwritten by the next reduction. Stage 2 zeroes
        its accumulating gradient shard."""
        for bucket in self.buckets:
            if not self.keeps_full_gradients and bucket.master_grad is not None:
                bucket.master_grad.zero_()
            bucket.accumulated = [False] * len(bucket.accumulated)
            for param in bucket.params:
                param.grad = None

    def _master_grad_aliases_buffer(self, bucket: Bucket) -> bool:
        return (bucket.grad_buffer is not None and bucket.master_grad is not None
                and bucket.master_grad.untyped_storage().data_ptr()
                == bucket.grad_buffer.untyped_storage().data_ptr())

    def loss_divisor(self) -> float:
        """Gradients are averaged over ranks by dividing the loss, so reductions are plain sums
        and no pass over the gradients is spent on 1/world ([Note: gradient averaging])."""
        return float(self.comm.world_size)

    # ---- checkpoint and instrumentation ------------------------------------------------------
    def state_shards(self) -> list[ShardedTensor]:
        return state_shards.state_shards(self)

    def load_state_shards(self, read: Callable[[ShardSpec], torch.Tensor]) -> None:
        state_shards.load_state_shards(self, read)
        self.comm.discard_current()

    def memory_stats(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        tracked = {id(p) for bucket in self.buckets for p in bucket.params}
        params = sum(nbytes(b.param_buffer) for b in self.buckets) + sum(
            nbytes(p) for p in self.module.parameters() if id(p) not in tracked)
        grads = sum(nbytes(b.grad_buffer) for b in self.buckets)
        grads += sum(nbytes(b.master_grad) for b in self.buckets if not self._master_grad_aliases_buffer(b))
        masters = 0 if self.aliased else sum(nbytes(b.master) for b in self.buckets)
        optim = sum(nbytes(v) for state in self.optimizer.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor))
        buffers = sum(nbytes(b) for b in self.module.buffers())
        master_grads = sum(nbytes(b.master_grad) for b in self.buckets if not self._master_grad_aliases_buffer(b))
        return {"params": params, "grads": grads, "master_grads": master_grads, "master_weights": masters,
                "optimizer_state": optim, "buffers": buffers,
                "bucket_buffers": self._bucket_buffer_bytes()}

    def _bucket_buffer_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._drain()
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
