"""ZeRO stage 3: parameters, gradients, fp32 masters and optimizer state all partitioned.

Each rank holds 1/N of every parameter (compute dtype), of its fp32 master and optimizer state and
of its gradient. Modules gather their parameters just before they run and release them after
(hooks.py); gradients are reduce-scattered in buckets as backward produces them
(gradients.py). Traffic per step at gas 1: Ψ all-gather in forward + Ψ in backward + Ψ
reduce-scatter = 3Ψ, less what `param_persistence_threshold` and `max_reuse_distance` save.

Masters: flat fp32 tensors per optimizer param group, each the concatenation of a *sub-group* of
the group's parameter shards (padded): `sub_group_size` elements at most, cut at parameter
boundaries as DeepSpeed cuts them (one parameter larger than that is a sub-group alone). Few large
tensors keep the fused kernels efficient; sub-groups are the tiles an offloaded step swaps
([Note: NVMe tiles] in offload/nvme.py).

[Note: shards are the masters]
Where the masters live on the compute device (no offload), a trainable parameter's shard is a view of
its fp32 master, whatever the compute dtype: a gather casts the shard to bf16/fp16 on its way in
(`ParamPartitions._send_piece`, a transient 1/N piece), as FSDP2's mixed precision does, instead of
keeping a second, compute-dtype copy of every shard beside the master (2 bytes per parameter / N
less at bf16). The values gathered are the same: the copy was the master cast after every step.
Checkpoints still store `module/` pieces in the compute dtype (cast as they are written). With the
masters offloaded (CPU, NVMe) the compute-dtype shard stays on the device: gathering from the host
would move fp32 over the link on every gather.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload.backend import StateKind
from rayzero.engine.offload.overlapped_step import run_step
from rayzero.engine.optim_state import elementwise_state_keys, ensure_optimizer_state
from rayzero.engine.partition import split_evenly
from rayzero.engine.stage3.gradients import GradientReducer
from rayzero.engine.comm import Communicator
from rayzero.engine.stage3.hooks import Stage3Coordinator, Stage3Knobs
from rayzero.engine.quantize import quantize_into
from rayzero.engine.stage3.gather_routes import stored_layout
from rayzero.engine.stage3.layout import LayoutChoice, Stage3Layout
from rayzero.engine.stage3.parameters import ParamPartitions, PartitionedParam, external_parameters, lookup
from rayzero.engine.strategy import StrategyContext, ZeroStrategy


class Stage3Strategy(ZeroStrategy):
    stage = 3
    gradients_partitioned = True

    def loss_divisor(self) -> float:
        """Reductions are plain sums; the engine divides the loss by the world size instead, as for
        stages 0-2, so fp16 gradients (and their overflows) are identical across stages
        ([Note: gradient averaging] in engine.py)."""
        return float(self.comm.world_size)

    def __init__(self, ctx: StrategyContext) -> None:
        self.comm = ctx.comm
        self.module = ctx.module
        self.precision = ctx.precision
        self.policy = ctx.reduce
        self.offload = ctx.offload
        self.knobs = Stage3Knobs.from_config(ctx.zero_config)
        # [Note: stage-3 layouts]: the shard group, and how gathers and reductions travel
        self.layout = Stage3Layout(ctx.comm, LayoutChoice.from_config(ctx.zero_config))
        self.shard_comm = self.layout.shard
        self.partitions = ParamPartitions(self.shard_comm, ctx.device, ctx.precision.param_dtype,
                                          *self.layout.gather_routes())
        # [Note: shards are the masters]: where the masters live on the compute device, a trainable
        # parameter's shard *is* its fp32 master window (no second copy in the compute dtype).
        self.aliased = ctx.offload.may_alias(ctx.device)
        with torch.no_grad():
            pieces = {}
            persistent_budget = self.knobs.model_persistence_threshold
            for name, param in ctx.module.named_parameters():
                piece, shape = self._fp32_piece(param)
                persistent = shape.numel() < self.knobs.param_persistence_threshold and \
                    shape.numel() <= persistent_budget
                if persistent:
                    persistent_budget -= shape.numel()
                pieces[id(param)] = (ctx.param_names.get(id(param), name), param, piece, shape, persistent)
            masters: dict[int, torch.Tensor] = {}
            master_grads: dict[int, torch.Tensor] = {}
            self._released_grads: list[torch.Tensor] = []  # device-resident ones: freed between steps
            self._kept_grads: list[torch.Tensor] = []  # an offloaded optimizer's, in pinned host memory
            self.groups: list[tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]] = []
            optimizer_groups = []
            split = [_sub_groups(group["params"], pieces, int(ctx.zero_config.sub_group_size))
                     for group in ctx.param_groups]
            # [Note: partial offload] in offload/host.py: which sub-groups leave the device
            offloaded = iter(self.offload.sub_groups_offloaded(sum(len(s) for s in split)))
            for group, sub_groups in zip(ctx.param_groups, split):
                group_masters = []
                for sub_group in sub_groups:
                    total = sum(pieces[id(p)][2].numel() for p in sub_group)
                    off = next(offloaded)
                    master = self.offload.allocate(StateKind.MASTER, total, torch.float32, off)
                    master_grad = self.offload.allocate(StateKind.MASTER_GRAD, total, torch.float32, off)
                    offset = 0
                    for param in sub_group:
                        width = pieces[id(param)][2].numel()
                        masters[id(param)] = master[offset:offset + width]
                        master_grads[id(param)] = master_grad[offset:offset + width]
                        masters[id(param)].copy_(pieces[id(param)][2])  # from fp32 values, before any downcast
                        offset += width
                    self.groups.append((sub_group, master, master_grad))
                    # [Note: master gradients between steps]
                    (self._kept_grads if off else self._released_grads).append(master_grad)
                    group_masters.append(master)
                hyper = {k: v for k, v in group.items() if k != "params"}
                optimizer_groups.append({**hyper, "params": group_masters})
            self.partitions.store = self.offload.param_store()
            for name, param, piece, shape, persistent in pieces.values():
                swap = stored = None
                if self.aliased and id(param) in masters:
                    shard = masters[id(param)]
                elif self.partitions.store is not None:  # [Note: NVMe parameter shards]
                    shard, swap = self.partitions.store.place(piece, self.precision.param_dtype, name)
                elif self.layout.choice.quantize_frozen_weights and id(param) not in masters:
                    stored = stored_layout(piece.numel())  # a frozen weight kept as int8 blocks
                    shard = self.offload.allocate(StateKind.PARAM_SHARD, stored.piece_bytes, torch.uint8)
                    quantize_into(piece, stored, *stored.split(shard))
                else:
                    shard = self.offload.allocate(StateKind.PARAM_SHARD, piece.numel(), self.precision.param_dtype)
                    shard.copy_(piece)
                entry = self.partitions.add(param, name, shard, shape, persistent, swap, stored)
                entry.master = masters.get(id(param))
                if ctx.precision.autocast is not None:  # [Note: torch_autocast] in autocast.py
                    wire = ctx.precision.wire_dtype(param)
                    entry.wire_dtype = wire if wire != entry.full.dtype else None
            del pieces
            self.partitions.refresh_persistent([e for e in self.partitions.entries if e.persistent])
            self.precision.place_buffers(self.module, self.partitions.device)  # [Note: buffers keep their dtype]
        by_param = {id(e.param): e for e in self.partitions.entries}
        by_id = {id(e): e for e in self.partitions.entries}
        self.groups = [([by_param[id(p)] for p in params], master, master_grad)
                       for params, master, master_grad in self.groups]
        master_grad_views = {id(by_param[key]): view for key, view in master_grads.items()}
        self.optimizer = ctx.build_optimizer(optimizer_groups)
        wire = {key: ctx.precision.wire_dtype(by_id[key].param) for key in master_grad_views}
        self.reducer = GradientReducer(self.layout.reductions(), ctx.reduce.reduce_bucket_size,
                                       ctx.precision.reduce_dtype, ctx.reduce.overlap_comm, master_grad_views, wire,
                                       {key: by_id[key].shape for key in master_grad_views})
        self.coordinator = Stage3Coordinator(ctx.module, self.partitions, self.knobs, self._reduce_gradient,
                                             external_parameters(ctx.module))
        self.reducer.waiter = self.coordinator.stall.wait
        self.reducer.before_write = self._hold_gradients
        self._grads_held = True
        self._trainable_entries = [e for entries, _, _ in self.groups for e in entries]
        # [Note: step overlapped with backward]: a sub-group steps once its last shard arrived
        self._stepper = self.offload.background_stepper()
        self._step_early = self._boundary = False
        self._group_of = {id(e): index for index, (entries, _, _) in enumerate(self.groups) for e in entries}
        self._waiting: list[int] = []
        self._pending: list = []
        self._backward_end = 0.0

    def _reduce_gradient(self, entry: PartitionedParam, grad: torch.Tensor) -> None:
        """The hooks' way to the reducer. Through this method the hooks on the module keep the
        strategy alive after its engine was dropped, so the next `initialize` can release it
        ([Note: one engine per module] in wrapping.py)."""
        self.reducer.add(entry, grad)

    def _fp32_piece(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Size]:
        """This rank's padded fp32 piece of `param`, adopting a `rayzero.zero.Init` partition."""
        adopted = lookup(param)
        if adopted is not None:
            owner, entry = adopted
            if (owner.comm.world_size, owner.comm.rank) != (self.comm.world_size, self.comm.rank):
                raise RayZeroValueError(
                    f"parameter {entry.name} was partitioned by rayzero.zero.Init over {owner.comm.world_size} "
                    f"rank(s) but training runs on {self.comm.world_size}: initialise the process group "
                    "(rayzero.init_distributed()) before entering Init, and use the same group for both")
            if self.shard_comm is not self.comm:  # MiCS: Init sharded over the world; re-cut for the shard group
                owner.gather([entry], exact=True)
                owner.wait(entry)
                full = entry.full[: entry.numel].float()
                owner.forget(entry)
                return self.partitions.local_piece(full), entry.shape
            owner.forget(entry)
            return entry.shard.to(self.partitions.device, torch.float32), entry.shape
        return self.partitions.local_piece(param.detach().reshape(-1).float()), param.shape

    # ---- step protocol ----------------------------------------------------------------------
    def before_forward(self) -> None:
        self.offload.before_forward()
        self.coordinator.begin_micro_step()

    def before_backward(self, is_boundary: bool) -> None:
        self.reducer.seen.clear()
        self.reducer.boundary = is_boundary
        if self._step_early:
            self._wait_steps()
            self._stepper.check_consumed()
            self._boundary = is_boundary
            self._waiting = [len(entries) for entries, _, _ in self.groups] if is_boundary else []

    def enable_step_overlap(self) -> bool:
        self._step_early = self._stepper is not None and self._stepper.can_step
        if self._step_early:
            self.reducer.on_added = self._shards_added
        return self._step_early

    def _shards_added(self, keys: list[int]) -> None:
        """At the boundary: submit each sub-group whose every gradient shard is now in place."""
        if not self._boundary:
            return
        for key in keys:
            index = self._group_of.get(key)
            if index is None:
                continue
            self._waiting[index] -= 1
            if self._waiting[index] == 0:
                _, master, master_grad = self.groups[index]
                self._pending.append(self._stepper.submit(self.optimizer, master, master_grad, None,
                                                          lambda: None, step=True)[0])

    def _wait_steps(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.wait()

    def after_backward(self) -> None:
        self.reducer.finish()
        self._backward_end = time.perf_counter()
        self.coordinator.end_backward()
        if not self.policy.ignore_unused_parameters:
            unused = [e.name for e in self._trainable_entries if id(e) not in self.reducer.seen]
            if unused:
                raise RayZeroValueError(
                    f"parameters {unused[:8]} received no gradient in this backward pass; set "
                    "zero_optimization.ignore_unused_parameters=true to treat their gradient as zero, "
                    "or set requires_grad=False on parameters the model does not use")

    def finish_gradients(self) -> None:
        self.reducer.finish()
        self._wait_steps()
        self._hold_gradients()
        for _, master, master_grad in self.groups:
            master.grad = master_grad

    def master_gradients(self) -> list[torch.Tensor]:
        self._hold_gradients()
        return [master_grad for _, _, master_grad in self.groups]

    # [Note: master gradients between steps]
    # A stage-3 rank's fp32 master gradients are 4 bytes per parameter of its shard, needed from the
    # first reduction of a step's backward to its optimizer step. Kept between steps they sat under
    # the start of the next backward, where the head's gradient and the loss's buffers make one of
    # the step's two peaks (GPT-2 at 2 ranks: 2 B/param over FSDP2's there, which allocates its
    # sharded gradients at each group's reduce-scatter and frees them at zero_grad). So the
    # device-resident ones (not those an offloaded optimizer keeps on the host, in pinned memory)
    # give their storage back at zero_grad and get it back, zeroed, before the reducer's first
    # write (`reducer.before_write`) or any read (`master_gradients`, `finish_gradients`). The
    # tensors and their per-parameter views stay the same objects: only the storage is resized.
    def _hold_gradients(self) -> None:
        """Give the master gradients their storage back, zeroed ([Note: master gradients between
        steps])."""
        if self._grads_held:
            return
        for grad in self._released_grads:
            grad.untyped_storage().resize_(grad.numel() * grad.element_size())
            grad.zero_()
        self._grads_held = True

    def optimizer_step(self) -> None:
        run_step(self._stepper, self.offload, self.optimizer, self._backward_end, len(self.groups), "sub-groups")
        self._publish()
        self.offload.after_publish()

    def _publish(self) -> None:
        """Updated masters -> compute-dtype shards; persistent parameters are re-gathered."""
        with torch.no_grad():
            self.partitions.expire_secondaries(self._trainable_entries)
            if not self.aliased:
                for entry in self._trainable_entries:
                    self.partitions.write_shard(entry, entry.master)
            self.partitions.refresh_persistent([e for e in self._trainable_entries if e.persistent])

    def zero_grad(self) -> None:
        for grad in self._kept_grads:
            grad.zero_()
        for grad in self._released_grads:  # [Note: master gradients between steps]
            grad.untyped_storage().resize_(0)
        self._grads_held = not self._released_grads
        self.reducer.grads_zeroed()

    # ---- checkpoint ([Note: flat-range partitioning]) ---------------------------------------
    def _owned(self, entry: PartitionedParam) -> tuple[int, int]:
        return split_evenly(entry.numel, self.shard_comm.world_size, self.shard_comm.rank)

    def _saved(self, entry: PartitionedParam) -> tuple[int, int]:
        """The part of `_owned` this rank writes: all of it, or with MiCS's replicas (which own the
        same range) an even share of it, so the checkpoint holds each element once and every rank
        writes about 1/world of it — the one format, whatever the layout."""
        start, end = self._owned(entry)
        replicas = self.layout.replicas
        if replicas is None:
            return start, end
        first, last = split_evenly(end - start, replicas.world_size, replicas.rank)
        return start + first, start + last

    def _optimizer_windows(self, saving: bool = False):
        """(entry, its sub-group's master, start, end, window) for each entry this rank owns a part of:
        [start, end) of the full parameter, `window` the same elements in the master. `saving`: only
        the part this rank writes ([Note: flat-range partitioning])."""
        for entries, master, _ in self.groups:
            offset = 0
            for entry in entries:
                owned = self._owned(entry)[0]
                start, end = self._saved(entry) if saving else self._owned(entry)
                if end > start:
                    begin = offset + start - owned
                    yield entry, master, start, end, slice(begin, begin + end - start)
                offset += entry.shard_numel

    def grad_norm(self, comm: Communicator) -> float:
        """MiCS's replicas hold the same gradient shards: the norm is summed over one shard group."""
        return super().grad_norm(self.shard_comm)

    def state_shards(self) -> list[ShardedTensor]:
        out = []
        for entry in self.partitions.entries:
            start, end = self._saved(entry)
            if end > start:
                spec = ShardSpec(f"module/{entry.name}", tuple(entry.shape), entry.full.dtype, start, end)
                piece = self.partitions.saved_piece(entry, start - self._owned(entry)[0], end - start)
                out.append(ShardedTensor(spec, piece))
        for name, buf in self.module.named_buffers():
            out.append(ShardedTensor(ShardSpec(f"module/{name}", tuple(buf.shape), buf.dtype, 0, buf.numel()),
                                     buf.detach().reshape(-1)))
        keys = elementwise_state_keys(self.optimizer)
        for entry, master, start, end, window in self._optimizer_windows(saving=True):
            out.append(ShardedTensor(ShardSpec(f"master/{entry.name}", tuple(entry.shape), torch.float32,
                                               start, end), master.detach()[window]))
            state = self.optimizer.state.get(master, {})
            for key in keys:
                if key in state:
                    value = state[key]
                    spec = ShardSpec(f"optim/{key}/{entry.name}", tuple(entry.shape), value.dtype, start, end)
                    out.append(ShardedTensor(spec, self.offload.checkpoint_piece(master, key, value, window)))
        return out

    def load_state_shards(self, read: Callable[[ShardSpec], torch.Tensor]) -> None:
        with torch.no_grad():
            for entry in self.partitions.entries:
                start, end = self._owned(entry)
                if end > start:
                    spec = ShardSpec(f"module/{entry.name}", tuple(entry.shape), entry.full.dtype, start, end)
                    self.partitions.write_shard(entry, read(spec).reshape(-1))
            self.partitions.expire_secondaries(self.partitions.entries)
            for name, buf in self.module.named_buffers():
                spec = ShardSpec(f"module/{name}", tuple(buf.shape), buf.dtype, 0, buf.numel())
                buf.copy_(read(spec).reshape(buf.shape))
            ensure_optimizer_state(self.optimizer)
            keys = elementwise_state_keys(self.optimizer)
            for entry, master, start, end, window in self._optimizer_windows():
                spec = ShardSpec(f"master/{entry.name}", tuple(entry.shape), torch.float32, start, end)
                try:
                    value = read(spec)
                except KeyError:  # no fp32 copy saved: rebuild it from the weights
                    value = self.partitions.read_shard(entry)[: end - start]
                master[window].copy_(value.reshape(-1))
                state = self.optimizer.state[master]
                for key in keys:
                    target = state[key]
                    spec = ShardSpec(f"optim/{key}/{entry.name}", tuple(entry.shape), target.dtype, start, end)
                    target[window].copy_(read(spec).reshape(-1))
            self._publish()
            trainable = {id(e) for e in self._trainable_entries}
            self.partitions.refresh_persistent(
                [e for e in self.partitions.entries if e.persistent and id(e) not in trainable])
        self.comm.discard_current()

    # ---- instrumentation --------------------------------------------------------------------
    def describe_layout(self, comm: Communicator) -> dict[str, Any]:
        return self.layout.describe()

    def memory_stats(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        entries = self.partitions.entries
        element = self.precision.param_dtype.itemsize
        persistent_full = sum(e.full.numel() for e in entries if e.persistent) * element
        return {
            "params": sum(nbytes(e.shard) for e in entries) + persistent_full,
            "grads": sum(nbytes(g) for _, _, g in self.groups),
            "master_grads": sum(nbytes(g) for _, _, g in self.groups),
            "master_weights": 0 if self.aliased else sum(nbytes(m) for _, m, _ in self.groups),
            "optimizer_state": sum(nbytes(v) for state in self.optimizer.state.values()
                                   for v in state.values() if isinstance(v, torch.Tensor)),
            "buffers": sum(nbytes(b) for b in self.module.buffers()),
            "bucket_buffers": self.reducer.bucket_bytes_peak,
            # Gathered (non-persistent) parameter elements: now and the most at once so far
            # (what max_live_parameters bounds), and what prefetch issued ahead of use.
            "live_param_elements": self.partitions.live_elements,
            "peak_live_param_elements": self.partitions.peak_live_elements,
            "peak_live_param_bytes": self.partitions.peak_live_elements * element,
            "persistent_param_elements": self.partitions.persistent_elements,
            "prefetched_param_elements": self.coordinator.prefetched_elements,
        }

    def reset_peak_live(self) -> None:
        """Start measuring `peak_live_param_elements` afresh (benchmarks, tests)."""
        self.partitions.peak_live_elements = self.partitions.live_elements

    def close(self) -> None:
        self.reducer.finish()
        self.reducer.close()
        if self._stepper is not None:
            self._wait_steps()
            self._stepper.close()
            self._stepper = None
            self._step_early = False
        self.coordinator.close()
        self.partitions.close()


def _sub_groups(params: list, pieces: dict, limit: int) -> list[list]:
    """Consecutive runs of `params` whose shard elements sum to at most `limit` (at least one each)."""
    out: list[list] = []
    size = 0
    for param in params:
        width = pieces[id(param)][2].numel()
        if not out or (limit > 0 and size + width > limit):
            out.append([])
            size = 0
        out[-1].append(param)
        size += width
    return out
