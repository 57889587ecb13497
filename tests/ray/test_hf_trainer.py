"""Hugging Face's own Trainer script under `rayzero run`, unchanged ([Note: the DeepSpeed compatibility
layer], [Note: the Trainer in a rayzero run]).

The script is HF's examples/pytorch/language-modeling/run_clm.py when it is in tests/fixtures/hf
(tests/fixtures/hf/ORIGIN.md), else tests/fixtures/train_clm.py, a Trainer script of the same shape.
Inputs are built offline (tests/fixtures/hf_tiny.py): a tiny GPT-2 saved with save_pretrained, so
every run starts from the same weights, and a BPE tokenizer. The oracle is the same script under
`torchrun --nproc_per_node 2 ... --ddp_backend gloo --use_cpu` without `--deepspeed` (plain DDP).

Weights are compared as max|a - b| over the model divided by max|b| over the model. Without
gradient clipping rayzero's stage-0 run equals DDP bitwise; with clipping (the configs' default 1.0,
as DeepSpeed's) the global norm is summed in another order than torch's clip_grad_norm_, and GPT-2's
attention key bias, whose true gradient is zero (softmax ignores a per-query constant), moves by
Adam-normalised rounding noise: ~3e-7 absolute, so a per-tensor ratio on that one tensor measures
noise (1e-4 of its own tiny values), while the model-wide ratio stays near 1e-6.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")
from tests.fixtures import hf_tiny

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

HF_SCRIPT = FIXTURES / "hf" / "run_clm.py"
SCRIPT = HF_SCRIPT if HF_SCRIPT.is_file() else FIXTURES / "train_clm.py"
STEPS, SAVE_EVERY = 16, 4
TOLERANCE = 1e-5

# The HF DeepSpeed guide's ZeRO-2 and ZeRO-3 CPU-offload configs; `with_scheduler` adds its WarmupLR.
_GUIDE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
ZERO2 = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
         "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
         "contiguous_gradients": True}
ZERO3 = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
         "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
         "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
         "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
         "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
WARMUP_LR = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("hf")
    paths = hf_tiny.build(str(directory / "data"))
    for name, zero, scheduler in (("zero2", ZERO2, None), ("zero3", ZERO3, None), ("zero3_whole", ZERO3, WARMUP_LR)):
        config = dict(_GUIDE, zero_optimization=zero, **({"scheduler": scheduler} if scheduler else {}))
        paths[name] = str(directory / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(config, indent=2))
    return paths


def _script_args(inputs: dict[str, str], output_dir: Path, steps: int = STEPS) -> list[str]:
    return ["--model_name_or_path", inputs["model"], "--tokenizer_name", inputs["tokenizer"],
            "--train_file", inputs["text"], "--block_size", "32", "--do_train", "--per_device_train_batch_size", "2",
            "--max_steps", str(steps), "--learning_rate", "1e-3", "--seed", "0", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_steps", str(SAVE_EVERY), "--report_to", "none",
            "--dataloader_num_workers", "0", "--output_dir", str(output_dir)]


def _environment(local_ray=None) -> dict[str, str]:
    env = dict(os.environ, **hf_tiny.ENV, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if local_ray is not None:
        env["RAY_ADDRESS"] = local_ray.get_runtime_context().gcs_address
    return env


def _rayzero_run(local_ray, project: Path, name: str, script_args: list[str], *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "rayzero.cli", "run", str(SCRIPT), "--workers", "2", "--name", name,
               "--storage", str(project / "runs"), *extra, "--", *script_args]
    return subprocess.Popen(command, cwd=project, env=_environment(local_ray), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, timeout_s: float = 900) -> str:
    output, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def ddp(inputs, tmp_path_factory) -> Path:
    """The same script under torchrun, plain DDP on CPU: the reference weights."""
    output_dir = tmp_path_factory.mktemp("ddp") / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(SCRIPT), *_script_args(inputs, output_dir), "--ddp_backend", "gloo", "--use_cpu"]
    done = subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output_dir


def _free_port() -> int:
    """torchrun's MASTER_PORT, bound by its store later: [Note: ports below the ephemeral range]."""
    from rayzero.ports import server_port

    return server_port()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _relative_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    largest = max(float(tensor.abs().max()) for tensor in reference.values())
    return max(float((ours[name] - tensor).abs().max()) for name, tensor in reference.items()) / largest


def _logged_steps(output_dir: Path) -> list[int]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["step"] for entry in history if "loss" in entry]


def _committed(checkpoint: Path) -> bool:
    from rayzero.checkpoint.manifest import committed_tags

    step = int(checkpoint.name.split("-")[1])
    return (checkpoint / "trainer_state.json").is_file() and step in {s for s, _ in committed_tags(str(checkpoint))}


