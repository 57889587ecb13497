"""The config's `checkpoint` tier settings take effect in a real 2-rank gloo job, and an async save
commits even when the loop returns without waiting ([Note: async save completion] in saver.py).

One spawned group runs every case; its last case saves asynchronously and returns at once, after
which the harness destroys the process group and the processes exit, exactly as a Ray worker does
after the loop. The parent then checks what is on disk.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch
from testkit.harness import spawn

from rayzero.checkpoint.manifest import MANIFEST, committed_tags, read_latest, read_manifest, shard_file_name
from rayzero.checkpoint.retention import OWNER_FILE
from rayzero.checkpoint.saver import wait_for_pending_saves
from rayzero.engine.api import initialize


def _engine(checkpoint: dict, width: int = 32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
              "zero_optimization": {"stage": 2}, "checkpoint": checkpoint}
    engine, *_ = initialize(model=model, config=config)
    return engine


def _step(engine, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(4, 16, generator=generator), torch.randn(4, 1, generator=generator)
    engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
    engine.step()


def _tags(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("global_step"))


def _cases(rank: int, world: int, root: str) -> dict:
    results = {}
    # 1. keep_last=1, async_save=false, durable_uri: the save returns committed; one tag is kept.
    local, durable = os.path.join(root, "sync"), os.path.join(root, "bucket")
    engine = _engine({"keep_last": 1, "async_save": False, "durable_uri": f"file://{durable}", "timeout_s": 60})
    for step in range(3):
        _step(engine, step)
        engine.save_checkpoint(local)
        # no wait: committed already, on every rank
        tag = f"global_step{step + 1}"
        assert os.path.exists(os.path.join(local, tag, MANIFEST)), (rank, tag)
        assert read_latest(local) == tag
    engine.wait_for_checkpoint()
    engine.wait_for_checkpoint()  # idempotent: nothing in flight, returns at once
    del engine
    # 2. the environment overrides the config: keep_last 1 in the config, 2 from the environment.
    os.environ["RAYZERO_CHECKPOINT_KEEP_LAST"] = "2"
    try:
        overridden = os.path.join(root, "env")
        engine = _engine({"keep_last": 1})
        for step in range(3):
            _step(engine, step)
            engine.save_checkpoint(overridden)
        engine.wait_for_checkpoint()
        del engine
    finally:
        del os.environ["RAYZERO_CHECKPOINT_KEEP_LAST"]
    # 3. a runner finishes every save in flight whatever still holds the engine
    engine = _engine({"durable_uri": f"file://{os.path.join(root, 'bucket-runner')}"}, width=4096)
    _step(engine, 0)
    engine.save_checkpoint(os.path.join(root, "runner"))
    results["runner_waited"] = [wait_for_pending_saves(), wait_for_pending_saves()]
    results["runner_committed"] = read_latest(os.path.join(root, "bucket-runner"))
    engine.wait_for_checkpoint()  # nothing left: returns at once, raises nothing
    del engine
    # 4. async save (the default) and return at once: big enough that the write outlasts the return.
    engine = _engine({"durable_uri": f"file://{os.path.join(root, 'bucket-async')}", "timeout_s": 60}, width=65536)
    _step(engine, 0)
    engine.save_checkpoint(os.path.join(root, "async"))
    results["in_flight_at_return"] = engine.checkpointer.saver.in_flight
    return results


def test_config_settings_take_effect_and_unwaited_async_save_commits(tmp_path):
    root = str(tmp_path)
    results = spawn(2, _cases, root, timeout_s=300)
    for result in results:
        assert result["runner_waited"] == [1, 0] and result["runner_committed"] == "global_step1"
    # the leader (rank 0) applies retention after the other ranks finished: check once all exited
    assert [tag for _, tag in committed_tags(os.path.join(root, "env"))] == ["global_step3", "global_step2"]
    assert _tags(os.path.join(root, "sync")) == ["global_step3"]
    durable = os.path.join(root, "bucket")
    assert _tags(durable) == ["global_step3"] and read_latest(durable) == "global_step3"
    assert sorted(os.listdir(os.path.join(durable, "global_step3"))) == \
        sorted([MANIFEST, OWNER_FILE, shard_file_name(0), shard_file_name(1)])
    # The loop returned with the save still running, and nobody called wait_for_checkpoint().
    assert any(result["in_flight_at_return"] for result in results)
    async_dir = pathlib.Path(root, "async")
    assert read_latest(str(async_dir)) == "global_step1"
    manifest = read_manifest(str(async_dir / "global_step1"))
    assert manifest.world_size == 2 and set(manifest.files) == set(
        os.listdir(async_dir / "global_step1")) - {MANIFEST, OWNER_FILE}
    assert read_latest(os.path.join(root, "bucket-async")) == "global_step1"


_SCRIPT = """
import sys, torch
from rayzero.engine.api import initialize
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 65536), torch.nn.Tanh(), torch.nn.Linear(65536, 1))
ENGINE, *_ = initialize(model=model, config={"train_micro_batch_size_per_gpu": 4, "optimizer":
    {"type": "SGD", "params": {"lr": 0.01}}, "checkpoint": {"durable_uri": "file://" + sys.argv[2]}})
loss = ENGINE(torch.randn(4, 16)).pow(2).mean()
ENGINE.backward(loss)
ENGINE.step()
ENGINE.save_checkpoint(sys.argv[1])
print("in flight at exit:", ENGINE.checkpointer.saver.in_flight)
"""


def test_script_exiting_during_an_async_save_still_commits_and_uploads(tmp_path):
    """A plain script (one process, the engine a module global, so it is never released before
    exit) ends right after save_checkpoint: the interpreter's exit must finish the save, upload included."""
    local, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(local), str(bucket)], check=False,
                          capture_output=True,
                          text=True, timeout=240, env={**os.environ, "RAYZERO_CHECKPOINT_DIR": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in flight at exit: True" in done.stdout
    assert read_latest(str(local)) == "global_step1" and read_latest(str(bucket)) == "global_step1"
    assert sorted(os.listdir(bucket / "global_step1")) == sorted([MANIFEST, OWNER_FILE, shard_file_name(0)])
    assert "failed" not in done.stderr, done.stderr[-3000:]
