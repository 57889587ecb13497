"""`GatheredParameters`: read, or modify on one rank, full stage-3 parameters.

Every rank must enter the context together (it all-gathers). With `modifier_rank=r`, the values
rank r leaves in the parameters when the context exits are broadcast to every rank and
re-partitioned: each rank's compute-dtype shard *and* fp32 master shard take their piece, so the
change survives the next optimizer step (DeepSpeed's semantics). Parameters that are not stage-3
partitioned are left alone, so the same code runs under every stage.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.stage3.parameters import (
    ParamPartitions,
    PartitionedParam,
    lookup,
    register_external_parameter,
)


class GatheredParameters:
    """Context manager: gather `params` on entry; on exit broadcast from `modifier_rank` (if any),
    re-partition, and release.

    `params` is a parameter or an iterable of them (e.g. `module.parameters()`); `modifier_rank` is
    the rank (in the partitions' process group) whose modifications are kept, None for read-only;
    `enabled=False` makes the context a no-op (DeepSpeed's signature); `fwd_module`, as in
    DeepSpeed, also registers the parameters as external parameters of that module, so its forward
    gathers them later too.
    """

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
                 modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._items: list[tuple[ParamPartitions, PartitionedParam]] = []
        seen: set[int] = set()
        for param in params if enabled else []:
            found = lookup(param)
            if found is not None and id(found[1]) not in seen:
                seen.add(id(found[1]))
                self._items.append(found)
        if fwd_module is not None:
            for _, entry in self._items:
                register_external_parameter(fwd_module, entry.param)
        if modifier_rank is not None and self._items:
            world = self._items[0][0].comm.world_size
            if not 0 <= modifier_rank < world:
                raise RayZeroValueError(f"GatheredParameters(modifier_rank={modifier_rank}) is not a rank of the "
                                 f"{world}-rank process group the parameters are partitioned over")

    def __enter__(self) -> GatheredParameters:
        for owner, entry in self._items:
            if entry.wire_dtype is not None and entry.users == 0:
                owner.release(entry, force=True)  # gathered in torch_autocast's dtype (e.g. persistent)
            owner.gather([entry], exact=True)  # the exact values, also of a weight forward gathers in 16 bits
        for owner, entry in self._items:
            owner.wait(entry)
            entry.users += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        for _, entry in self._items:
            entry.users -= 1
        if self.modifier_rank is not None and exc_info[0] is None:
            with torch.no_grad():
                for owner, entry in self._items:
                    # Broadcast the padded buffer (padding included) so every rank's piece is exact.
                    owner.comm.broadcast(entry.full, src=self.modifier_rank)
                    owner.repartition_from_full(entry)
        for owner, entry in self._items:
            if entry.users == 0 and not entry.persistent:
                owner.release(entry)
