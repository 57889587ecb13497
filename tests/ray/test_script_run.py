"""`rayzero run SCRIPT.py` as a user types it (a subprocess joined to the shared local Ray), and
`rayzero.fit(rayzero.Script(...))`: torchrun's environment, exit statuses, restarts and planned stops
of unmodified scripts ([Note: scripts on workers])."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from testkit import TESTS, elastic_loop

import rayzero

ROOT = Path(__file__).resolve().parents[2]

ENV_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, os, sys, time
    import torch.distributed as dist
    import rayzero

    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RAYZERO_SCRIPT",
            "ACCELERATE_USE_DEEPSPEED"]
    context = rayzero.get_context()
    spec = importlib.util.find_spec("deepspeed")
    try:  # --config: Accelerate reads it as under `accelerate launch --use_deepspeed --deepspeed_config_file`
        from accelerate.utils import DeepSpeedPlugin
        accelerate_sees = DeepSpeedPlugin().deepspeed_config["zero_optimization"]
    except ImportError:
        accelerate_sees = None
    print("SEEN " + json.dumps({
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
        "env": {key: os.environ.get(key) for key in keys}, "group_formed": dist.is_initialized(),
        "deepspeed_preloaded": "deepspeed" in sys.modules, "deepspeed": spec.origin if spec else None,
        "attempt": context.attempt, "resuming": context.resuming, "accelerate": accelerate_sees}), flush=True)
    print(f"to stderr from {context.rank}", file=sys.stderr, flush=True)
    if context.rank == 0:
        open("rank0.printed", "w").close()
    if context.rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
        deadline = time.monotonic() + 120  # the failure ends the group: let rank 0 print first
        while not os.path.exists("rank0.printed") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        sys.exit(int(sys.argv[sys.argv.index("--status") + 1]))
    """
)

