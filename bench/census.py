"""A census of the tensor memory a process holds, found from the outside: no engine's own counters.

Every tensor Python can reach is counted once per storage (a view, a `.data` alias or a flat
buffer's slices count their storage once, at its full size), from three sources:
- every tensor object the garbage collector tracks (torch tensors are GC-tracked, so a tensor held
  in any Python container, closure or attribute is found, whoever holds it);
- each module's parameters, buffers and `.grad`s (a `.grad` can exist with no Python object until
  it is read);
- the state of every `torch.optim.Optimizer` object the collector knows.
Tensor subclasses that wrap others (FSDP2's DTensor) are counted through their inner tensors.
What Python cannot reach (autograd's saved tensors, a collective library's own buffers) is not a
tensor the census sees; between backward and the optimizer step autograd holds none.

With `resident=True` the census also reads how many of each storage's pages are resident
(mincore(2)): on the CPU an allocation's untouched pages cost no memory (DeepSpeed's stage-3 reduce
bucket of 5e8 elements is 1 GB allocated, a model's size touched), so that reading is the one to
set against resident memory.

Each storage is put in the first kind it is found as: `param` (a module parameter's data), `grad`,
`optimizer_state`, then `other` (master weights, gradient shards, bucket buffers, gathered
copies: whatever an engine keeps beside the module), and its bytes are also summed by dtype.
Storages present in `baseline` (a census taken earlier, which keeps them alive so that no new
storage can reuse their address) are left out: what the census measures is what came after.

Used by bench/memory.py (where a run's memory went, per row) and by tests/dist/test_census_memory.py
(bytes per parameter against the ZeRO formula).
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import mmap
from collections.abc import Iterable, Iterator

import torch

KINDS = ("param", "grad", "optimizer_state", "other")


@dataclasses.dataclass
class Census:
    """Bytes of live tensor storage by kind and by dtype (storages de-duplicated)."""

    by_kind: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    by_kind_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    """`"kind/dtype"` -> bytes: e.g. `other/float32` holds master weights and fp32 gradient shards."""
    resident_by_kind_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    """The same, counting only pages resident in memory (`take(resident=True)`; else empty)."""
    storages: dict[tuple[str, int], torch.UntypedStorage] = dataclasses.field(default_factory=dict, repr=False)
    """(device, data pointer) -> storage: kept alive so a later census can leave them out."""

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def _leaves(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`tensor`, or the plain tensors inside a wrapper subclass (DTensor: its local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:  # DTensor also names its device mesh, not a tensor
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _leaves(inner)
    else:
        yield tensor


def _resident_bytes(storage: torch.UntypedStorage) -> int:
    """Bytes of the pages under `storage` that are resident (whole pages: a small storage sharing
    a page with others counts that page)."""
    if storage.device.type != "cpu":
        return storage.nbytes()
    page = mmap.PAGESIZE
    start = storage.data_ptr() - storage.data_ptr() % page
    end = -(-(storage.data_ptr() + storage.nbytes()) // page) * page
    pages = ctypes.create_string_buffer((end - start) // page)
    if _LIBC.mincore(start, end - start, pages) != 0:
        return storage.nbytes()
    return min(sum(1 for flags in pages.raw if flags & 1) * page, storage.nbytes())


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def take(modules: Iterable[torch.nn.Module] = (), baseline: Census | None = None, resident: bool = False) -> Census:
    """The census now (see the module docstring); `modules` name which tensors are parameters."""
    gc.collect()
    modules = list(modules)
    tensors, optimizers = [], []
    for candidate in gc.get_objects():  # one pass: a process holds ~10^5 objects
        if isinstance(candidate, torch.Tensor):
            tensors.append(candidate)
        elif isinstance(candidate, torch.optim.Optimizer):
            optimizers.append(candidate)
    sources: list[tuple[str, Iterable[torch.Tensor]]] = [
        ("param", [p for m in modules for p in m.parameters()]),
        ("grad", [p.grad for m in modules for p in m.parameters() if p.grad is not None]),
        ("other", [b for m in modules for b in m.buffers()]),
        ("optimizer_state", [value for optimizer in optimizers for state in optimizer.state.values()
                             for value in state.values() if isinstance(value, torch.Tensor)]),
        ("other", tensors),
    ]
    skip = baseline.storages if baseline is not None else {}
    found = Census()
    for kind, tensors in sources:
        for outer in tensors:
            for tensor in _leaves(outer):
                if tensor.is_meta or tensor.layout != torch.strided:
                    continue
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr())
                if storage.nbytes() == 0 or key in found.storages or key in skip:
                    continue
                found.storages[key] = storage
                found.by_kind[kind] += storage.nbytes()
                dtype = str(tensor.dtype).removeprefix("torch.")
                found.by_dtype[dtype] = found.by_dtype.get(dtype, 0) + storage.nbytes()
                name = f"{kind}/{dtype}"
                found.by_kind_dtype[name] = found.by_kind_dtype.get(name, 0) + storage.nbytes()
                if resident:
                    found.resident_by_kind_dtype[name] = (found.resident_by_kind_dtype.get(name, 0)
                                                          + _resident_bytes(storage))
    return found
