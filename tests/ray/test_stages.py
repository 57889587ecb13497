"""The demo's character LM on 2 Ray workers learns under every ZeRO stage, and resumes from its checkpoint."""
from __future__ import annotations

import pytest

import rayzero
from rayzero.demo.train import train_loop

SMALL = {"max_chars": 200_000, "n_layer": 1, "n_embd": 64, "n_head": 4, "block_size": 32}


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
        "zero_optimization": {"stage": stage},
    }


def _losses(result) -> list[float]:
    return [m["loss"] for m in result.metrics_history if "loss" in m]


def _check_falling(losses: list[float], steps: int) -> None:
    assert len(losses) == steps
    assert losses[0] > 4.0  # ln(128) = 4.85: an untrained model
    assert sum(losses[-3:]) / 3 < losses[0] - 0.8, losses


@pytest.mark.parametrize("stage", [0, 1, 2])  # stage 3: the first run of the resume test below
def test_two_workers_report_a_falling_loss_at_every_stage(local_ray, tmp_path, stage):
    result = rayzero.fit(
        train_loop,
        config=_config(stage),
        scaling=rayzero.ScalingConfig(num_workers=2),
        run=rayzero.RunConfig(storage=tmp_path.as_uri(), progress_interval_s=30),
        train_loop_config=dict(SMALL, steps=15, save_checkpoint=False),
    )
    _check_falling(_losses(result), 15)


def test_a_stage_3_run_learns_and_the_next_resumes_from_its_checkpoint(local_ray, tmp_path, capsys):
    """Stage 3's falling loss (the parametrized test's fourth stage), its checkpoint at the end, a second
    run resumed from it with trained weights, and `wall_clock_breakdown`'s per-phase timings."""
    first = rayzero.fit(
        train_loop, config=_config(3), scaling=rayzero.ScalingConfig(num_workers=2),
        run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="first", progress_interval_s=30),
        train_loop_config=dict(SMALL, steps=15),
    )
    _check_falling(_losses(first), 15)
    assert first.checkpoint == str(tmp_path / "first" / "checkpoints")
    assert (tmp_path / "first" / "checkpoints" / "latest").exists()
    second = rayzero.fit(
        train_loop, config=dict(_config(3), wall_clock_breakdown=True),
        scaling=rayzero.ScalingConfig(num_workers=2),
        # the run directory, as the Kubernetes operator passes it: its checkpoints/ is used
        run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="second", resume_from=first.path,
                              progress_interval_s=0),
        train_loop_config=dict(SMALL, steps=18, save_checkpoint=False),
    )
    assert [m["step"] for m in second.metrics_history] == [16, 17, 18]
    # trained weights came back: far below the untrained loss of the first run's first step
    assert _losses(second)[0] < _losses(first)[0] - 0.8
    # wall_clock_breakdown: per-phase timings reported, and shown on the progress line
    assert all(second.metrics[key] > 0 for key in ("forward_ms", "backward_ms", "optimizer_ms"))
    assert "forward_ms" not in first.metrics
    out = capsys.readouterr().out
    assert "| forward_ms " in out and "| optimizer_ms " in out and "wall clock breakdown" in out
