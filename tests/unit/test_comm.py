"""Communication accounting ([Note: communication accounting]) in a world of one (no process group)."""
from __future__ import annotations

import torch

from rayzero.engine.comm import Communicator


def test_counts_per_kind_in_the_zero_paper_unit_and_rolls_per_step():
    comm = Communicator()
    assert (comm.rank, comm.world_size, comm.distributed) == (0, 1, False)
    grads = torch.ones(10)
    comm.all_reduce(grads)
    out = torch.empty(10)
    comm.reduce_scatter(out, torch.arange(10.0))
    assert torch.equal(out, torch.arange(10.0)), "a world of one reduces to the identity"
    comm.all_gather(torch.empty(6, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16))
    comm.all_reduce_control(torch.ones(()), "max")
    assert comm.last_step()["total"]["calls"] == 0, "nothing is reported before the step closes"
    comm.begin_step()
    stats = comm.last_step()
    local = {"intra_node_bytes": 0, "inter_node_bytes": 0}  # a world of one sends nothing to anyone
    assert stats["all_reduce"] == {"calls": 1, "elements": 10, "bytes": 40, "volume_elements": 20, **local}
    assert stats["reduce_scatter"]["volume_elements"] == 10
    assert stats["all_gather"] == {"calls": 1, "elements": 6, "bytes": 12, "volume_elements": 6, **local}
    assert stats["control"]["calls"] == 1
    assert stats["total"] == {"calls": 3, "elements": 26, "bytes": 92, "volume_elements": 36, **local}
    comm.broadcast(torch.ones(4))
    comm.discard_current()
    comm.begin_step()
    assert comm.last_step()["total"]["calls"] == 0, "discarded traffic belongs to no step"


def test_async_handles_exist_at_world_one():
    comm = Communicator()
    work = comm.all_reduce(torch.ones(3), async_op=True)
    assert work.wait() is True
    buffer = torch.arange(4.0)
    work = comm.all_gather(buffer, buffer[0:4], async_op=True)
    work.wait()
    assert torch.equal(buffer, torch.arange(4.0)), "in-place gather of the own slice keeps the data"
