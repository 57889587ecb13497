"""DeepSpeed's entry point as DeepSpeed's own examples call it: `add_config_arguments(parser)`, then
`initialize(args=args, model=..., model_parameters=..., training_data=...)` with the config named by
`--deepspeed_config`; `config_params` as the older name of `config`; model parallel groups refused."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

import rayzero
from rayzero.config.errors import RayZeroValueError

pytestmark = pytest.mark.unit

CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _dataset() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # what the DeepSpeed launcher passes
    return parser


def test_a_deepspeed_example_script_runs_with_args(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    args = rayzero.add_config_arguments(_parser()).parse_args(
        ["--local_rank", "0", "--deepspeed", "--deepspeed_config", str(path)])
    net = torch.nn.Linear(3, 1)
    engine, optimizer, loader, _ = rayzero.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                      training_data=_dataset())
    assert isinstance(optimizer, torch.optim.SGD) and engine.train_micro_batch_size_per_gpu() == 4
    inputs, targets = next(iter(loader))
    engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
    engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_the_flags_are_deepspeeds():
    deepspeed = pytest.importorskip("deepspeed")  # the bench extra (installed by make)
    ours = {a.dest: (a.option_strings, a.default) for a in rayzero.add_config_arguments(_parser())._actions}
    theirs = {a.dest: (a.option_strings, a.default) for a in deepspeed.add_config_arguments(_parser())._actions}
    assert ours == theirs


def test_config_params_and_the_older_positional_model():
    engine, _, _, _ = rayzero.initialize(torch.nn.Linear(3, 1), config_params=CONFIG)
    assert engine.train_micro_batch_size_per_gpu() == 4
    engine.close()


def test_two_configs_or_model_parallel_groups_are_refused(tmp_path):
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json"))
    with pytest.raises(RayZeroValueError, match="config twice"):
        rayzero.initialize(args=args, model=torch.nn.Linear(3, 1), config=CONFIG)
    with pytest.raises(RayZeroValueError, match="remove mpu"):
        rayzero.initialize(model=torch.nn.Linear(3, 1), config=CONFIG, mpu=object())


def test_the_accessors_trainers_read():
    """HF's Trainer logs `get_global_grad_norm()`, Accelerate reads `was_step_applied()`."""
    torch.manual_seed(0)
    net, reference = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    reference.load_state_dict(net.state_dict())
    engine, _, _, _ = rayzero.initialize(model=net, config={**CONFIG, "gradient_accumulation_steps": 2,
                                                            "gradient_clipping": 1.0})
    inputs = torch.randn(2, 4, 3)
    applied = []
    for micro in range(2):
        engine.backward(engine(inputs[micro]).pow(2).mean())
        engine.step()
        applied.append(engine.was_step_applied())
        (reference(inputs[micro]).pow(2).mean() / 2).backward()
    assert applied == [False, True]
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-6)
    assert engine.get_mom() == [0] and engine.zero_optimization_stage() == 0  # SGD without momentum
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.gradient_clipping() == 1.0
    assert [name for name, _ in engine.named_parameters()] == ["weight", "bias"]
    engine.close()
