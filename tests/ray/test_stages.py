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


def crashing_loop(config):
    import os

    import torch

    context = rayzero.get_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, _, _, _ = rayzero.initialize(model=model)  # the run's config, from the environment
    start = 0
    if context.resume_from:
        _, client_state = engine.load_checkpoint(context.resume_from)
        start = client_state["step"]
    generator = torch.Generator().manual_seed(context.rank)
    for step in range(start + 1, 11):
        inputs = torch.randn(16, 8, generator=generator)
        loss = ((engine(inputs) - inputs.sum(1, keepdim=True)) ** 2).mean()
        engine.backward(loss)
        engine.step()
        if step == 5 and context.attempt == 0:
            engine.save_checkpoint(client_state={"step": step})
            engine.wait_for_checkpoint()
        rayzero.report({"step": step, "attempt": context.attempt, "resume_from": context.resume_from})
        if step == 7 and context.attempt == 0 and context.rank == 1:
            os._exit(1)  # the worker process dies, as on an OOM kill


def test_a_dead_worker_restarts_the_group_from_the_newest_committed_checkpoint(local_ray, tmp_path):
    result = rayzero.fit(
        crashing_loop, config=_config(2), scaling=rayzero.ScalingConfig(num_workers=2),
        run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="crash", progress_interval_s=30),
        failure=rayzero.FailureConfig(max_failures=1),
    )
    checkpoint_dir = str(tmp_path / "crash" / "checkpoints")
    resumed = [m for m in result.metrics_history if m["attempt"] == 1]
    assert [m["step"] for m in resumed] == [6, 7, 8, 9, 10]  # continued after the step-5 checkpoint
    assert {m["resume_from"] for m in resumed} == {checkpoint_dir}
    assert [m["step"] for m in result.metrics_history if m["attempt"] == 0][:5] == [1, 2, 3, 4, 5]
