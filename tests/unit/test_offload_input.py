"""Bad NVMe offload input is refused before training starts, naming the key, the path and the fix;
swap files are scratch that a later process never reads and that a dead process leaves behind only
until the next start (issue 9, Deliver 1, "Bad input")."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import rayzero
from rayzero.config.errors import RayZeroValueError

pytestmark = pytest.mark.unit

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
KEY = "zero_optimization.offload_optimizer.nvme_path"


def _init(offload: dict, stage: int = 2):
    config = {**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": offload}}
    return rayzero.initialize(model=torch.nn.Linear(4, 4), config=config)[0]


def test_missing_nvme_path_names_the_key() -> None:
    with pytest.raises(RayZeroValueError, match=f"{KEY} = null: device \"nvme\" needs a directory"):
        _init({"device": "nvme"})


def test_a_missing_nvme_path_is_refused_not_created(tmp_path) -> None:
    """Issue 21: a mistyped path must not put swap files on another disk."""
    target = tmp_path / "local_nvmee"
    with pytest.raises(RayZeroValueError, match=f"{KEY}='{target}' does not exist on node .*mkdir -p {target}"):
        _init({"device": "nvme", "nvme_path": str(target)})
    assert not target.exists()


def test_unwritable_nvme_path_names_key_and_path(tmp_path) -> None:
    if os.geteuid() == 0:
        return  # root writes anywhere; the missing-path refusal is tested above
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(RayZeroValueError, match=f"{KEY}='{locked}' is not writable"):
        _init({"device": "nvme", "nvme_path": str(locked)})


def test_swap_files_are_scratch_removed_on_close_and_after_a_crash(tmp_path) -> None:
    engine = _init({"device": "nvme", "nvme_path": str(tmp_path)})
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    swap_dir = engine.strategy.offload.directory
    assert os.path.dirname(swap_dir) == str(tmp_path / "rayzero-swap")
    assert [f for f in os.listdir(swap_dir) if f.endswith(".swp")], "the state went to a swap file"
    engine.close()
    assert not os.path.exists(swap_dir)
    # A process killed mid-run leaves its directory; the next start on this host removes it.
    crashed = subprocess.run([sys.executable, "-c", (
        "import os, torch, rayzero\n"
        f"cfg = {{**{BASE!r}, 'zero_optimization': {{'stage': 1, 'offload_optimizer': "
        f"{{'device': 'nvme', 'nvme_path': {str(tmp_path)!r}}}}}}}\n"
        "e = rayzero.initialize(model=torch.nn.Linear(4, 4), config=cfg)[0]\n"
        "e.backward(e(torch.ones(2, 4)).sum()); e.step()\n"
        "os._exit(9)\n")], check=False)
    assert crashed.returncode == 9
    left = [d for d in os.listdir(tmp_path / "rayzero-swap") if d.startswith(socket.gethostname())]
    assert len(left) == 1
    again = _init({"device": "nvme", "nvme_path": str(tmp_path)}, stage=1)
    assert not os.path.exists(tmp_path / "rayzero-swap" / left[0])
    again.close()


def test_cpu_step_threads_are_shared_by_the_ranks_of_a_host(monkeypatch) -> None:
    from rayzero.engine.offload.host import cpu_threads, step_thread_budget

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert step_thread_budget() == max(1, cores // 2)
    monkeypatch.setenv("RAYZERO_CPU_STEP_THREADS", "3")
    assert step_thread_budget() == 3
    torch.set_num_threads(2)
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with cpu_threads(3):  # a cap, not a raise
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("aio, in_flight", [
    ({}, 8),  # DeepSpeed's defaults: one thread, queue_depth 8
    ({"queue_depth": 4, "intra_op_parallelism": 2}, 8),
    ({"queue_depth": 4, "thread_count": 3}, 12),  # the legacy name of intra_op_parallelism
    ({"queue_depth": 4, "intra_op_parallelism": 2, "single_submit": True}, 2),
    ({"queue_depth": 4, "intra_op_parallelism": 2, "overlap_events": False}, 2),
])
def test_aio_knobs_set_the_requests_in_flight(aio: dict, in_flight: int) -> None:
    """[Note: swap I/O layer]: threads x queue_depth requests at once; single_submit or
    overlap_events=false wait for each request before the next, one per thread."""
    from rayzero.config import load_config
    from rayzero.engine.offload.swap_io import IOKnobs

    config = load_config({**BASE, "aio": aio})
    assert IOKnobs.from_config(config.aio).in_flight == in_flight
