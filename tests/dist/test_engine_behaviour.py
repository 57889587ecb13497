"""Engine behaviours a user notices: fp16 overflow handling, clear errors, config from the
environment, schedulers, data loading, communication dtype, accumulation bookkeeping.
One spawned 2-rank group runs all the behaviour checks; fp16 runs once per stage."""
from __future__ import annotations

import functools
import itertools

import engine_workers as W
import pytest
from testkit import harness as H

WORLD = 2


@functools.cache
def behaviours() -> dict:
    return H.spawn(WORLD, W.behaviours)[0]


@functools.cache
def fp16(stage: int) -> list[dict]:
    return H.spawn(WORLD, W.fp16_overflow, stage)


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_skips_the_step_and_lowers_the_scale(stage: int) -> None:
    ranks = fp16(stage)
    steps = ranks[0]["steps"]
    assert steps[0]["skipped"] and steps[0]["unchanged"], "2^18 overflows fp16: first step skipped"
    assert steps[0]["scale_after"] == steps[0]["scale_before"] / 2
    taken = [s for s in steps if not s["skipped"]]
    assert taken and all(not s["unchanged"] for s in taken), "once the scale fits, steps update weights"
    assert steps[-1]["global_steps"] == len(steps), "skipped steps still count as global steps"
    # step 8: only the last rank's loss is inf, yet every rank skips it and keeps its weights.
    for rank in ranks:
        assert rank["steps"][8]["skipped"] and rank["steps"][8]["unchanged"]
        assert rank["skipped_steps"] == ranks[0]["skipped_steps"] >= 2
    assert not steps[-1]["skipped"] and steps[-1]["scale_after"] < 2**18, "trains on at a lower scale"


def test_unused_parameter_error_names_it_when_not_ignored() -> None:
    message = behaviours()["unused_error"]
    assert message is not None and "unused" in message and "ignore_unused_parameters" in message


def test_untested_optimizer_needs_the_flag() -> None:
    result = behaviours()
    assert "zero_allow_untested_optimizer" in result["untested_error"]
    assert result["untested_allowed_type"] == "Adagrad"
    assert "sum" in result["untested_allowed_state"], "the client optimizer runs on the master shards"


def test_config_from_environment_with_scheduler_and_dataloader() -> None:
    result = behaviours()
    assert result["env_scheduler"] == "WarmupLR"
    lrs = result["env_lrs"]
    # DeepSpeed's linear warmup, stepped once per optimizer step: 0 -> 0.01 over 4 iterations.
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(0.01)
    assert all(a < b for a, b in itertools.pairwise(lrs[1:])), lrs
    assert result["env_samples_seen"] == 30 // WORLD, "ResumableSampler: each rank sees its half"
    assert result["gas_api"] == (1, 5)


def test_communication_data_type_is_honoured() -> None:
    result = behaviours()
    scatter, gather = result["comm_fp32_reduce_scatter"], result["comm_fp32_all_gather"]
    assert scatter["bytes"] == 4 * scatter["elements"], "gradients travel in fp32 as configured"
    assert gather["bytes"] == 2 * gather["elements"], "bf16 parameters are gathered in bf16"


def test_accumulation_boundaries() -> None:
    result = behaviours()
    assert result["boundaries"] == [False, False, True, False, False, True]
    assert result["after_six_micro"] == 2
    assert result["batch_sizes"] == (2, 2 * 3 * WORLD)


def test_initialize_creates_the_process_group_from_the_environment() -> None:
    initialized, world, rank, reduced = behaviours()["env_group"]
    assert initialized and world == WORLD and rank == 0 and reduced


def test_gradient_arriving_twice_is_an_error_not_a_silent_loss() -> None:
    """Reentrant activation checkpointing runs a nested backward: a parameter used inside and
    outside the checkpointed region gets its gradient in two parts, after its bucket may have been
    reduced. The engine must refuse (as DeepSpeed does) and name the fix; non-reentrant works."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import rayzero

    class Reused(torch.nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.inner, self.outer, self.reentrant = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda t: torch.tanh(self.inner(t)), x, use_reentrant=self.reentrant)
            return self.inner(self.outer(h)).pow(2).mean()

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}}
    for reentrant in (False, True):
        engine, *_ = rayzero.initialize(model=Reused(reentrant), config=config)
        x = torch.randn(2, 4, requires_grad=True)
        if reentrant:
            with pytest.raises(RuntimeError, match="use_reentrant=False"):
                engine.backward(engine(x))
        else:
            engine.backward(engine(x))
            engine.step()
            assert engine.global_steps == 1
        engine.close()


def test_a_model_with_nothing_to_train_is_refused() -> None:
    """One process: a model with no parameters, or only frozen ones, is an error naming the fix
    (torch optimizers refuse an empty parameter list), not a run that silently trains nothing."""
    import torch

    import rayzero

    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
    for model in (torch.nn.Identity(), frozen):
        with pytest.raises(ValueError, match="no trainable parameters.*requires_grad"):
            rayzero.initialize(model=model, config=config)
