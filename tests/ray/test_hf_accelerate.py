"""An `Accelerator()` training loop under `rayzero run SCRIPT.py --config ds.json`: Accelerate's
DeepSpeed path, driven by the environment `accelerate launch --use_deepspeed --deepspeed_config_file`
gives, trains on rayzero's engine on CPU ([Note: the DeepSpeed compatibility layer], item 1) and
ends with the weights of the same loop under Accelerate's own DDP (`accelerate launch --cpu`:
ACCELERATE_USE_CPU) under torchrun. ZeRO-2 with 2 accumulation steps, so Accelerate's boundary flag
(`set_gradient_accumulation_boundary`) decides when the engine steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "tests" / "fixtures" / "accelerate_loop.py"
STEPS, ACCUMULATION = 6, 2
CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": 1.0}


def _environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _lines(output: str) -> list[dict]:
    found = []
    for line in output.splitlines():
        _, brace, rest = line.partition("{")
        if brace:
            try:
                found.append(json.loads(brace + rest))
            except json.JSONDecodeError:
                continue
    return found


def test_accelerate_loop_with_a_deepspeed_config_matches_its_ddp_run(local_ray, tmp_path):
    from safetensors.torch import load_file

    from rayzero.ports import server_port

    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(server_port()),
         str(LOOP), str(tmp_path / "ddp.safetensors"), str(STEPS), str(ACCUMULATION)],
        env=_environment(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=600, check=False)
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    ours = subprocess.run(
        [sys.executable, "-m", "rayzero.cli", "run", str(LOOP), "--workers", "2", "--config", "ds.json",
         "--storage", str(tmp_path / "runs"), "--name", "accelerate", "--",
         str(tmp_path / "ours.safetensors"), str(STEPS), str(ACCUMULATION)],
        cwd=tmp_path, env=_environment(RAY_ADDRESS=local_ray.get_runtime_context().gcs_address),
        capture_output=True, text=True, timeout=900, check=False)
    assert ours.returncode == 0, ours.stdout[-4000:] + ours.stderr[-4000:]
    reference, seen = _lines(ddp.stdout), _lines(ours.stdout)
    assert {"engine": "rayzero.compat.engine.DeepSpeedEngine", "distributed_type": "DistributedType.DEEPSPEED",
            "processes": 2} in seen
    assert {"engine": "torch.nn.parallel.distributed.DistributedDataParallel",
            "distributed_type": "DistributedType.MULTI_CPU", "processes": 2} in reference
    assert [line["step"] for line in seen if "step" in line] == list(range(1, STEPS + 1))
    expected, trained = load_file(str(tmp_path / "ddp.safetensors")), load_file(str(tmp_path / "ours.safetensors"))
    assert set(expected) == set(trained)
    for name, tensor in expected.items():
        assert float((trained[name] - tensor).abs().max() / tensor.abs().max()) <= 1e-5, name
