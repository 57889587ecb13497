"""Any loop ships (issue 13 item 1): the shapes of tests/ray/path_loops.py run under rayzero.fit, and
what truly cannot be pickled fails before any worker starts with one line naming it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rayzero
from rayzero.driver.shipping import UnshippableLoopError

pytest.importorskip("transformers")
import path_loops

CONFIG = {"train_micro_batch_size_per_gpu": 2}


def _fit(loop, tmp_path, workers=1, config=None, **kwargs):
    return rayzero.fit(loop, config=config or CONFIG, scaling=rayzero.ScalingConfig(num_workers=workers),
                       run=rayzero.RunConfig(storage=tmp_path.as_uri(), progress_interval_s=60), **kwargs)


def test_a_module_level_torch_distributed_alias_ships(local_ray, tmp_path):
    result = _fit(path_loops.dist_alias_loop, tmp_path, workers=2)
    assert result.metrics == {"step": 0, "sum": 3.0, "world": 2}


def test_an_hf_model_from_a_module_level_config_ships_and_resolves_the_model_autos(local_ray, tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    # one worker: the autos come from model.config, not from the world size
    result = _fit(path_loops.hf_model_loop, tmp_path, config=config,
                  trainer={"learning_rate": 1e-3, "per_device_train_batch_size": 2})
    assert result.metrics["hidden"] == 32
    assert result.metrics["reduce_bucket_size"] == 32 * 32  # "auto" = hidden_size², from model.config


def test_torch_ops_a_module_level_tokenizer_lambdas_and_closures_ship(local_ray, tmp_path):
    scale = 7
    times_scale = lambda value: value * scale

    def make_loop(offset):
        def loop(config):
            path_loops.torch_ops_loop(config)  # torch.ops, from the user's (by-value) module
            assert torch.ops.aten.add.Tensor(torch.ones(1), torch.ones(1)).item() == 2.0  # and in a closure
            path_loops.tokenizer_loop(config)  # its module-level tokenizer
            rayzero.report({"step": 1, "value": times_scale(10) + offset})
        return loop

    result = _fit(make_loop(3), tmp_path)
    assert [m["step"] for m in result.metrics_history] == [0, 1]
    # step 0 was reported twice (torch.ops' value, then the token ids): one entry per step, the newest
    assert result.metrics_history[0] == {"step": 0, "ids": [1, 2, 3]}
    assert result.metrics["value"] == 73
    assert _fit(lambda: rayzero.report({"step": 0, "value": scale}), tmp_path).metrics["value"] == 7


def test_an_unpicklable_global_is_named_before_any_worker_starts(local_ray, tmp_path):
    with pytest.raises(UnshippableLoopError) as raised:
        _fit(path_loops.locked_loop, tmp_path)
    message = str(raised.value)
    assert "global 'LOCK'" in message and "_thread.lock" in message and "inside the loop" in message
    assert "\n" not in message


SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import rayzero

    CONFIG = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                        bos_token_id=0, eos_token_id=0)


    def train(config):
        engine, _, _, _ = rayzero.initialize(model=GPT2LMHeadModel(CONFIG))
        ids = torch.randint(0, 32, (2, 4))
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        rayzero.report({"step": 0, "hidden": engine.module.config.hidden_size, "world": dist.get_world_size(),
                        "add": torch.ops.aten.add.Tensor(torch.ones(1), torch.ones(1)).item()})


    if __name__ == "__main__":
        result = rayzero.fit(train, config={"train_micro_batch_size_per_gpu": 2,
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                           "zero_optimization": {"stage": 3,
                                                                 "stage3_prefetch_bucket_size": "auto"}},
                             scaling=rayzero.ScalingConfig(num_workers=2),
                             run=rayzero.RunConfig(storage=STORAGE))
        print("RESULT", result.metrics)
    """
)


def test_the_issue_s_script_run_as_main_ships(local_ray, tmp_path):
    # The exact shape from the issue: a __main__ script aliasing torch.distributed, reading an HF
    # model's config and touching torch.ops. It joins the tests' Ray through RAY_ADDRESS: the loop is
    # pickled before Ray is located, the same either way; starting a Ray of its own is what
    # test_first_hour and test_path_cluster prove.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("STORAGE", repr(tmp_path.as_uri())))
    env = {key: value for key, value in os.environ.items() if key != "RAYZERO_ADDRESS"}
    env["RAY_ADDRESS"] = local_ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT {'step': 0, 'hidden': 16, 'world': 2, 'add': 2.0}" in done.stdout
