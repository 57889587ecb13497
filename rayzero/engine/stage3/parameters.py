"""Stage 3 parameter partitions: each parameter keeps only its shard; gathered on demand.

[Note: stage-3 parameter storage]
A partitioned parameter stays the *same* `nn.Parameter` object the user (and tied modules, and
the optimizer's bookkeeping) hold; only its `.data` changes:
  - released: `.data` is a 0-element placeholder, so stray reads fail with a shape error rather
    than reading freed memory;
  - gathered: `.data` is a view of a padded flat buffer (`full`) filled by one all-gather of every
    rank's `shard`.
Releasing also resizes `full`'s storage to 0 bytes instead of dropping it. Autograd may have
saved *views* of the gathered weight for backward (e.g. `weight.t()` inside `linear`); those views
share `full`'s storage, so shrinking it really frees the memory, and re-gathering into the same
storage before the module's backward makes them valid again. (Dropping the buffer instead would
keep every saved view's memory alive until backward — no saving at all.)

Rank r owns elements [r*s, (r+1)*s) of the parameter flattened and zero-padded to N*s elements
(`split_evenly` in partition.py), the layout the checkpoint layer records as flat ranges.

[Note: stage-3 parameter registry]
`rayzero.zero.GatheredParameters(params)` receives bare parameters, as in DeepSpeed, so something
must map a parameter to its partition. That is `_REGISTRY`, keyed weakly by identity: it keeps no
parameter alive and adds no attribute to `nn.Parameter`. Each entry belongs to exactly one
`ParamPartitions` (an engine's stage-3 strategy, or a `rayzero.zero.Init` context before the
engine adopts it). Once an engine's hooks use the partitions (`hold_weakly`), the values are weak
too: a value holding the entry, which holds the parameter, would keep its own key alive, and with
it the partitions and the engine, for the life of the process ([Note: gradient hooks hold their
engine weakly]). Before that the values are strong: `with rayzero.zero.Init():` leaves no other
reference to the partitions that the engine will adopt.
"""
from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rayzero.engine.comm import Communicator
from rayzero.engine.partition import padded_size, split_evenly
from rayzero.engine.quantize import Layout, dequantize_into, quantize_into
from rayzero.engine.stage3.gather_routes import Direct, GatherRoute, Stored

# Parameters whose gathered size is at least this gather in a collective of their own ([Note:
# coalesced gathers]): 1M elements is ~4 MiB in fp32, ~1-4 ms on gloo here against ~0.5 ms per call.
COALESCE_MAX_ELEMENTS = 1 << 20