# A DeepSpeed-style script: its own gloo group, rayzero.initialize with the run's --config, saves and
# resumes by itself. The data, model and plain-SGD reference are the fault tests' (elastic_loop).
TRAIN_SCRIPT = textwrap.dedent(
    f"""
    import argparse, json, os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import rayzero
    sys.path.insert(0, {str(TESTS)!r})  # this script runs on a Ray worker, whose sys.path lacks tests/
    from testkit import elastic_loop

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # through env://, as under torchrun
    context = rayzero.get_context()
    model = elastic_loop.initial_model()
    engine, _, _, _ = rayzero.initialize(model=model)
    if context.resume_from:
        engine.load_checkpoint(context.resume_from)
    print(f"START attempt={{context.attempt}} resuming={{context.resuming}} step={{engine.global_steps}}", flush=True)
    Path(f"rank{{context.rank}}.attempt{{context.attempt}}.pid").write_text(str(os.getpid()))
    inputs, targets = elastic_loop.dataset()
    micro, gas, world = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.world_size
    while engine.global_steps < args.steps:
        step = engine.global_steps
        for micro_step in range(gas):
            first = step * micro * gas * world + (micro_step * world + context.rank) * micro
            index = torch.arange(first, first + micro) % elastic_loop.SAMPLES
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[index]), targets[index]))
            engine.step()
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint()
        print(f"STEP {{engine.global_steps}}", flush=True)
        time.sleep(args.sleep)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    print("FINAL " + json.dumps({{"step": engine.global_steps, "weights": weights}}), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "envscript.py").write_text(ENV_SCRIPT)
    (tmp_path / "train_script.py").write_text(TRAIN_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(elastic_loop.config()))
    return tmp_path


def _env(local_ray) -> dict[str, str]:
    return dict(os.environ, RAY_ADDRESS=local_ray.get_runtime_context().gcs_address)


def _start(local_ray, project: Path, *args: str, stderr: int = subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rayzero.cli", "run", *args], cwd=project, env=_env(local_ray),
                            stdout=subprocess.PIPE, stderr=stderr, text=True)


def _seen(output: str) -> dict[int, dict]:
    found = {}
    for line in output.splitlines():
        if " SEEN " in line:
            label, _, payload = line.partition(" SEEN ")
            found[int(label.removeprefix("[rank ").rstrip("]"))] = json.loads(payload)
            assert label.startswith("[rank "), line  # our label only: no "(TrainWorker pid=...)" before it
    return found


def _final(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("[rank 0] FINAL "))
                      .removeprefix("[rank 0] FINAL "))


def test_a_script_runs_as_main_on_every_rank_and_its_exit_status_is_the_command_s(local_ray, project):
    driver = _start(local_ray, project, "envscript.py", "--workers", "2", "--config", "ds.json", "--name", "env",
                    "--max-failures", "0", "--", "--fail-rank", "1", "--status", "3", "--two words")
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 3, f"{out}\n{err}"
    assert "the script exited with status 3 on rank 1" in err and "rank 1 raised SystemExit: 3" in err
    seen = _seen(out)
    assert sorted(seen) == [0, 1], out
    accelerate_installed = importlib.util.find_spec("accelerate") is not None
    for rank, got in seen.items():
        assert got["name"] == "__main__" and got["argv"] == ["envscript.py", "--fail-rank", "1", "--status", "3",
                                                              "--two words"]
        assert got["path0"] == str(project.resolve()) and got["cwd"] == str(project)
        env = got["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank),
                                                                                                "2", "2")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit()
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["TORCHELASTIC_RUN_ID"]) == ("0", "1", "env")
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["RAYZERO_SCRIPT"] == "1"
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"  # --config: what accelerate launch --use_deepspeed sets
        if accelerate_installed:
            assert got["accelerate"] == elastic_loop.config()["zero_optimization"]
        assert got["group_formed"] is False  # the script forms its own group
        assert got["deepspeed_preloaded"] is False  # nothing imported the real one before the script
        compat = ROOT / "rayzero" / "compat" / "site"
        if compat.is_dir():  # the seam: `import deepspeed` in a script run is rayzero's module
            assert got["deepspeed"].startswith(str(compat)), got["deepspeed"]
        assert got["attempt"] == 0 and got["resuming"] is False
    assert {"[rank 0] to stderr from 0", "[rank 1] to stderr from 1"} <= set(err.splitlines())


def test_a_killed_worker_restarts_the_script_from_its_checkpoint_then_sigterm_stops_it_and_a_rerun_resumes(
        local_ray, project):
    """One `rayzero run` of a script that saves by itself carries both:
    - a killed worker restarts the script, which resumes from its own committed checkpoint (not from 0);
    - SIGTERM to the driver then stops the restarted script at a checkpoint (exit 0, "planned"), and a
      rerun with the same name resumes from exactly that step and ends with plain SGD's weights."""
    driver = _start(local_ray, project, "train_script.py", "--config", "ds.json", "--workers", "2", "--name", "resumed",
                    "--max-failures", "1", "--", "--steps", "100000", "--save-every", "3", "--sleep", "0.05",
                    stderr=subprocess.STDOUT)  # read line by line below: one pipe cannot fill up unread
    lines: list[str] = []
    try:
        killed = restarted = False
        for line in driver.stdout:  # a line per step: each one is a chance to look at the files
            lines.append(line)
            if not killed and (project / "runs" / "resumed" / "checkpoints" / "latest").exists():
                os.kill(int((project / "rank1.attempt0.pid").read_text()), signal.SIGKILL)
                killed = True
            restarted = restarted or line.startswith("[rank 0] START attempt=1 ")
            if restarted and line.startswith("[rank 0] STEP "):  # the restarted script is stepping
                driver.send_signal(signal.SIGTERM)
                break
        out, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    out = "".join(lines) + out
    assert driver.returncode == 0, out
    restarts = [line for line in out.splitlines() if line.startswith("[rank 0] START attempt=1 ")]
    assert restarts and "resuming=True" in restarts[0], out
    assert int(restarts[0].split("step=")[1]) >= 3  # from a committed checkpoint, not from scratch
    assert "stopped (planned, checkpoint committed)" in out
    assert (project / "runs" / "resumed" / "checkpoints" / "latest").exists()
    after_restart = out[out.index(restarts[0]):].splitlines()  # the first attempt printed steps of its own
    stopped_at = max(int(line.split()[-1]) for line in after_restart if line.startswith("[rank 0] STEP "))
    steps = stopped_at + 3
    rerun = _start(local_ray, project, "train_script.py", "--config", "ds.json", "--workers", "2", "--name", "resumed",
                   "--", "--steps", str(steps))
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, f"{out}\n{err}"
    started = next(line for line in out.splitlines() if line.startswith("[rank 0] START "))
    assert started == f"[rank 0] START attempt=0 resuming=True step={stopped_at}", out
    final = _final(out)
    assert final["step"] == steps
    assert final["weights"] == pytest.approx(elastic_loop.reference_weights(steps), abs=1e-5)


SILENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch.distributed as dist

    time.sleep(float(sys.argv[1]))  # silent, no group, no engine: longer than hang_timeout_s
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"SUM {total.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def test_fit_a_script_that_never_builds_an_engine(local_ray, tmp_path, monkeypatch):
    (tmp_path / "silent.py").write_text(SILENT_SCRIPT)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"Script\(path, args=\[...\]\), not train_loop_config"):
        rayzero.fit(rayzero.Script("silent.py"), train_loop_config={"x": 1})
    result = rayzero.fit(rayzero.Script("silent.py", args=["3"]), scaling=rayzero.ScalingConfig(num_workers=2),
                         run=rayzero.RunConfig(name="silent", storage=(tmp_path / "runs").as_uri()),
                         failure=rayzero.FailureConfig(hang_timeout_s=1.0))
    # not flagged as hung while it had no group and no engine (the startup grace applies), and it ended 0
    assert result.failures == 0 and not result.stopped
    # one worker each below: what is proved (the detector, the exit status) is per rank
    with pytest.raises(rayzero.TrainingFailedError, match="rank 0 made no progress"):  # the detector is alive
        rayzero.fit(rayzero.Script("silent.py", args=["30"]), scaling=rayzero.ScalingConfig(num_workers=1),
                    run=rayzero.RunConfig(name="hung", storage=(tmp_path / "runs").as_uri()),
                    failure=rayzero.FailureConfig(hang_timeout_s=1.0, startup_grace_s=2.0, max_failures=0))
    with pytest.raises(rayzero.TrainingFailedError) as failed:
        rayzero.fit(rayzero.Script("silent.py", args=["not-a-number"]), scaling=rayzero.ScalingConfig(num_workers=1),
                    run=rayzero.RunConfig(name="broken", storage=(tmp_path / "runs").as_uri()),
                    failure=rayzero.FailureConfig(max_failures=0))
    assert failed.value.exit_code == 1 and "ValueError: could not convert string to float" in str(failed.value)
