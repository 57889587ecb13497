"""What the ranks of tests/dist/test_offload.py run: parity cases with a probe of where the optimizer
state really lives, and checkpoint hops between offload modes and world sizes."""
from __future__ import annotations

import os

import torch
from testkit import harness as H


def where_state_lives(engine) -> dict:
    """Read from the optimizer and the filesystem, not from the engine's own accounting."""
    backend = engine.strategy.offload
    per_element = [value for param, state in engine.optimizer.state.items() for value in state.values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()]
    swap_dir = getattr(backend, "directory", None)
    files = sorted(os.listdir(swap_dir)) if swap_dir else []
    stats = engine.memory_stats()
    param_dir = backend.describe().get("param_swap_dir")
    entries = getattr(getattr(engine.strategy, "partitions", None), "entries", [])
    # A shard swapped out holds no memory: its tensor is empty while the parameter needs elements.
    swapped = [e for e in entries if e.shard.numel() == 0]
    return {
        "param_swap_dir": param_dir,
        "param_shards_swapped": len(swapped),
        "param_shards": len(entries),
        "param_shard_bytes": sum(e.shard_numel * e.shard.element_size() for e in swapped),
        "param_shard_resident_bytes": sum(e.shard.numel() * e.shard.element_size() for e in entries),
        "param_swap_file_bytes": sum(os.path.getsize(os.path.join(param_dir, f)) for f in os.listdir(param_dir))
        if param_dir else 0,
        "backend": backend.name,
        "state_devices": sorted({value.device.type for value in per_element}),
        "state_bytes": sum(value.numel() * value.element_size() for value in per_element),
        "swap_dir": swap_dir,
        "swap_file_bytes": sum(os.path.getsize(os.path.join(swap_dir, name)) for name in files),
        "swap_files": len(files),
        "optimizer_tensors": sum(len(group["params"]) for group in engine.optimizer.param_groups),
        "placement": {key: stats[key] for key in ("device_bytes", "host_bytes", "nvme_bytes")},
        "breakdown": engine.offload_breakdown(),
    }


def parity(rank: int, world: int, cases: list) -> list:
    return [H.train_case(rank, world, case, probe=where_state_lives) for case in cases]


def checkpoint_hop(rank: int, world: int, payload: dict) -> dict:
    """Load the newest checkpoint under `dir` if asked, train steps [first, last), save if asked."""
    case = payload["case"]
    engine, _ = H.start_engine(rank, case)
    if payload.get("load"):
        path, _ = engine.load_checkpoint(payload["dir"])
        assert path is not None, "a committed checkpoint is there to load"
    losses = H.train_steps(engine, rank, world, case, payload["first"], payload["last"])
    if payload.get("save"):
        engine.save_checkpoint(payload["dir"], asynchronous=False)
    out = {"losses": losses, "masters": H.master_pieces(engine), "probe": where_state_lives(engine)}
    engine.close()
    out["swap_dir_removed"] = out["probe"]["swap_dir"] is None or not os.path.exists(out["probe"]["swap_dir"])
    return out


ESTIMATE_WIDTH, ESTIMATE_DEPTH = 192, 4


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(ESTIMATE_DEPTH):
        layers += [torch.nn.Linear(ESTIMATE_WIDTH, ESTIMATE_WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def measured_memory(rank: int, world: int, payload: dict) -> list[dict]:
    """memory_stats and the real swap-file bytes after two steps of each configuration."""
    import rayzero

    out = []
    for precision, stage, opt_off, param_off in payload["runs"]:
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if opt_off != "none":
            zero["offload_optimizer"] = {"device": opt_off, "nvme_path": payload["nvme"]}
        if param_off != "none":
            zero["offload_param"] = {"device": param_off}
            if param_off == "nvme":  # every shard in the swap file
                zero["offload_param"].update(nvme_path=payload["nvme"], max_in_cpu=0)
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "bf16": {"enabled": precision == "bf16"}}
        engine, *_ = rayzero.initialize(model=mlp(), config=config)
        for _ in range(2):
            # inputs are the loop's to cast (DeepSpeed casts only with fp16.auto_cast)
            x = torch.randn(4, ESTIMATE_WIDTH).to(torch.bfloat16 if precision == "bf16" else torch.float32)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        out.append({"run": (precision, stage, opt_off, param_off), "stats": engine.memory_stats(),
                    "probe": where_state_lives(engine)})
        engine.close()
    return out
