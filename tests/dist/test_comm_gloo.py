"""[Note: gloo's temporary copies]: on gloo, large reduce-scatters (scratch input) and all-gathers are
built from an in-place all-reduce and per-rank broadcasts. The oracle is torch's own gloo
collectives on the same inputs: results must be bitwise equal, through the sync and async paths,
the in-place gather, 3 ranks and a second process group; and the kernel's high-water mark (VmHWM)
shows the full-size temporary gone."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from testkit.harness import spawn

pytestmark = pytest.mark.dist


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _extra_mib(fn) -> float:
    """MiB the process's peak rose by while running `fn` (touching nothing new itself)."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - start) / 1024


def _check(rank: int, world: int, _: object) -> dict:
    from rayzero.engine.comm import (
        GLOO_DIRECT_MIN_ELEMENTS,
        Communicator,
        _all_gather_flat,
        _reduce_scatter_flat,
    )

    comm = Communicator()
    other = dist.new_group(backend="gloo")
    assert comm.gloo
    out: dict = {"mismatch": [], "memory": {}}
    for shard in (GLOO_DIRECT_MIN_ELEMENTS // world + 7, GLOO_DIRECT_MIN_ELEMENTS):
        full = shard * world
        source = torch.randn(full, generator=torch.Generator().manual_seed(rank * 100 + shard))
        expected = torch.empty(shard)
        _reduce_scatter_flat(expected, source.clone(), op=dist.ReduceOp.SUM)
        for async_op in (False, True):
            for group in (None, other):
                on = comm if group is None else Communicator(other)
                got = torch.full((shard,), float("nan"))
                work = on.reduce_scatter(got, source.clone(), async_op=async_op, scratch=True)
                if async_op:
                    work.get_future().wait()
                    work.wait()
                    assert work.is_completed()
                if not torch.equal(got, expected):
                    out["mismatch"].append(("reduce_scatter", shard, async_op, group is not None))
        piece = source[:shard].clone()
        gathered = torch.empty(full)
        _all_gather_flat(gathered, piece)
        for async_op in (False, True):
            got = torch.full((full,), float("nan"))
            work = comm.all_gather(got, piece, async_op=async_op)
            if async_op:
                work.wait()
            in_place = torch.full((full,), float("nan"))
            in_place.view(world, shard)[rank].copy_(piece)
            work = comm.all_gather(in_place, in_place.view(world, shard)[rank], async_op=async_op)
            if async_op:
                work.wait()
            for name, result in (("all_gather", got), ("all_gather in place", in_place)):
                if not torch.equal(result, gathered):
                    out["mismatch"].append((name, shard, async_op))
    # Memory: 16 MiB of full tensor, buffers allocated and touched beforehand.
    shard = 4 * GLOO_DIRECT_MIN_ELEMENTS // world
    big, small = torch.ones(shard * world), torch.ones(shard)
    out["memory"] = {
        "reduce_scatter torch": _extra_mib(lambda: _reduce_scatter_flat(small, big, op=dist.ReduceOp.SUM)),
        "reduce_scatter rayzero": _extra_mib(lambda: comm.reduce_scatter(small, big, scratch=True)),
        "all_gather torch": _extra_mib(lambda: _all_gather_flat(big, small)),
        "all_gather rayzero": _extra_mib(lambda: comm.all_gather(big, small)),
        "full MiB": shard * world * 4 / 2**20,
    }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_direct_collectives_equal_torch_and_skip_its_copies(world):
    # glibc returns freed large blocks (a fixed mmap threshold): a peak is what was live
    results = spawn(world, _check, mmap_threshold=131072)
    for rank, result in enumerate(results):
        assert result["mismatch"] == [], f"rank {rank}: {result['mismatch']}"
    memory = results[0]["memory"]
    print(memory)
    full = memory["full MiB"]
    for kind in ("reduce_scatter", "all_gather"):
        # torch's gloo path allocates a temporary of the full size; rayzero's allocates none of it
        assert memory[f"{kind} torch"] >= 0.75 * full, memory
        assert memory[f"{kind} rayzero"] <= 0.25 * full, memory
