"""A Lightning script with RayZeroStrategy under real `torchrun --nproc_per_node 2` (issue 20 item 5):
it trains, its ModelCheckpoint files and final `trainer.save_checkpoint` are rayzero checkpoints, and
`rayzero checkpoint consolidate` of them gives the weights plain SGD gives (tests/data/lightning_train.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
from rayzero.ports import server_port
from tests.data import lightning_train

DATA = Path(__file__).resolve().parents[1] / "data"


def _consolidated(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rayzero.checkpoint.cli import main as checkpoint_cli

    out = checkpoint.with_suffix(".safetensors")
    assert checkpoint_cli(["consolidate", str(checkpoint), str(out)]) == 0
    return load_file(out)


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert float((actual[key] - value).abs().max() / value.abs().max()) <= 1e-5, key


def test_a_lightning_script_under_torchrun_writes_rayzero_checkpoints_with_plain_sgds_weights(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(server_port()), str(DATA / "lightning_train.py"), str(tmp_path), "--epochs", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYZERO_COLLECTIVE_TIMEOUT_S="120")
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    _assert_close(_consolidated(checkpoints / "epoch=0-step=4.ckpt"), lightning_train.reference_weights(1))
    _assert_close(_consolidated(tmp_path / "final.ckpt"), lightning_train.reference_weights(2))
