"""`rayzero.zero.Init` as the first rayzero call of a torchrun script (DeepSpeed's usual shape:
`with deepspeed.zero.Init(config_dict_or_path=...)` before `deepspeed.initialize`). DeepSpeed's Init
initialises the process group itself; rayzero's used to partition over this process alone, and
`initialize` then refused the model ("partitioned ... over 1 rank(s) but training runs on 2").
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rayzero.ports import server_port

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    import rayzero

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}}
    with rayzero.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    assert dist.is_initialized() and dist.get_world_size() == 2
    shard = rayzero.engine.stage3.parameters.lookup(model[0].weight)[1].shard
    assert shard.numel() == 16 * 32 // 2, shard.numel()  # partitioned over both ranks
    engine, *_ = rayzero.initialize(model=model, config=config)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    print("TRAINED", dist.get_rank())
""")


def test_zero_init_first_under_torchrun_partitions_over_the_launched_ranks(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={server_port()}", str(script)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert launched.returncode == 0, f"{launched.stdout[-2000:]}\n{launched.stderr[-3000:]}"
    assert launched.stdout.count("TRAINED") == 2
