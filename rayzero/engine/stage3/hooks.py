"""Stage 3 gather-before-use / release-after hooks, prefetch and the knobs that steer them.

Hooks (all torch's own per-module / per-tensor hook APIs; nothing global is patched):
  - forward pre-hook of a module with parameters: fetch them (gather, prefetch the next ones);
  - forward post-hook: release them unless a knob keeps them, and hook the outputs' gradients;
  - a multi-grad hook on those outputs fires before the module's backward: fetch again;
  - each trainable parameter's post-accumulate-grad hook: release the parameter — its last use in
    this backward is over — and hand the full gradient to the reducer (gradients.py);
  - frozen parameters gathered for backward stay until `end_backward`.
See [Note: stage-3 prefetch order] (trace.py) for how the recorded order drives prefetch
and reuse, and [Note: stage-3 parameter storage] (parameters.py) for what gather/release do.
"""
from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.stage3.parameters import ParamPartitions, ParamState, PartitionedParam
from rayzero.engine.stage3.stall import StallWatch, different_modules_error
from rayzero.engine.stage3.trace import FetchEvent, ModuleTrace
from rayzero.engine.weak_hooks import weak_hook


def _count(value: Any, field: str) -> int:
    if not isinstance(value, int):
        raise RayZeroValueError(  # noqa: TRY004 - a config value the user must fix, not a programming error
            f"zero_optimization.{field}={value!r} was not resolved to an element count: pass "
            "hidden_size when loading the config or set a number")
    if value < 0:
        raise RayZeroValueError(f"zero_optimization.{field}={value!r} must be >= 0")
    return value


@dataclass(frozen=True)
class Stage3Knobs:
    """DeepSpeed's stage-3 knobs, in elements (DeepSpeed's names, `stage3_` prefix dropped)."""

    prefetch_bucket_size: int
    """Elements of upcoming parameters gathered ahead of their module (0 disables prefetch)."""
    param_persistence_threshold: int
    """Parameters with fewer elements stay gathered for the whole run."""
    model_persistence_threshold: int
    """Cap on the total elements made persistent by the threshold above."""
    max_live_parameters: int
    """Gathered (non-persistent) elements allowed at once before idle ones are released early."""
    max_reuse_distance: int
    """Keep a released-candidate gathered if it is fetched again within this many elements."""

    @classmethod
    def from_config(cls, zero: Any) -> Stage3Knobs:
        # Defaults live in rayzero.config only (ZeroConfig); the engine reads the resolved values.
        return cls(
            prefetch_bucket_size=_count(zero.prefetch_bucket_size, "stage3_prefetch_bucket_size"),
            param_persistence_threshold=_count(zero.param_persistence_threshold,
                                               "stage3_param_persistence_threshold"),
            model_persistence_threshold=_count(zero.model_persistence_threshold,
                                               "stage3_model_persistence_threshold"),
            max_live_parameters=_count(zero.max_live_parameters, "stage3_max_live_parameters"),
            max_reuse_distance=_count(zero.max_reuse_distance, "stage3_max_reuse_distance"),
        )


# [Note: modules every rank runs]
# Stage 3 gathers a module's parameters with a collective, so a module that runs on some ranks only
# leaves the others in a different collective: NCCL hangs, gloo aborts the process with a size
# mismatch (DeepSpeed and FSDP2 hang here). While the fetch trace is being recorded (the first
# micro-step, and again after a rank's order changed: [Note: stage-3 prefetch order]) every gather
# is preceded by a two-number MAX all-reduce of a checksum of the module's name and pass, so a
# difference is found before the gather and raised on every rank with each rank's module named.
# Replayed micro-steps add nothing. A rank that departs from its recorded trace later, while the
# others replay theirs, is found when the collectives it leaves unpaired stall: [Note: stalled
# stage-3 collectives] in stall.py.


