"""The checkpoint group's all-gather ([Note: gathering uneven objects] in rayzero/checkpoint/comm.py):
what torch's all_gather_object returns, without padding one large object to world size copies.

Real gloo group of three ranks. The bytes are counted on the tensors handed to torch's collectives
(what gloo moves), not by the code under test."""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from test_checkpoint_reshard import run_group

from rayzero.checkpoint.comm import CheckpointComm

LISTING = [f"rank{rank:05d}.safetensors" for rank in range(4000)]  # one leader's listing, ~100 kB


def _handed_to_collectives(call) -> tuple[object, dict[str, int]]:
    """(call's result, bytes of the tensors passed to torch's all_gather / all_reduce by kind)."""
    counted = {"all_gather": 0, "all_reduce": 0}
    real_gather, real_reduce = dist.all_gather, dist.all_reduce

    def all_gather(outputs, tensor, *args, **kwargs):
        counted["all_gather"] += sum(out.numel() * out.element_size() for out in outputs)
        return real_gather(outputs, tensor, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        counted["all_reduce"] += tensor.numel() * tensor.element_size()
        return real_reduce(tensor, *args, **kwargs)

    modules = (dist, c10d)  # torch's own all_gather_object calls c10d's names
    for module in modules:
        module.all_gather, module.all_reduce = all_gather, all_reduce
    try:
        return call(), counted
    finally:
        for module in modules:
            module.all_gather, module.all_reduce = real_gather, real_reduce


def _body(rank: int, world: int) -> None:
    comm = CheckpointComm()
    cases = {
        "one large, the others nothing (a listing of shared storage)": LISTING if rank == 0 else None,
        "even (each rank's specs)": {"rank": rank, "specs": [f"layer{index}" for index in range(50)]},
        "uneven and odd": [rank] * (rank * 3000) or {"empty": (), "tensor": torch.arange(rank + 2)},
    }
    for case, value in cases.items():
        expected: list = [None] * world
        dist.all_gather_object(expected, value, group=comm.group)  # torch's own, padded
        got, counted = _handed_to_collectives(lambda value=value: comm.all_gather_object(value))
        assert len(got) == world, case
        for mine, theirs in zip(got, expected):
            if isinstance(theirs, dict) and "tensor" in theirs:
                assert torch.equal(mine.pop("tensor"), theirs.pop("tensor")), case
            assert mine == theirs, case
        if case.startswith("one large"):
            # torch's pads each of the three slots to the listing: 3 x ~100 kB on every rank;
            # here the sizes (8 bytes a rank) and one buffer of the bytes there are
            listing = len(pickle.dumps(LISTING))
            assert counted["all_gather"] == 8 * world, counted
            assert listing <= counted["all_reduce"] < listing + 100, (listing, counted)
        if case.startswith("even"):  # one padded all-gather moves the least: kept
            assert counted["all_reduce"] == 0 and counted["all_gather"] > 8 * world, counted


def test_the_gather_returns_what_torch_s_does_without_padding_one_large_object(tmp_path):
    run_group(3, _body)
