"""An independent count of the bytes a rank sends, by link class: a wrapper around torch.distributed.

The oracle of the engine's per-link counters ([Note: bytes per link class] in rayzero/engine/comm.py):
it sees only the calls that reach torch.distributed (what gloo or NCCL is asked to move), never the
engine's bookkeeping, and applies the same point-to-point model to each call:
  - all_gather_into_tensor / all_gather_single: the input's bytes to each peer;
  - reduce_scatter_tensor / reduce_scatter_single: the output's bytes to each peer;
  - all_reduce: 2 * bytes / group size to each peer; broadcast: the bytes to each peer, from the root;
  - all_to_all_single (equal splits): bytes / group size to each peer.
`install(node_of)` must run in the rank before rayzero is imported: the engine binds some of these
functions when its module loads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

COUNTS = {"intra_node_bytes": 0, "inter_node_bytes": 0, "calls": 0}
_NODE_OF: Callable[[int], int] = lambda rank: 0  # noqa: E731 - replaced by install()


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _add(group: Any, per_peer: int) -> None:
    me = dist.get_rank()
    peers = [rank for rank in dist.get_process_group_ranks(group or dist.group.WORLD) if rank != me]
    COUNTS["calls"] += 1
    for peer in peers:
        key = "intra_node_bytes" if _NODE_OF(peer) == _NODE_OF(me) else "inter_node_bytes"
        COUNTS[key] += per_peer


def _group_size(group: Any) -> int:
    return len(dist.get_process_group_ranks(group or dist.group.WORLD))


def _wrap(name: str, per_peer: Callable[..., int]) -> None:
    original = getattr(dist, name, None)
    if original is None:
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        _add(group, per_peer(*args, group=group, **{k: v for k, v in kwargs.items() if k != "group"}))
        return original(*args, group=group, **{k: v for k, v in kwargs.items() if k != "group"})

    setattr(dist, name, counted)


def install(node_of: Callable[[int], int]) -> None:
    """Count every collective of this process from now on; `node_of(global rank)` -> node."""
    global _NODE_OF
    _NODE_OF = node_of
    _wrap("all_gather_into_tensor", lambda out, inp, **kw: _nbytes(inp))
    _wrap("all_gather_single", lambda out, inp, **kw: _nbytes(inp))
    _wrap("reduce_scatter_tensor", lambda out, inp, **kw: _nbytes(out))
    _wrap("reduce_scatter_single", lambda out, inp, **kw: _nbytes(out))
    _wrap("all_reduce", lambda tensor, **kw: 2 * _nbytes(tensor) // _group_size(kw.get("group")))
    _wrap("all_to_all_single", lambda out, inp, **kw: _nbytes(inp) // _group_size(kw.get("group")))
    _wrap("broadcast", lambda tensor, src=None, **kw: _nbytes(tensor) if src == dist.get_rank() else 0)


def reset() -> None:
    for key in COUNTS:
        COUNTS[key] = 0
