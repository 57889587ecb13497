"""One process, no process group: the CLI (ls / verify / consolidate) and the durable tier."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.cli import main as checkpoint_cli
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec

WEIGHTS = {"embed.weight": torch.randn(6, 4), "head.bias": torch.randn(3)}


def _shards(scale: float) -> list[ShardedTensor]:
    shards = []
    for name, value in WEIGHTS.items():
        full = (value * scale).reshape(-1)
        shards.append(ShardedTensor(ShardSpec(f"module/{name}", tuple(value.shape), torch.bfloat16, 0, full.numel()),
                                    full.to(torch.bfloat16)))
        shards.append(ShardedTensor(ShardSpec(f"master/{name}", tuple(value.shape), torch.float32, 0, full.numel()),
                                    full.clone()))
        shards.append(ShardedTensor(ShardSpec(f"optim/exp_avg/{name}", tuple(value.shape), torch.float32, 0,
                                              full.numel()), torch.zeros_like(full)))
    return shards


def _save(checkpointer: Checkpointer, root: str, step: int) -> None:
    checkpointer.save(root, f"global_step{step}", step, 1, _shards(step), extra_state={"global_steps": step})
    checkpointer.wait()


def test_cli_ls_verify_consolidate(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    checkpointer = Checkpointer(CheckpointOptions(keep_last=0))
    for step in (1, 2):
        _save(checkpointer, root, step)
    assert checkpoint_cli(["ls", root]) == 0
    listing = capsys.readouterr().out
    assert "global_step2" in listing and "<- latest" in listing.splitlines()[1]
    assert checkpoint_cli(["verify", root, "--all"]) == 0

    out = str(tmp_path / "model.safetensors")
    assert checkpoint_cli(["consolidate", root, out]) == 0
    consolidated = load_file(out)
    assert set(consolidated) == set(WEIGHTS)  # keyed by module names, from the fp32 masters
    for name, value in WEIGHTS.items():
        assert consolidated[name].dtype == torch.float32 and torch.equal(consolidated[name], value * 2)
    out_torch = str(tmp_path / "model.pt")
    assert checkpoint_cli(["consolidate", os.path.join(root, "global_step1"), out_torch, "--format", "torch",
                           "--dtype", "bfloat16"]) == 0
    loaded = torch.load(out_torch, weights_only=True)
    for name, value in WEIGHTS.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], value.to(torch.bfloat16))

    shard = os.path.join(root, "global_step2", "rank00000.safetensors")
    with open(shard, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 1]))
    capsys.readouterr()
    assert checkpoint_cli(["verify", root]) == 1
    assert "CHECKSUM MISMATCH" in capsys.readouterr().out
    os.remove(shard)
    assert checkpoint_cli(["verify", os.path.join(root, "global_step2")]) == 1
    assert "MISSING" in capsys.readouterr().out
    assert checkpoint_cli(["verify", str(tmp_path / "nowhere")]) == 1


def test_consolidate_writes_every_name_of_a_tied_weight(tmp_path):
    # the shards hold a tied weight once; a plain module's state_dict (strict load) names both
    root = str(tmp_path / "ckpt")
    checkpointer = Checkpointer(CheckpointOptions(keep_last=0))
    checkpointer.save(root, "global_step1", 1, 1, _shards(1),
                      extra_state={"global_steps": 1, "tied_parameters": {"head.weight": "embed.weight"}})
    checkpointer.wait()
    for fmt, out in (("safetensors", tmp_path / "model.safetensors"), ("torch", tmp_path / "model.pt")):
        assert checkpoint_cli(["consolidate", root, str(out), "--format", fmt]) == 0
        consolidated = load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
        assert set(consolidated) == set(WEIGHTS) | {"head.weight"}
        assert torch.equal(consolidated["head.weight"], WEIGHTS["embed.weight"])


def test_durable_copy_restores_a_lost_save_dir(tmp_path):
    root, bucket = str(tmp_path / "local"), tmp_path / "bucket"
    options = CheckpointOptions(durable_uri=f"file://{bucket}", keep_last=2, upload_threads=4)
    checkpointer = Checkpointer(options)
    for step in (1, 2, 3):
        _save(checkpointer, root, step)
    assert sorted(os.listdir(bucket)) == ["global_step2", "global_step3", "latest"]  # retention there too
    shutil.rmtree(root)  # the node's disk is gone
    needed = [shard.spec for shard in _shards(1)]
    loaded = Checkpointer(options).load(root, needed)
    assert loaded.source == "durable" and loaded.manifest.step == 3
    for shard in _shards(3):
        assert torch.equal(loaded.read(shard.spec), shard.local)


def test_user_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYZERO_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="replicas"):
        CheckpointOptions(replicas=-1)
    with pytest.raises(ValueError, match="durable_uri"):
        _ = Checkpointer(CheckpointOptions(durable_uri="nosuchscheme://x")).saver
    with pytest.raises(ValueError, match="RAYZERO_CHECKPOINT_DIR"):
        Checkpointer().resolve_dir(None)


def test_fence_holds_updates_until_the_background_snapshot_is_taken(tmp_path):
    """With the fence promised, save() returns before copying; an update after fence() must not leak
    into the checkpoint (it would, were the copy still running)."""
    root = str(tmp_path / "ckpt")
    checkpointer = Checkpointer(CheckpointOptions())
    checkpointer.use_fence()
    live = torch.zeros(16 << 20)  # 64 MiB: the copy takes long enough to race an unfenced update
    spec = ShardSpec("master/w", (live.numel(),), torch.float32, 0, live.numel())
    checkpointer.save(root, "global_step1", 1, 2, [ShardedTensor(spec, live)])
    checkpointer.fence()  # what the engine's optimizer-step pre-hook does
    live.fill_(1.0)  # the optimizer step
    timings = checkpointer.wait()
    assert timings.blocking < timings.total
    assert torch.count_nonzero(checkpointer.load(root, [spec]).read(spec)) == 0


def test_a_remote_uri_as_save_dir_is_staged_locally_and_loaded_back(tmp_path, monkeypatch):
    """save_checkpoint("s3://...")-style locations: local staging + durable copy; loading works with
    the staging gone (mock:// is pyarrow's in-memory filesystem, kept per Checkpointer)."""
    monkeypatch.setenv("RAYZERO_NODE_LOCAL_DIR", str(tmp_path / "node"))
    checkpointer = Checkpointer(CheckpointOptions(keep_last=2))
    for step in (1, 2):
        _save(checkpointer, "mock:///bucket/run/checkpoints", step)
    staged = checkpointer.resolve_dir("mock:///bucket/run/checkpoints")
    assert staged.startswith(str(tmp_path / "node")) and os.path.isdir(os.path.join(staged, "global_step2"))
    shutil.rmtree(staged)
    needed = [shard.spec for shard in _shards(1)]
    loaded = checkpointer.load("mock:///bucket/run/checkpoints", needed)
    assert loaded.source == "durable" and loaded.manifest.step == 2
    for shard in _shards(2):
        assert torch.equal(loaded.read(shard.spec), shard.local)
    assert checkpointer.resolve_dir(f"file://{tmp_path}/x") == f"{tmp_path}/x"


def test_ls_verify_consolidate_accept_the_run_directory_fit_reports(tmp_path, capsys):
    # rayzero.fit reports Result.path = file://<storage>/<name>; checkpoints live in its checkpoints/
    run = tmp_path / "runs" / "exp1"
    _save(Checkpointer(CheckpointOptions(keep_last=0)), str(run / "checkpoints"), 3)
    for location in (str(run), run.as_uri()):
        assert checkpoint_cli(["ls", location]) == 0
        assert "global_step3" in capsys.readouterr().out
        assert checkpoint_cli(["verify", location]) == 0
        assert "OK" in capsys.readouterr().out
        out = tmp_path / "consolidated.safetensors"
        assert checkpoint_cli(["consolidate", location, str(out)]) == 0
        assert torch.equal(load_file(str(out))["head.bias"], WEIGHTS["head.bias"] * 3)


class _Payload:
    """Stands for any object a malicious or foreign checkpoint could carry."""

    def __reduce__(self):
        return (os.getenv, ("HOME",))


def test_import_deepspeed_refuses_a_file_with_foreign_code_and_runs_none_of_it(tmp_path, capsys):
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1, "extra": _Payload()}},
               str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    (tmp_path / "ds" / "latest").write_text("global_step1")
    assert checkpoint_cli(["import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "needs the Python global posix.getenv" in err or "needs the Python global os.getenv" in err
    assert "none of its code ran" in err
    assert not (tmp_path / "out").exists()
    assert checkpoint_cli(["import-deepspeed", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "no DeepSpeed *_optim_states.pt files" in capsys.readouterr().err
