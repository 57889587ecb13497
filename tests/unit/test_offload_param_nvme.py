"""[Note: NVMe parameter shards]: `offload_param.max_in_cpu` bounds how much of the stage-3
parameter shards stays in memory between steps; the rest is paged out to the swap files. Measured
by the kernel (the resident bytes of this process's mappings of the swap files, /proc/self/smaps),
in a fresh interpreter per setting; that training continues correctly through the page-outs is
tests/dist/test_offload.py's `s3-nvme-params` case (max_in_cpu 0, parity with torch)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")]

SCRIPT = r"""
import json, sys, torch, rayzero
root, keep = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": keep}}}
engine, *_ = rayzero.initialize(model=model, config=config)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 512)).pow(2).mean())
    engine.step()
swap = engine.strategy.offload.describe()["param_swap_dir"]
resident, current = 0, None
for line in open("/proc/self/smaps"):
    parts = line.split()
    if parts and not parts[0].endswith(":"):
        current = parts[5] if len(parts) > 5 else None
    elif parts and parts[0] == "Rss:" and current and current.startswith(swap):
        resident += int(parts[1]) * 1024
print(json.dumps({"resident": resident, "shards": engine.strategy.offload.describe()["nvme_param_bytes"]}))
"""


def _resident(tmp_path, keep: int) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / str(keep)), str(keep)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_max_in_cpu_bounds_the_shards_kept_in_memory(tmp_path) -> None:
    everything = _resident(tmp_path, 1_000_000_000)  # DeepSpeed's default: all of them stay
    assert everything["resident"] >= 0.9 * everything["shards"] > 0, everything
    nothing = _resident(tmp_path, 0)
    assert nothing["resident"] < 0.05 * nothing["shards"], nothing
    half = _resident(tmp_path, 1_050_000)  # elements: about half of the 2.1M
    assert 0.3 * half["shards"] < half["resident"] < 0.7 * half["shards"], half
