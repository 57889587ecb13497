"""The HF Trainer's cost on rayzero: HF's run_clm.py under `rayzero run ... --deepspeed zero0.json`
(rayzero's engine, ZeRO stage 0, through the DeepSpeed compatibility layer) against the same script
under `torchrun ... --ddp_backend gloo --use_cpu` (plain DDP). Prints JSON.

    python bench/trainers.py [--rounds 5] [--steps 60] [--json bench/results/trainers.json]

The script is tests/fixtures/hf/run_clm.py when present (HF's own, see ORIGIN.md there), else
tests/fixtures/train_clm.py. Both sides run it unchanged, through the same timing wrapper (this file
with `--timed`): a TrainerCallback added to the Trainer records rank 0's wall clock at every
optimizer step's end. Step time = median interval after the first 5 steps; command-to-first-step =
the first step's end minus the moment the command was started (the clock file is named on the
command line: a Ray cluster's workers do not see the launching shell's environment). Rounds interleave the two sides, so
load from other processes hits both alike; the ratio is DDP's step time over rayzero's (>= 0.95: the
integration costs at most 5 %), per round and the median of the rounds. `rayzero run` joins a Ray
this benchmark starts once (as on a cluster, where Ray is up); one `rayzero run` starting its own Ray
is timed once as well ("cold"). Same model, data, optimizer (HF's default fused AdamW, handed to the
engine), clipping (1.0 on both sides) and seed: the final losses are printed side by side.

The Trainer wraps a `PreTrainedModel` in DDP with `find_unused_parameters=True` unless told otherwise
(`--ddp_find_unused_parameters false`), which walks the autograd graph every step; rayzero's engine
does not (it reports a parameter without a gradient instead). The target compares with the script as
users run it; each round also runs DDP with that search off ("like for like"), reported beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import machine_description, versions

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
HF_SCRIPT = FIXTURES / "hf" / "run_clm.py"
SCRIPT = HF_SCRIPT if HF_SCRIPT.is_file() else FIXTURES / "train_clm.py"
WARMUP_STEPS = 5
ZERO0 = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def timed(script: str, times_file: str, script_args: list[str]) -> None:
    """Runs on every rank: the script as `__main__`, with a step clock added to its Trainer."""
    import transformers

    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                Path(times_file).write_text(json.dumps({"step_ends": step_ends, "log_history": state.log_history}))

    original_init = transformers.Trainer.__init__

    def init_with_clock(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(StepClock())
    transformers.Trainer.__init__ = init_with_clock
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


def _script_args(inputs: dict[str, str], steps: int, output_dir: str) -> list[str]:
    return ["--model_name_or_path", inputs["model"], "--tokenizer_name", inputs["tokenizer"],
            "--train_file", inputs["text"], "--block_size", "64", "--do_train", "--per_device_train_batch_size", "4",
            "--max_steps", str(steps), "--learning_rate", "1e-3", "--seed", "0", "--logging_steps", "10",
            "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0",
            "--output_dir", output_dir, "--disable_tqdm", "true"]


def _environment(**extra: str) -> dict[str, str]:
    sys.path.insert(0, str(FIXTURES))
    import hf_tiny

    env = dict(os.environ, **hf_tiny.ENV, OMP_NUM_THREADS="1", **extra)  # 1 thread: what Ray gives a 1-CPU actor
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _summary(times_file: Path, started: float) -> dict:
    data = json.loads(times_file.read_text())
    ends = data["step_ends"]
    intervals = [later - earlier for earlier, later in zip(ends[WARMUP_STEPS:], ends[WARMUP_STEPS + 1:])]
    losses = [entry["loss"] for entry in data["log_history"] if "loss" in entry]
    return {"step_time_median_s": statistics.median(intervals), "step_time_min_s": min(intervals),
            "command_to_first_step_s": ends[0] - started, "steps": len(ends), "final_loss": losses[-1]}


def _run(command: list[str], env: dict[str, str], times_file: Path, cwd: str) -> dict:
    started = time.time()
    done = subprocess.run(command, env=env, cwd=cwd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "log_tail": done.stdout[-3000:]}
    return dict(_summary(times_file, started), wall_s=time.time() - started)


def run_torchrun(inputs: dict[str, str], steps: int, directory: Path, *extra: str) -> dict:
    from rayzero.ports import server_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(server_port()), __file__, "--timed", str(SCRIPT), str(directory / "ddp_times.json"), "--",
               *_script_args(inputs, steps, str(directory / "ddp")), "--ddp_backend", "gloo", "--use_cpu", *extra]
    return _run(command, _environment(), directory / "ddp_times.json", str(directory))


def run_rayzero(inputs: dict[str, str], steps: int, directory: Path, ray_address: str | None, name: str) -> dict:
    command = [sys.executable, "-m", "rayzero.cli", "run", __file__, "--workers", "2", "--name", name,
               "--storage", str(directory / "runs"), "--", "--timed", str(SCRIPT), str(directory / f"{name}_times.json"),
               "--",
               *_script_args(inputs, steps, str(directory / name)), "--deepspeed", inputs["zero0"]]
    env = _environment(**({"RAY_ADDRESS": ray_address} if ray_address else {}))
    return _run(command, env, directory / f"{name}_times.json", str(directory))


def _build_inputs(directory: Path) -> dict[str, str]:
    sys.path.insert(0, str(FIXTURES))
    import hf_tiny

    os.environ.update(hf_tiny.ENV)
    data = directory / "data"
    data.mkdir()
    paths = {"text": str(data / "train.txt"), "tokenizer": str(data / "tokenizer"), "model": str(data / "model")}
    hf_tiny.write_text(paths["text"], lines=2000)
    hf_tiny.write_tokenizer(paths["text"], paths["tokenizer"])
    from transformers import AutoTokenizer

    hf_tiny.write_model(paths["model"], len(AutoTokenizer.from_pretrained(paths["tokenizer"])), n_layer=4, n_embd=128)
    paths["zero0"] = str(directory / "zero0.json")
    Path(paths["zero0"]).write_text(json.dumps(ZERO0))
    return paths


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    if "--timed" in sys.argv:  # inside a launched rank
        position = sys.argv.index("--timed")
        script, times_file, rest = sys.argv[position + 1], sys.argv[position + 2], sys.argv[position + 3:]
        timed(script, times_file, rest[1:] if rest[:1] == ["--"] else rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    import ray

    load_start = _load()
    with tempfile.TemporaryDirectory(prefix="rayzero-bench-trainers-") as tmp:
        directory = Path(tmp)
        inputs = _build_inputs(directory)
        cold = run_rayzero(inputs, args.steps, directory, None, "cold")
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
        address = ray.get_runtime_context().gcs_address
        rounds = []
        for index in range(args.rounds):
            ddp = run_torchrun(inputs, args.steps, directory)
            ours = run_rayzero(inputs, args.steps, directory, address, f"round{index}")
            tuned = run_torchrun(inputs, args.steps, directory, "--ddp_find_unused_parameters", "false")
            ok = all("error" not in side for side in (ddp, ours, tuned))
            rounds.append({"torchrun_ddp": ddp, "rayzero_stage0": ours, "torchrun_ddp_no_unused_search": tuned,
                           "ratio": ddp["step_time_median_s"] / ours["step_time_median_s"] if ok else None,
                           "ratio_no_unused_search": tuned["step_time_median_s"] / ours["step_time_median_s"]
                           if ok else None, "load_1min": _load()})
        ray.shutdown()
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    good = [r for r in rounds if r["ratio"] is not None]
    result = {
        "benchmark": "trainers",
        "script": str(SCRIPT.relative_to(ROOT)),
        "model": "GPT-2, 4 layers, width 128, vocab 257, block 64, batch 4/rank, 2 ranks, fp32, CPU",
        "steps": args.steps,
        "rounds": args.rounds,
        "target": "step time ratio (DDP / rayzero) >= 0.95",
        "step_time_ratio_median": statistics.median(ratios) if ratios else None,
        "step_time_ratio_per_round": ratios,
        "step_time_ratio_spread": [min(ratios), max(ratios)] if ratios else None,
        "like_for_like_ratio_median": statistics.median(r["ratio_no_unused_search"] for r in good) if good else None,
        "like_for_like_ratio_per_round": [r["ratio_no_unused_search"] for r in good],
        "torchrun_step_time_median_s": statistics.median(r["torchrun_ddp"]["step_time_median_s"] for r in good)
        if good else None,
        "torchrun_no_unused_search_step_time_median_s": statistics.median(
            r["torchrun_ddp_no_unused_search"]["step_time_median_s"] for r in good) if good else None,
        "rayzero_step_time_median_s": statistics.median(r["rayzero_stage0"]["step_time_median_s"] for r in good)
        if good else None,
        "torchrun_command_to_first_step_s": statistics.median(r["torchrun_ddp"]["command_to_first_step_s"]
                                                              for r in good) if good else None,
        "rayzero_command_to_first_step_s": statistics.median(r["rayzero_stage0"]["command_to_first_step_s"]
                                                             for r in good) if good else None,
        "rayzero_cold_command_to_first_step_s": cold.get("command_to_first_step_s"),
        "final_losses": [(r["torchrun_ddp"].get("final_loss"), r["rayzero_stage0"].get("final_loss")) for r in rounds],
        "load_1min_start_end": [load_start, _load()],
        "machine": machine_description(),
        "versions": versions(),
        "cold": cold,
        "per_round": rounds,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