def test_zero3_offload_matches_ddp_builds_partitioned_and_saves_hf_and_rayzero_checkpoints(
        local_ray, inputs, ddp, tmp_path):
    output_dir = tmp_path / "out"
    output = _finish(_rayzero_run(local_ray, tmp_path, "z3",
                                  [*_script_args(inputs, output_dir), "--deepspeed", inputs["zero3"]]))
    # from_pretrained ran under zero.Init: transformers saw is_deepspeed_zero3_enabled() in the workers
    assert "Detected DeepSpeed ZeRO-3: activating zero.init() for this model" in output
    assert _relative_difference(_weights(output_dir), _weights(ddp)) <= TOLERANCE
    # save_steps checkpoints: HF's checkpoint-N with a committed, sharded rayzero checkpoint inside
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert [path.name for path in checkpoints] == [f"checkpoint-{n}" for n in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    assert all(_committed(path) for path in checkpoints)
    assert sorted(p.name for p in (checkpoints[-1] / f"global_step{STEPS}").glob("rank*")) == [
        "rank00000.safetensors", "rank00001.safetensors"]
    # DeepSpeed's zero_to_fp32 names, on rayzero's checkpoint: the fp32 weights the model directory holds
    from rayzero.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    final = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints[-1]))
    saved = _weights(output_dir)
    assert all(torch.equal(final[name], tensor) for name, tensor in saved.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(output_dir))  # a normal HF model directory
    assert torch.equal(reloaded.lm_head.weight, saved["transformer.wte.weight"])
    # the Trainer's logs reached rayzero's metrics (status, progress line, plot read them); the end-of-
    # training summary, logged at the last step, travels with that step's loss
    import rayzero

    logged = rayzero.read_metrics(str(tmp_path / "runs" / "z3"), rank=0).to_pylist()
    assert [row["step"] for row in logged] == list(range(1, STEPS + 1))
    assert all(row["loss"] is not None for row in logged) and logged[-1]["train_runtime"] is not None
    assert all(row["learning_rate"] is not None and row["samples"] == row["step"] * 4 for row in logged)


def _workers_in(directory: Path) -> list:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "TrainWorker" in " ".join(process.info["cmdline"] or []) and process.cwd() == str(directory):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path} appeared: {process.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.02)


def test_a_worker_killed_after_the_second_checkpoint_resumes_to_the_uninterrupted_weights(
        local_ray, inputs, ddp, tmp_path):
    output_dir = tmp_path / "out"
    process = _rayzero_run(local_ray, tmp_path, "kill", [*_script_args(inputs, output_dir), "--deepspeed",
                                                         inputs["zero2"]], "--max-failures", "2")
    _wait_for(output_dir / f"checkpoint-{2 * SAVE_EVERY}" / "trainer_state.json", process)
    workers = _workers_in(tmp_path)
    assert len(workers) == 2, workers
    os.kill(workers[-1].pid, signal.SIGKILL)
    output = _finish(process)
    assert "restarting the worker group" in output, output[-4000:]
    # the restarted script resumed from the newest complete checkpoint-N by itself
    assert f"Resuming training from checkpoint with epoch 0 and global step {2 * SAVE_EVERY}" in output
    # and the controller knows the Trainer's checkpoints: the ranks' heartbeats list the directories
    # the Trainer saved into (before, only the run's own checkpoint directory, which it never uses)
    assert f"[rayzero] checkpoint: {output_dir}/checkpoint-{STEPS}/global_step{STEPS}" in output, output[-4000:]
    assert _relative_difference(_weights(output_dir), _weights(ddp)) <= TOLERANCE
    assert _logged_steps(output_dir) == list(range(1, STEPS + 1))  # each step after the checkpoint once


def test_a_planned_stop_saves_checkpoint_n_and_a_rerun_continues_with_the_whole_guide_config(
        local_ray, inputs, tmp_path):
    """The guide's ZeRO-3 file whole (its WarmupLR scheduler included): `rayzero stop` mid-run ends
    the script cleanly with a checkpoint-N at the agreed step; the same command again continues."""
    steps = 40
    output_dir = tmp_path / "out"
    args = [*_script_args(inputs, output_dir, steps), "--deepspeed", inputs["zero3_whole"]]
    process = _rayzero_run(local_ray, tmp_path, "stopped", args)
    _wait_for(output_dir / f"checkpoint-{SAVE_EVERY}" / "trainer_state.json", process)
    stop = subprocess.run([sys.executable, "-m", "rayzero.cli", "stop", "stopped", "--storage", str(tmp_path / "runs")],
                          env=_environment(local_ray), capture_output=True, text=True, timeout=300, check=False)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    output = _finish(process)
    assert "stopped (planned, checkpoint committed)" in output, output[-3000:]
    saved = sorted(int(path.name.split("-")[1]) for path in output_dir.glob("checkpoint-*") if _committed(path))
    stopped_at = saved[-1]
    assert SAVE_EVERY <= stopped_at < steps
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == stopped_at

    output = _finish(_rayzero_run(local_ray, tmp_path, "stopped", args))
    assert f"Resuming training from checkpoint with epoch 0 and global step {stopped_at}" in output
    logged = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in logged if "loss" in entry] == list(range(1, steps + 1))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it trains
    model = transformers.AutoModelForCausalLM.from_pretrained(str(output_dir))
    assert all(torch.isfinite(p).all() for p in model.parameters())
