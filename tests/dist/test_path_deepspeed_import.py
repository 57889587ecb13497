"""From DeepSpeed (issue 13 item 3): checkpoints DeepSpeed 0.19.8 writes on CPU (2 ranks, ZeRO stages
1-3) are imported with `rayzero checkpoint import-deepspeed`, and continuing in rayzero matches
continuing in DeepSpeed within 1e-5 over 10 steps (same stage, and a stage-3 checkpoint continued at
stage 2). The masters also equal DeepSpeed's own zero_to_fp32 reconstruction."""
from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("deepspeed")
from path_ds_workers import STEPS_AFTER, deepspeed_worker, rayzero_one_rank_worker, rayzero_worker
from testkit.harness import spawn

from rayzero.checkpoint.cli import main as checkpoint_cli

STAGES = (1, 2, 3)
_RESULT: dict = {}


def _deepspeed() -> tuple[list[dict], str]:
    if not _RESULT:
        directory = tempfile.mkdtemp(prefix="rayzero-ds-")
        _RESULT["ranks"] = spawn(2, deepspeed_worker, {"dir": directory, "stages": list(STAGES)})
        _RESULT["dir"] = directory
    return _RESULT["ranks"], _RESULT["dir"]


def test_continuing_an_imported_deepspeed_checkpoint_matches_deepspeed(tmp_path, capsys):
    ranks, directory = _deepspeed()
    for stage in STAGES:
        assert checkpoint_cli(["import-deepspeed", f"{directory}/stage{stage}", str(tmp_path / f"rz{stage}")]) == 0
        assert "wrote" in capsys.readouterr().out
    runs = [(str(tmp_path / f"rz{stage}"), stage) for stage in STAGES] + [(str(tmp_path / "rz3"), 2)]
    continued = spawn(2, rayzero_worker, {"runs": runs})
    for rank in (0, 1):
        for (source, target_stage), losses in continued[rank].items():
            expected = ranks[rank][int(source[-1])]  # DeepSpeed's losses continuing the same checkpoint
            assert len(losses) == STEPS_AFTER
            worst = max(abs(a - b) for a, b in zip(losses, expected))
            assert worst <= 1e-5, (source, target_stage, rank, worst)


def test_the_imported_masters_equal_deepspeed_zero_to_fp32(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    _, directory = _deepspeed()
    for stage in STAGES:
        assert checkpoint_cli(["import-deepspeed", f"{directory}/stage{stage}", str(tmp_path / f"rz{stage}")]) == 0
        out = tmp_path / f"stage{stage}.safetensors"
        assert checkpoint_cli(["consolidate", str(tmp_path / f"rz{stage}"), str(out)]) == 0
        ours = load_file(str(out))
        theirs = get_fp32_state_dict_from_zero_checkpoint(f"{directory}/stage{stage}")
        assert set(ours) == set(theirs)
        for name, value in theirs.items():
            assert torch.equal(ours[name], value.contiguous() if hasattr(value, "contiguous") else value), name


def test_an_imported_checkpoint_continues_at_another_world_size(tmp_path):
    ranks, directory = _deepspeed()
    assert checkpoint_cli(["import-deepspeed", f"{directory}/stage2", str(tmp_path / "rz2")]) == 0
    (final,) = spawn(1, rayzero_one_rank_worker, {"source": str(tmp_path / "rz2")})
    expected = ranks[0]["final_stage2"]
    assert set(final) == set(expected)
    for name, value in final.items():
        assert torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6), name
