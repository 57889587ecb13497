"""A save killed mid-write (SIGKILL, no cleanup) is invisible; the previous checkpoint loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.manifest import committed_tags, read_latest
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.environment import RUN_LINEAGE

BIG = 96 << 20  # elements (384 MiB of fp32): the write takes long enough to be caught in the middle

SAVER = textwrap.dedent("""
    import sys, torch
    from rayzero.checkpoint.checkpointer import Checkpointer
    from rayzero.checkpoint.options import CheckpointOptions
    from rayzero.checkpoint.types import ShardedTensor, ShardSpec
    root, big = sys.argv[1], int(sys.argv[2])
    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    small = torch.arange(8, dtype=torch.float32)
    checkpointer.save(root, "global_step10", 10, 1, [ShardedTensor(ShardSpec("module/w", (8,), torch.float32, 0, 8), small)])
    print("committed", flush=True)
    huge = torch.ones(big)
    checkpointer.save(root, "global_step20", 20, 1, [
        ShardedTensor(ShardSpec("module/w", (8,), torch.float32, 0, 8), small + 1),
        ShardedTensor(ShardSpec("module/big", (big,), torch.float32, 0, big), huge)])
    print("second save finished: the test did not kill it in time", flush=True)
""")


def test_killed_save_is_invisible_and_previous_loads(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    # the restarted process is the same run (as `rayzero.fit` makes every attempt of a run): its
    # retention may remove the dead save's files ([Note: retention owns only its own])
    monkeypatch.setenv(RUN_LINEAGE.name, "crash-test-run")
    process = subprocess.Popen([sys.executable, "-c", SAVER, root, str(BIG)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "committed"
    partial = os.path.join(root, "global_step20", "rank00000.safetensors.tmp")
    deadline = time.monotonic() + 60
    while not (os.path.exists(partial) and os.path.getsize(partial) > 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)  # mid-write: no finally blocks, no atexit
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert os.path.exists(os.path.join(root, "global_step20"))  # the debris is there...
    assert [tag for _, tag in committed_tags(root)] == ["global_step10"]  # ...but invisible
    assert read_latest(root) == "global_step10"

    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    spec = ShardSpec("module/w", (8,), torch.float32, 0, 8)
    loaded = checkpointer.load(root, [spec])
    assert loaded.manifest.step == 10 and torch.equal(loaded.read(spec), torch.arange(8, dtype=torch.float32))
    # the next save's retention pass clears the dead save's files
    checkpointer.save(root, "global_step30", 30, 1, [ShardedTensor(spec, torch.zeros(8))])
    checkpointer.wait()  # retention runs after the commit, off the caller's path
    assert not os.path.exists(os.path.join(root, "global_step20"))
