"""What a config asks the engine to print reaches stderr in a plain script, as DeepSpeed's logger
does ([Note: visible engine logs]): the `steps_per_print` line and the `wall_clock_breakdown`
timings, once each, whether or not the program configured logging. Run in fresh processes: pytest's
own log capture would hide the difference."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import rayzero
    if sys.argv[1] == "configured":
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "wall_clock_breakdown": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = rayzero.initialize(model=model, config=config)
    for _ in range(4):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    engine.close()
""")


def _stderr(mode: str) -> str:
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         check=False, env={**env, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    return run.stderr


@pytest.mark.parametrize("mode", ["plain", "configured"])
def test_steps_per_print_and_timings_print_once(mode):
    err = _stderr(mode)
    progress = [line for line in err.splitlines() if "step=" in line and "skipped=" in line]
    assert [line.split("step=")[1].split(",")[0] for line in progress] == ["2", "4"], err
    timings = [line for line in err.splitlines() if "time (ms) | forward:" in line]
    assert len(timings) == 4, err
