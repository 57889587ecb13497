"""The measurement mode of bench/comm_model.py: the real engine on emulated nodes, its bytes per link class.

Each topology (nodes x ranks per node) is one spawned gloo group on this machine; rank r says it runs
on node r // ranks_per_node through GROUP_RANK, which is how the engine learns its nodes ([Note:
topology] in rayzero/engine/topology.py), so every collective's bytes are split between peers on the
rank's own node and peers elsewhere exactly as on a real cluster ([Note: bytes per link class] in
rayzero/engine/comm.py). Every layout of the topology runs in that one group, one after another.

The model is a stack of bias-free square linear layers: every parameter has the same size, divisible
by every group size used, so no padding blurs the per-parameter figures; bf16, so gathers and
gradient reductions travel in the 2-byte dtype a large model uses. `stage3_param_persistence_threshold`
0 and `stage3_max_reuse_distance` 0 make every parameter gather in forward and again in backward, as
a large model's do. The figures are those of the last of `STEPS` optimizer steps (the first re-plans
the gradient buckets: [Note: stage 3 bucket plan]).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import tempfile
import time
import traceback
import warnings
from typing import Any

WIDTH = 256
DEPTH = 4
MICRO_BATCH = 4
STEPS = 3
PARAMETERS = WIDTH * WIDTH * DEPTH
"""Ψ of the measured model (every parameter trainable)."""
ELEMENT_BYTES = 2
"""bf16: the dtype of the gathers and of the gradient buckets."""


def base_config(zero: dict[str, Any], gas: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, **zero},
    }


def _model() -> Any:
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))

        def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            hidden = inputs
            for layer in self.layers:
                hidden = torch.relu(layer(hidden))
            return torch.nn.functional.mse_loss(hidden.float(), targets)

    torch.manual_seed(0)
    return Stack()


def _measure(case: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch

    import rayzero

    engine, _, _, _ = rayzero.initialize(model=_model(), config=base_config(case["zero"], case.get("gas", 1)))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        for _ in range(case.get("gas", 1)):
            inputs = torch.randn(MICRO_BATCH, WIDTH, generator=generator).to(torch.bfloat16)
            loss = engine(inputs, torch.randn(MICRO_BATCH, WIDTH, generator=generator))
            engine.backward(loss)
            engine.step()
    stats = engine.comm_stats()
    engine.close()
    return {kind: value for kind, value in stats.items() if kind not in ("total", "control")}


def _rank(rank: int, world: int, local: int, port: int, cases: list[dict[str, Any]], out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    for key in ("RAYZERO_NODE_ID", "NODE_RANK"):  # the emulated node must be the one the engine finds
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % local), GROUP_RANK=str(rank // local),
                      RAYZERO_COLLECTIVE_TIMEOUT_S="120")
    torch.set_num_threads(1)  # 8 ranks on 2 shared cores
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives, once per rank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results = []
    for case in cases:
        try:
            results.append(_measure(case, rank))
        except Exception:  # noqa: BLE001 - a layout that fails is a row that says why
            results.append({"error": traceback.format_exc()[-2000:]})
    dist.destroy_process_group()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run_topology(nodes: int, local: int, cases: list[dict[str, Any]], timeout_s: float = 900) -> list[dict[str, Any]]:
    """Every case on one spawned group of nodes x local ranks; per case, every rank's counts."""
    from rayzero.ports import server_port

    world = nodes * local
    context = multiprocessing.get_context("forkserver")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rayzero-comm-") as out:
        port = server_port()  # the group's MASTER_PORT, the same for every rank
        processes = [context.Process(target=_rank, args=(rank, world, local, port, cases, out)) for rank in range(world)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(max(1.0, timeout_s - (time.monotonic() - started)))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        per_rank = []
        for rank in range(world):
            path = pathlib.Path(out, f"rank{rank}.json")
            if not path.exists():
                raise RuntimeError(f"{nodes}x{local}: rank {rank} wrote no result (timeout or crash)")
            per_rank.append(json.loads(path.read_text()))
    return [[per_rank[rank][index] for rank in range(world)] for index in range(len(cases))]


def mean_and_spread(stats: list[dict[str, dict[str, int]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per kind, each count's mean over the ranks, and the spread (max - min) of the link counts."""
    kinds = sorted({kind for rank in stats for kind in rank})
    mean, spread = {}, {}
    for kind in kinds:
        fields = sorted({name for rank in stats for name in rank.get(kind, {})})
        values = {name: [rank.get(kind, {}).get(name, 0) for rank in stats] for name in fields}
        mean[kind] = {name: sum(v) / len(v) for name, v in values.items()}
        spread[kind] = {name: max(v) - min(v) for name, v in values.items() if name.endswith("_node_bytes")}
    return mean, spread