_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()
# module -> parameters of *other* modules it uses in its forward (DeepSpeed's
# register_external_parameter); weakly keyed like _REGISTRY, read when the hooks are installed.
_EXTERNAL: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ParamState(enum.Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    """An all-gather was issued (prefetch) and not yet waited on."""
    GATHERED = "gathered"


@dataclass(eq=False)
class PartitionedParam:
    """One parameter's partition and gather state (owned by a `ParamPartitions`)."""

    param: torch.nn.Parameter
    name: str
    shape: torch.Size
    numel: int
    shard: torch.Tensor
    """This rank's padded piece, 1-D of `shard_numel` elements: in the compute dtype, or the fp32
    master itself where the master lives on the compute device ([Note: shards are the masters])."""
    full: torch.Tensor
    """Padded flat gather buffer (N * shard_numel), compute dtype; 0 bytes of storage while released."""
    persistent: bool = False
    """Kept gathered for the whole run (`param_persistence_threshold`); refreshed after each step."""
    state: ParamState = ParamState.RELEASED
    users: int = 0
    """Scopes currently needing the gathered data (module forwards, GatheredParameters)."""
    pending: object = None
    """The async all-gather handle while GATHERING."""
    master: torch.Tensor | None = None
    """View of this parameter's fp32 master shard (set by the strategy; GatheredParameters writes it)."""
    pinned_until_backward_end: bool = False
    """Gathered during backward for a parameter without gradient hook: released at backward end."""
    swap: Any = None
    """The shard's place in the NVMe swap file when it lives there (`shard` is then a 0-element
    placeholder): [Note: NVMe parameter shards] in offload/nvme_param_store.py."""
    wire_dtype: torch.dtype | None = None
    """dtype the all-gather carries it in when not the compute dtype: torch_autocast's lower precision
    for a lower-precision-safe module's weight ([Note: torch_autocast] in autocast.py)."""
    stored: Layout | None = None
    """zero_quantized_nontrainable_weights: `shard` holds this frozen parameter's piece as int8 blocks
    (Layout.piece_bytes of uint8), gathered as stored ([Note: stage-3 layouts] in layout.py)."""
    secondary: torch.Tensor | None = None
    """hpZ: this rank's piece of the gathered values over its secondary group, kept from the last
    release until the values change ([Note: stage-3 layouts] in layout.py); None without hpZ."""

    @property
    def shard_numel(self) -> int:
        if self.swap is not None:
            return self.swap.numel
        return self.stored.numel if self.stored is not None else self.shard.numel()


class _GatherBatch:
    """One coalesced all-gather in flight (see [Note: coalesced gathers])."""

    def __init__(self, work: object, received: torch.Tensor, entries: list[PartitionedParam],
                 send: torch.Tensor, rows: int) -> None:
        self.work = work
        self.received = received
        self.entries = entries
        self.send = send  # must outlive the collective
        self.rows = rows  # members of the route: each sent one piece of every entry
        self.done = False

    def finish(self, waiter: Callable[[Any], None]) -> None:
        if self.done:
            return
        waiter(self.work)
        rows = self.received.view(self.rows, -1)
        offset = 0
        for entry in self.entries:
            width = entry.full.numel() // self.rows
            if entry.pending is self:
                entry.full.view(self.rows, width).copy_(rows[:, offset:offset + width])
                entry.pending = None
                _point_at_full(entry)
            offset += width
        self.done, self.received, self.send = True, None, None


def _wait(work: Any) -> None:
    work.wait()


def _point_at_full(entry: PartitionedParam) -> None:
    entry.param.data = entry.full[: entry.numel].view(entry.shape)
    entry.state = ParamState.GATHERED


def lookup(param: torch.Tensor) -> tuple[ParamPartitions, PartitionedParam] | None:
    """The partition owning `param`, or None when it is not stage-3 partitioned."""
    owner = _REGISTRY.get(param)
    if owner is None:
        return None
    partitions, entry = (_dereference(value) for value in owner)
    return (partitions, entry) if partitions is not None and entry is not None else None


def _dereference(value: Any) -> Any:
    return value() if isinstance(value, weakref.ref) else value


def _registered_to(param: torch.Tensor, partitions: ParamPartitions) -> bool:
    owner = _REGISTRY.get(param)
    return owner is not None and _dereference(owner[0]) is partitions


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param`, which another module owns.

    Stage 3 gathers only a module's own parameters around its forward; a parameter reached
    through another module (`F.linear(x, self.embed.weight)` in a parent) must be declared so it is
    gathered too. Tied weights assigned as attributes (`head.weight = embed.weight`) need nothing.
    """
    _EXTERNAL.setdefault(module, [])
    if all(existing is not param for existing in _EXTERNAL[module]):
        _EXTERNAL[module].append(param)
    found = lookup(param)
    if found is not None and found[0].coordinator is not None:
        found[0].coordinator.add_external(module, found[1])


def external_parameters(root: torch.nn.Module) -> dict[int, list[torch.nn.Parameter]]:
    """id(submodule) -> parameters declared external for it, for every submodule of `root`."""
    return {id(m): list(_EXTERNAL[m]) for m in root.modules() if m in _EXTERNAL}


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


class ParamPartitions:
    """The partitioned parameters of one model and the gather/release mechanics.

    Policy (when to gather, what to keep) lives in hooks.py; this class only moves data
    and keeps the live-element counters that make the policy measurable.
    """

    def __init__(self, comm: Communicator, device: torch.device | str, dtype: torch.dtype | None = None,
                 primary: GatherRoute | None = None, secondary: GatherRoute | None = None,
                 secondary_comm: Communicator | None = None) -> None:
        self.comm = comm
        """The ranks the parameters are sharded over (the world, or MiCS's shard group)."""
        self.device = torch.device(device)
        """Compute device: where gathered parameters live (shards may live elsewhere: offload)."""
        self.dtype = dtype
        """Compute dtype of gathered parameters (None: each shard's own dtype)."""
        self.primary: GatherRoute = primary or Direct(comm)
        """How a gather from the shards travels ([Note: stage-3 layouts] in layout.py)."""
        self.exact: GatherRoute = getattr(self.primary, "exact", self.primary)
        """The same gather without quantization (`gather(exact=True)`: consolidating, closing)."""
        self.secondary = secondary
        """hpZ: how a gather from secondary pieces travels; None without hpZ."""
        self._secondary_comm = secondary_comm
        self.secondary_elements = 0
        """Elements held in hpZ secondary pieces right now."""
        self.stored_route = Stored(comm)
        """How shards stored as int8 blocks are gathered (zero_quantized_nontrainable_weights)."""
        self.coordinator = None
        """The hooks that use these partitions (set by Stage3Coordinator; None inside Init)."""
        self.store = None
        """Where swapped shards live (offload_param nvme: NvmeParamStore), else None."""
        self.waiter: Callable[[Any], None] = _wait
        """Waits on a gather's Work (the coordinator's watch: [Note: stalled stage-3 collectives])."""
        self.entries: list[PartitionedParam] = []
        # Elements of non-persistent parameters gathered right now, and the most ever at once:
        # what `max_live_parameters` bounds and memory_stats reports.
        self.live_elements = 0
        self.peak_live_elements = 0
        self.persistent_elements = 0

    # ---- building ---------------------------------------------------------------------------
    def add(self, param: torch.nn.Parameter, name: str, shard: torch.Tensor, shape: torch.Size,
            persistent: bool, swap: Any = None, stored: Layout | None = None) -> PartitionedParam:
        """Register `param`, whose local padded shard is `shard` (or, swapped, `swap`; or, `stored`,
        int8 blocks); its data becomes released (a persistent one is gathered by the next
        `refresh_persistent`)."""
        numel = int(torch.Size(shape).numel())
        world = self.comm.world_size
        shard_numel = swap.numel if swap is not None else stored.numel if stored is not None else shard.numel()
        assert shard_numel == padded_size(numel, world) // world, "shard of the wrong size"
        full = torch.empty(shard_numel * world, dtype=self.dtype or shard.dtype, device=self.device)
        full.untyped_storage().resize_(0)
        entry = PartitionedParam(param=param, name=name, shape=torch.Size(shape), numel=numel,
                                 shard=shard, full=full, persistent=persistent, swap=swap, stored=stored)
        param.data = _placeholder(full)
        self.entries.append(entry)
        _REGISTRY[param] = (weakref.ref(self), weakref.ref(entry)) if self.coordinator is not None else (self, entry)
        if persistent:
            self.persistent_elements += numel
        return entry

    def local_piece(self, full_flat: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard of a full flattened tensor (a copy)."""
        numel = full_flat.numel()
        start, end = split_evenly(numel, self.comm.world_size, self.comm.rank)
        shard_numel = padded_size(numel, self.comm.world_size) // self.comm.world_size
        piece = torch.zeros(shard_numel, dtype=full_flat.dtype, device=full_flat.device)
        piece[: end - start].copy_(full_flat[start:end])
        return piece

    # ---- gather / release -------------------------------------------------------------------
    def gather(self, entries: Iterable[PartitionedParam], exact: bool = False) -> int:
        """Issue one all-gather for the released `entries` (async); returns elements issued.

        [Note: coalesced gathers] Several parameters travel in *one* collective: each rank sends
        the concatenation of its shards, so the output holds, per rank, that rank's shard of every
        parameter; `wait` copies each parameter's column of it into the parameter's own buffer
        (which must stay separate so it can be freed alone). One collective per module / prefetch
        batch instead of one per parameter: on gloo each call costs ~0.5 ms whatever its size.
        A large parameter (gathered size >= COALESCE_MAX_ELEMENTS) is gathered alone, straight into
        its own buffer: coalesced, it would exist twice at the peak (the batch's output and its
        buffer), for a call overhead that is small next to its transfer. A parameter carried in
        another dtype (`wire_dtype`, unless `exact`) travels in a batch of its dtype, converted into
        its buffer on arrival; a batch never mixes dtypes.
        """
        todo = [entry for entry in entries if entry.state is ParamState.RELEASED]
        for entry in todo:
            entry.full.untyped_storage().resize_(entry.full.numel() * entry.full.element_size())
            entry.state = ParamState.GATHERING
            if not entry.persistent:
                self.live_elements += entry.numel
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        alone: list[PartitionedParam] = []
        # by (route, wire dtype), in `todo` order; a batch never mixes routes or dtypes
        batches: dict[tuple[str, torch.dtype], list[PartitionedParam]] = {}
        for entry in todo:
            wire = entry.full.dtype if exact or entry.wire_dtype is None else entry.wire_dtype
            if entry.stored is not None or wire == entry.full.dtype and entry.full.numel() >= COALESCE_MAX_ELEMENTS:
                alone.append(entry)  # stored int8 bytes never join a batch of another dtype
            else:
                batches.setdefault((self._route_name(entry, exact), wire), []).append(entry)
        for key, together in list(batches.items()):
            if len(together) == 1 and key[1] == together[0].full.dtype:
                alone.append(batches.pop(key)[0])
        for entry in alone:
            route, piece = self._route(self._route_name(entry, exact), entry)
            entry.pending = route.all_gather(entry.full, piece)
        for (name, wire), together in batches.items():
            route = self._route(name, together[0])[0]
            send = torch.cat([self._route(name, entry)[1].to(wire) for entry in together])
            received = torch.empty(send.numel() * route.size, dtype=wire, device=self.device)
            batch = _GatherBatch(route.all_gather(received, send), received, together, send, route.size)
            for entry in together:
                entry.pending = batch
        return sum(entry.numel for entry in todo)

    @staticmethod
    def _route_name(entry: PartitionedParam, exact: bool) -> str:
        if entry.stored is not None:
            return "stored"  # its exact values are the stored ones
        if exact:
            return "exact"
        return "secondary" if entry.secondary is not None else "primary"

    def _route(self, name: str, entry: PartitionedParam) -> tuple[GatherRoute, torch.Tensor]:
        """The route called `name` and the piece of `entry` this rank sends on it."""
        if name == "secondary":
            return self.secondary, entry.secondary
        if name == "stored":
            return self.stored_route, entry.shard.to(self.device, non_blocking=True)
        return (self.exact if name == "exact" else self.primary), self._send_piece(entry)

    def _send_piece(self, entry: PartitionedParam) -> torch.Tensor:
        """The shard as the all-gather's input, on the compute device: an offloaded shard
        (offload_param) is copied there, a swapped one read from its file first."""
        if entry.swap is not None:
            return self.store.copy_out(entry.swap, self.device)
        # [Note: shards are the masters]: a shard that is the fp32 master is cast on its way in
        return entry.shard.to(self.device, entry.full.dtype, non_blocking=True)

    # ---- shard values (wherever the shard lives) ---------------------------------------------
    def read_shard(self, entry: PartitionedParam) -> torch.Tensor:
        """The padded shard's values: the shard itself, or a copy read from its swap file."""
        if entry.swap is not None:
            return self.store.copy_out(entry.swap, torch.device("cpu"))
        if entry.stored is not None:
            values = torch.empty(entry.stored.numel, dtype=entry.full.dtype, device=entry.shard.device)
            dequantize_into(*entry.stored.split(entry.shard), entry.stored, values)
            return values
        return entry.shard

    def write_shard(self, entry: PartitionedParam, values: torch.Tensor) -> None:
        """The shard's first `values.numel()` elements become `values` (cast); the padding after
        them stays zero."""
        if entry.swap is not None:
            self.store.write(entry.swap, values)
        elif entry.stored is not None:
            padded = torch.zeros(entry.stored.numel, dtype=torch.float32, device=entry.shard.device)
            padded[: values.numel()].copy_(values.reshape(-1))
            quantize_into(padded, entry.stored, *entry.stored.split(entry.shard))
        else:
            entry.shard[: values.numel()].copy_(values.reshape(-1))

    def saved_piece(self, entry: PartitionedParam, offset: int, count: int) -> Any:
        """`count` of the shard's elements from `offset` for a checkpoint, in the compute dtype: a
        view, a cast copy of a shard that is the fp32 master, or a piece read from the swap file only
        when the writer gets to it ([Note: streamed save])."""
        if entry.swap is not None:
            return self.store.lazy_piece(entry.swap, count, offset)
        if entry.stored is not None:
            return self.read_shard(entry)[offset:offset + count]
        return entry.shard[offset:offset + count].detach().to(entry.full.dtype)

    def read_ahead(self, entries: Iterable[PartitionedParam]) -> None:
        """Start reading these swapped shards (upcoming in the recorded order) into free staging
        buffers ([Note: NVMe parameter shards]); nothing without a store."""
        if self.store is not None:
            self.store.read_ahead([entry.swap for entry in entries if entry.swap is not None])

    def wait(self, entry: PartitionedParam) -> None:
        """Block until `entry` is gathered, then point the parameter at the full data."""
        if entry.state is not ParamState.GATHERING:
            return
        if isinstance(entry.pending, _GatherBatch):
            entry.pending.finish(self.waiter)
        else:
            self.waiter(entry.pending)
            entry.pending = None
            _point_at_full(entry)

    def release(self, entry: PartitionedParam, force: bool = False) -> bool:
        """Free the gathered data unless persistent or in use; True if released."""
        if entry.state is ParamState.RELEASED or (entry.persistent and not force):
            return False
        if entry.users > 0 and not force:
            return False
        self.wait(entry)  # an in-flight collective still writes into the buffer
        if self.secondary is not None and entry.secondary is None and not entry.persistent and entry.stored is None:
            self._keep_secondary(entry)
        entry.param.data = _placeholder(entry.full)
        entry.full.untyped_storage().resize_(0)
        entry.state = ParamState.RELEASED
        entry.pinned_until_backward_end = False
        if not entry.persistent:
            self.live_elements -= entry.numel
        return True

    def _keep_secondary(self, entry: PartitionedParam) -> None:
        """hpZ: keep this rank's piece of the gathered values for the next gathers of `entry`."""
        comm = self._secondary_comm
        width = entry.full.numel() // comm.world_size
        entry.secondary = entry.full[comm.rank * width:(comm.rank + 1) * width].clone()
        self.secondary_elements += width

    def expire_secondaries(self, entries: Iterable[PartitionedParam]) -> None:
        """The shards of `entries` changed (optimizer step, load, modification): drop their hpZ pieces."""
        for entry in entries:
            if entry.secondary is not None:
                self.secondary_elements -= entry.secondary.numel()
                entry.secondary = None

    def refresh_persistent(self, persistent: list[PartitionedParam]) -> None:
        """After their shards changed (optimizer step, load): re-gather these persistent entries."""
        for entry in persistent:
            self.release(entry, force=True)
        self.gather(persistent)
        for entry in persistent:
            self.wait(entry)

    def repartition_from_full(self, entry: PartitionedParam) -> None:
        """The gathered data was modified (GatheredParameters): take this rank's piece as shard."""
        flat = entry.full[: entry.numel]
        start, end = split_evenly(entry.numel, self.comm.world_size, self.comm.rank)
        self.expire_secondaries([entry])
        self.write_shard(entry, flat[start:end])
        if entry.master is not None:
            entry.master[: end - start].copy_(flat[start:end])

    def attach(self, coordinator: Any) -> None:
        """An engine's hooks now use these partitions: from here the registry holds them weakly
        ([Note: stage-3 parameter registry]); the engine owns them."""
        self.coordinator = coordinator
        for entry in self.entries:
            _REGISTRY[entry.param] = (weakref.ref(self), weakref.ref(entry))

    def forget(self, entry: PartitionedParam) -> None:
        """Hand `entry`'s parameter over to another owner (the engine adopting an Init partition)."""
        self.release(entry, force=True)
        self.expire_secondaries([entry])
        self.entries.remove(entry)
        if entry.persistent:
            self.persistent_elements -= entry.numel
        if _registered_to(entry.param, self):
            del _REGISTRY[entry.param]

    def close(self) -> None:
        """Forget the registry entries; parameters are left gathered so the module stays usable."""
        self.expire_secondaries(self.entries)
        self.secondary = None
        for entry in self.entries:
            if entry.wire_dtype is not None:  # gathered in a lower precision: re-gather the exact values
                self.release(entry, force=True)
            self.gather([entry], exact=True)
            self.wait(entry)
            # Detach the parameter from the padded buffer so it owns exactly its elements.
            entry.param.data = entry.full[: entry.numel].view(entry.shape).clone()
            entry.full.untyped_storage().resize_(0)
            if _registered_to(entry.param, self):
                del _REGISTRY[entry.param]
        self.entries.clear()
        self.live_elements = 0
