"""End to end: `ray start --head` (our own, token auth) + `ray job submit -- rayzero run ...`.

The head runs in its own process group with its own temp dir and free ports; teardown signals that
group and then any process still naming our temp dir. Never `ray stop`: it stops every Ray on the host.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from rayzero.ports import free_ports as _free_ports

BIN = Path(sys.executable).parent

TRAIN_FILE = textwrap.dedent(
    """
    import argparse

    import torch
    import torch.distributed as dist

    import rayzero


    def loop(config):
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, required=True)
        steps = parser.parse_args(config["argv"]).steps
        context = rayzero.get_context()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        inputs = torch.randn(32, 4)
        targets = inputs.sum(1, keepdim=True)
        for step in range(steps):
            loss = ((model(inputs) - targets) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= context.world_size
            optimizer.step()
            rayzero.report({"step": step + 1, "loss": loss.item()})
        print(f"NODE-LOCAL-DIR={context.node_local_dir}", flush=True)
        if context.rank == 0:
            print(f"JOB-LOOP-DONE world_size={context.world_size} steps={steps}", flush=True)
    """
)



def _our_leftovers(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _answers(address: str, token: str) -> bool:
    """Whether the head's job API answers: the request `ray job list` makes, sent from this process
    (a `ray` CLI probe every 2 s cost an interpreter, ~1.5 CPU-s, each time)."""
    request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error while the head comes up
        return False


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A private Ray head with token auth, shared by this module's tests (start-up ~30 s);
    yields (dashboard address, env for CLI commands)."""
    tmp_path = tmp_path_factory.mktemp("head")
    temp_dir = tempfile.mkdtemp(prefix="rzj", dir="/tmp")  # short: Ray's socket paths are length-limited
    token_file = Path(temp_dir) / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYZERO_ADDRESS")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="token",  # Ray 2.60: every CLI call and the head must agree on the mode
        RAY_AUTH_TOKEN_PATH=str(token_file),
        RAY_USAGE_STATS_ENABLED="0",
    )
    gcs, dashboard, agent_listen, agent_grpc, node_manager, object_manager, client, metrics, runtime_env = (
        _free_ports(9)
    )
    command = [
        str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--num-gpus=0",
        f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
        f"--ray-client-server-port={client}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}", "--disable-usage-stats",
    ]
    log = open(tmp_path / "head.log", "w")  # noqa: SIM115 - closed in the finally below
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(address, token_file.read_text()):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test head did not come up:\n{(tmp_path / 'head.log').read_text()}")
            time.sleep(0.5)
        yield address, env
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)  # the head's own process group, nobody else's
            head.wait(timeout=3)  # `ray start --block` outlives the SIGTERM (it took the full 10 s once)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _our_leftovers(temp_dir):  # e.g. a worker that started its own session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _job(ray_head, project, prefix: str, entrypoint: list[str], *options: str) -> tuple[str, str, str]:
    """(submission id, stdout, the end of stderr) of `ray job submit --working-dir project [options] -- entrypoint`.

    Without --no-wait the CLI streams the job's whole log (from its first line until the job ends)
    and then prints the job's final status through the function `ray job status` uses, so its output
    holds both (a `ray job status` and a `ray job logs` call cost an interpreter each)."""
    address, env = ray_head
    submission = f"{prefix}-{secrets.token_hex(3)}"
    submit = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", submission,
                             "--working-dir", str(project), *options, "--", *entrypoint],
                            check=False, env=env, capture_output=True, text=True, timeout=300)
    return submission, submit.stdout, submit.stderr[-3000:]


def test_ray_job_submit_runs_rayzero_run_to_success(ray_head, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAIN_FILE)
    (project / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    submission, output, errors = _job(
        ray_head, project, "rayzero-e2e",
        ["rayzero", "run", "train.py:loop", "--config", "ds.json", "--workers", "2",
         "--storage", (tmp_path / "runs").as_uri(), "--name", "e2e", "--", "--steps", "5"],
        # as the Kubernetes operator does for a mounted volume: the node's own node-local root
        "--runtime-env-json", json.dumps({"env_vars": {"RAYZERO_NODE_LOCAL_DIR": str(tmp_path / "mnt")}}))
    assert f"Job '{submission}' succeeded" in output, f"{output[-3000:]}\n{errors}"
    assert "JOB-LOOP-DONE world_size=2 steps=5" in output
    assert "[rayzero] finished: 5 report(s)" in output
    assert f"NODE-LOCAL-DIR={tmp_path / 'mnt'}/" in output  # <node root>/<node id>
    assert (tmp_path / "runs" / "e2e" / "metrics.parquet").exists()


def test_ray_job_submit_reports_a_bad_config_as_a_failed_job(ray_head, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAIN_FILE)
    (project / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 9}}))
    submission, output, errors = _job(ray_head, project, "rayzero-bad", [
        "rayzero", "run", "train.py:loop", "--config", "ds.json", "--workers", "2", "--", "--steps", "5"])
    assert f"Job '{submission}' failed" in output, f"{output[-3000:]}\n{errors}"
    assert "zero_optimization.stage" in output and "no worker was started" in output


SCRIPT_FILE = textwrap.dedent(
    """
    import argparse
    import sys

    import torch
    import torch.distributed as dist

    import rayzero

    steps = argparse.ArgumentParser()
    steps.add_argument("--steps", type=int, required=True)
    steps = steps.parse_args().steps
    dist.init_process_group("gloo")  # the script's own group, as under torchrun
    total = torch.zeros(1)
    for step in range(steps):
        dist.all_reduce(one := torch.ones(1))
        total += one
        rayzero.report({"step": step + 1})
    print(f"JOB-SCRIPT rank={dist.get_rank()} sum={total.item():g} argv={sys.argv}", flush=True)
    dist.destroy_process_group()
    """
)


def test_ray_job_submit_runs_a_script_target(ray_head, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT_FILE)
    submission, output, errors = _job(ray_head, project, "rayzero-script", [
        "rayzero", "run", "train.py", "--workers", "2", "--storage", (tmp_path / "runs").as_uri(), "--name", "script",
        "--", "--steps", "3"])
    assert f"Job '{submission}' succeeded" in output, f"{output[-3000:]}\n{errors}"
    for rank in (0, 1):  # each rank's own line, labelled by rayzero only (no "(TrainWorker pid=...)")
        assert f"\n[rank {rank}] JOB-SCRIPT rank={rank} sum=6 argv=['train.py', '--steps', '3']" in output, output
    assert "[rayzero] finished: 3 report(s)" in output