class Stage3Coordinator:
    """Installs the hooks on `module` and decides when each parameter is gathered or released."""

    def __init__(self, module: torch.nn.Module, partitions: ParamPartitions, knobs: Stage3Knobs,
                 on_gradient: Callable[[PartitionedParam, torch.Tensor], None],
                 external: dict[int, list[torch.nn.Parameter]] | None = None) -> None:
        self.partitions = partitions
        partitions.attach(self)
        self.knobs = knobs
        self._on_gradient = on_gradient
        self._index = {id(entry): i for i, entry in enumerate(partitions.entries)}
        self._by_param = {id(entry.param): entry for entry in partitions.entries}
        self.trace = ModuleTrace(lambda i: partitions.entries[i].numel)
        self._micro_steps = 0
        self._at: tuple[int, str] = (0, "forward")  # the event being fetched (module index, pass)
        self._departed: tuple[int, str] | None = None  # (micro-step, how) this rank left its recorded order
        comm = partitions.comm
        self.stall = StallWatch(comm.group, comm.rank, comm.world_size, self._where)
        partitions.waiter = self.stall.wait
        # Entries kept gathered after use because of max_reuse_distance: first to go under pressure.
        self._kept: dict[int, PartitionedParam] = {}
        self._handles: list[Any] = []
        self._module_hooks: dict[int, list[Any]] = {}  # each module's own hook handles: fuse() removes some
        # A module inside a fused region -> the region's (index, module): it fetches with the region.
        self._fused_into: dict[int, tuple[int, torch.nn.Module]] = {}
        self._module_params: dict[int, list[PartitionedParam]] = {}
        # Counters that make the knobs observable (memory_stats / tests).
        self.prefetched_elements = 0
        self._module_index: dict[int, int] = {}
        self._module_names = [name or type(module).__name__ for name, _ in module.named_modules()]
        external = external or {}
        for index, submodule in enumerate(module.modules()):
            self._module_index[id(submodule)] = index
            owned = list(submodule.parameters(recurse=False)) + external.get(id(submodule), [])
            entries = []
            for param in owned:
                entry = self._by_param.get(id(param))
                if entry is not None and entry not in entries:
                    entries.append(entry)
            self._module_params[index] = entries
            if entries:
                self._install_module_hooks(index, submodule)
        for entry in partitions.entries:
            if entry.param.requires_grad:
                self._handles.append(entry.param.register_post_accumulate_grad_hook(
                    weak_hook(self._gradient_ready, entry)))  # [Note: gradient hooks hold their engine weakly]

    def add_external(self, module: torch.nn.Module, entry: PartitionedParam) -> None:
        """Make `module` fetch `entry` too (its forward uses another module's parameter)."""
        index = self._module_index.get(id(module))
        if index is None:
            raise RayZeroValueError(f"{type(module).__name__} is not part of the model this engine trains")
        index, module = self._fused_into.get(index, (index, module))
        entries = self._module_params[index]
        if entry not in entries:
            had_hooks = bool(entries)
            entries.append(entry)
            if not had_hooks:
                self._install_module_hooks(index, module)

    def fuse(self, module: torch.nn.Module) -> None:
        """`module` and every module under it fetch as one: `module`'s hooks gather all their
        parameters and the modules under it lose theirs ([Note: compiling stage 3] in
        rayzero/engine/compile.py). Fetch events change, so the trace records afresh."""
        index = self._module_index.get(id(module))
        if index is None:
            raise RayZeroValueError(f"{type(module).__name__} is not part of the model this engine trains")
        if index in self._fused_into:
            return  # already inside a fused region: fetched whole with it
        entries = self._module_params[index]
        for inner in list(module.modules())[1:]:
            inner_index = self._module_index[id(inner)]
            entries.extend(entry for entry in self._module_params[inner_index] if entry not in entries)
            self._module_params[inner_index] = []
            for handle in self._module_hooks.pop(inner_index, []):
                handle.remove()
            self._fused_into[inner_index] = (index, module)
        if entries and index not in self._module_hooks:
            self._install_module_hooks(index, module)

    def _install_module_hooks(self, index: int, module: torch.nn.Module) -> None:
        # Under torch.compile these hooks run eagerly, never traced: they gather with collectives and
        # swap `param.data` ([Note: compiling stage 3] in rayzero/engine/compile.py).
        pre = torch.compiler.disable(functools.partial(self._pre_forward, index))
        post = torch.compiler.disable(functools.partial(self._post_forward, index))
        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]
        self._module_hooks[index] = handles
        self._handles.extend(handles)

    # ---- micro-step framing -----------------------------------------------------------------
    def begin_micro_step(self) -> None:
        """Before a forward: anything still gathered from the last pass is stale; rewind the trace."""
        self._release_idle()
        self.trace.begin_micro_step()
        self._micro_steps += 1

    def end_backward(self) -> None:
        """After backward: parameters pinned for backward and reuse-kept ones are released."""
        self._release_idle()

    # ---- hooks ------------------------------------------------------------------------------
    def _pre_forward(self, index: int, module: torch.nn.Module, args: Any) -> None:
        entries = self._module_params[index]
        self._fetch(FetchEvent((index, "forward"), tuple(self._index[id(e)] for e in entries)), entries)
        for entry in entries:
            entry.users += 1

    def _post_forward(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        entries = self._module_params[index]
        for entry in entries:
            entry.users -= 1
        for entry in entries:
            self._release_or_keep(entry)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._pre_backward, index), mode="any")
        return None

    def _pre_backward(self, index: int, grad: Any) -> None:
        entries = self._module_params[index]
        self._fetch(FetchEvent((index, "backward"), tuple(self._index[id(e)] for e in entries)), entries)
        for entry in entries:
            if not entry.param.requires_grad:
                entry.pinned_until_backward_end = True

    def _gradient_ready(self, entry: PartitionedParam, param: torch.nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if entry.users == 0:
            # Released before its gradient goes to the reducer, which may allocate the bucket's send
            # buffer now (in the reduce dtype: twice the gradient's bytes for bf16 with fp32 reduction):
            # the gathered values and that buffer are never alive together, as FSDP2 reshards a
            # group before its reduce-scatter's input exists (bench/memory.py: GPT-2's tied embedding)
            self._kept.pop(id(entry), None)
            self.partitions.release(entry)
        if grad is not None:
            self._on_gradient(entry, grad)

    # ---- policy -----------------------------------------------------------------------------
    def _name(self, key: tuple[int, str]) -> str:
        return f"{self._module_names[key[0]]} ({key[1]})"

    def _where(self) -> tuple[int, str, bool]:
        """What this rank is fetching, for [Note: stalled stage-3 collectives]."""
        where = self._name(self._at)
        departed = self._departed is not None and self._departed[0] == self._micro_steps
        if departed:
            where += f", having left its recorded order at {self._departed[1]}"
        return self._micro_steps, where, departed

    def _fetch(self, event: FetchEvent, entries: list[PartitionedParam]) -> None:
        self._at = event.key
        expected = self.trace.expected()
        if not self.trace.observe(event) and expected is not None:
            self._departed = (self._micro_steps, f"{self._name(event.key)} where {self._name(expected.key)} came before")
        if self.trace.recording and any(e.state is ParamState.RELEASED and not e.persistent for e in entries):
            self._agree(event)
        for entry in entries:
            self._kept.pop(id(entry), None)
        missing = sum(e.numel for e in entries if e.state is ParamState.RELEASED and not e.persistent)
        self._make_room(missing)
        self.partitions.gather(entries)
        self._prefetch(event.key[1])
        if self.partitions.store is not None and self.partitions.store.bytes:  # some shard is swapped
            self._read_ahead()
        for entry in entries:
            self.partitions.wait(entry)

    def _agree(self, event: FetchEvent) -> None:
        """[Note: modules every rank runs] Before a gather while the trace is being recorded: check
        that every rank is fetching the same module, and name them when not."""
        comm = self.partitions.comm
        if comm.world_size == 1:
            return
        where = self._name(event.key)
        code = float(zlib.crc32(where.encode()))
        seen = comm.all_reduce_control(torch.tensor([code, -code], dtype=torch.float64,
                                                    device=self.partitions.device), op="max", waiter=self.stall.wait)
        if float(seen[0]) == code and float(seen[1]) == -code:
            return
        names: list[Any] = [None] * comm.world_size
        torch.distributed.all_gather_object(names, where, group=comm.group)
        raise different_modules_error(names)

    def _prefetch(self, phase: str) -> None:
        """Keep the next `prefetch_bucket_size` elements of this pass's trace gathered or in flight.

        Elements already gathered count toward the budget, so the scan stops within one budget's
        worth of trace instead of walking to its end on every fetch. The scan stays within the
        current pass (forward or backward): reaching into backward would re-gather, right away,
        the parameters each forward module just released for their backward use — the memory of
        keeping them without the saving of releasing them (max_reuse_distance decides that).
        """
        budget = self.knobs.prefetch_bucket_size
        if budget <= 0:
            return
        batch: list[PartitionedParam] = []
        chosen: set[int] = set()
        ahead, issued, live = 0, 0, self.partitions.live_elements
        for event in self.trace.upcoming():
            if event.key[1] != phase:
                break
            for index in event.params:
                entry = self.partitions.entries[index]
                if entry.persistent or index in chosen:
                    continue
                if entry.state is not ParamState.RELEASED:
                    ahead += entry.numel
                elif ahead + entry.numel <= budget and live + entry.numel <= self.knobs.max_live_parameters:
                    batch.append(entry)
                    chosen.add(index)
                    ahead += entry.numel
                    issued += entry.numel
                    live += entry.numel
                else:
                    ahead = budget
                if ahead >= budget:
                    break
            if ahead >= budget:
                break
        self.partitions.gather(batch)  # one collective ([Note: coalesced gathers])
        self.prefetched_elements += issued

    def _read_ahead(self) -> None:
        """Shards swapped to NVMe that the trace says come next (past what prefetch just gathered)
        start reading into the free staging buffers ([Note: NVMe parameter shards])."""
        wanted: list[PartitionedParam] = []
        for event in self.trace.upcoming():
            for index in event.params:
                entry = self.partitions.entries[index]
                if entry.swap is not None and entry.state is ParamState.RELEASED and entry not in wanted:
                    wanted.append(entry)
            if len(wanted) >= self.partitions.store.buffer_count:
                break
        self.partitions.read_ahead(wanted)

    def _release_or_keep(self, entry: PartitionedParam) -> None:
        if entry.persistent or entry.users > 0:
            return
        distance = self.trace.reuse_distance(self._index[id(entry)])
        if distance is not None and distance < self.knobs.max_reuse_distance:
            self._kept[id(entry)] = entry
            return
        self.partitions.release(entry)

    def _make_room(self, needed: int) -> None:
        """Release reuse-kept parameters, oldest first, until `needed` more fit under the cap."""
        limit = self.knobs.max_live_parameters
        while self._kept and self.partitions.live_elements + needed > limit:
            _, entry = next(iter(self._kept.items()))
            del self._kept[id(entry)]
            self.partitions.release(entry)

    def _release_idle(self) -> None:
        self._kept.clear()
        for entry in self.partitions.entries:
            if entry.state is not ParamState.RELEASED and entry.users == 0 and not entry.persistent:
                self.partitions.release(entry)

    def close(self) -> None:
        self.partitions.coordinator = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stall.close()
