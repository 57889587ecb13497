"""[Note: NVMe parameter shards]: stage-3 parameter shards on NVMe, read through `buffer_count`
staging buffers of `buffer_size` elements, the first `max_in_cpu` elements kept in memory.

Each setting runs in a rank of its own, forked from the tests' torch server; memory is the kernel's
high-water mark (VmHWM), not the engine's accounting. That training continues correctly with every
shard swapped (parity with torch, 2 ranks) is tests/dist/test_offload.py's `s3-nvme-params` case.
"""
from __future__ import annotations

import os
import sys

import pytest

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")]


def _measure(rank: int, world_size: int, payload: dict) -> dict:
    """One setting in one rank forked from the torch server ([Note: ranks forked from a torch server]),
    glibc's mmap threshold fixed so freed large blocks go back: VmHWM is what was live."""
    import torch

    import rayzero

    def hwm() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) * 1024

    root, keep, offload = payload["root"], payload["keep"], payload["offload"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    param = ({"device": "nvme", "nvme_path": root, "max_in_cpu": keep, "buffer_count": 3, "buffer_size": 1 << 20}
             if offload == "nvme" else {"device": "cpu"})
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1 << 20,
                                    "offload_optimizer": {"device": "cpu"}, "offload_param": param}}
    engine, *_ = rayzero.initialize(model=model, config=config)
    losses = []
    for step in range(3):
        x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(step))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    entries = engine.strategy.partitions.entries
    described = engine.strategy.offload.describe()
    swap_dir = described.get("param_swap_dir")
    measured = {
        "losses": losses, "peak": hwm(),
        "resident": sum(e.shard.numel() * e.shard.element_size() for e in entries),
        "shards": sum(e.shard_numel * 4 for e in entries),
        "file_bytes": sum(os.path.getsize(os.path.join(swap_dir, f)) for f in os.listdir(swap_dir)) if swap_dir else 0,
        "buffers_peak": described.get("param_staging_buffers_peak"),
        "breakdown": engine.offload_breakdown(),
    }
    engine.close()
    return {**measured, "left": os.listdir(swap_dir) if swap_dir and os.path.isdir(swap_dir) else []}


def _run(tmp_path, keep: int, offload: str = "nvme") -> dict:
    from testkit.harness import spawn

    (tmp_path / f"{offload}{keep}").mkdir()  # nvme_path must exist: rayzero does not create it
    payload = {"root": str(tmp_path / f"{offload}{keep}"), "keep": keep, "offload": offload}
    (measured,) = spawn(1, _measure, payload, mmap_threshold=131072)
    return measured


def test_shards_swapped_out_train_exactly_like_shards_in_memory_and_free_their_memory(tmp_path) -> None:
    in_memory = _run(tmp_path, 0, offload="cpu")
    swapped = _run(tmp_path, 0)
    everything = _run(tmp_path, 1_000_000_000)  # DeepSpeed's default max_in_cpu: every shard stays
    # The same kernels on the same values: bitwise the same losses.
    assert swapped["losses"] == in_memory["losses"] == everything["losses"]
    shard_bytes = swapped["shards"]  # 12 x (1024 x 1024 + 1024) fp32 = 48 MiB
    assert swapped["resident"] == 0 and everything["resident"] == shard_bytes
    assert swapped["file_bytes"] >= shard_bytes and everything["file_bytes"] == 0
    # Read through at most buffer_count buffers at once, and the kernel saw the difference: the
    # swapped run peaked lower by most of the shards' bytes (3 staging buffers of 4 MiB remain).
    assert 1 <= swapped["buffers_peak"] <= 3
    saved = everything["peak"] - swapped["peak"]
    assert saved >= 0.6 * shard_bytes, (saved, shard_bytes)
    assert swapped["breakdown"]["nvme_param_read"] >= 0 and swapped["breakdown"]["nvme_param_write"] > 0
    assert swapped["left"] == []  # the swap file is scratch: gone after close()


def test_half_of_max_in_cpu_keeps_about_half_of_the_shards(tmp_path) -> None:
    half = _run(tmp_path, 6 * (1024 * 1024 + 1024))
    assert half["resident"] == half["shards"] // 2
    assert half["file_bytes"] >= half["shards"] // 2


def test_a_staging_buffer_smaller_than_a_shard_is_refused_naming_the_key(tmp_path) -> None:
    import torch

    import rayzero
    from rayzero.config.errors import RayZeroValueError

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0,
                                                      "buffer_size": 1000}}}
    with pytest.raises(RayZeroValueError, match=r"offload_param\.buffer_size = 1000 .*4096"):
        rayzero.initialize(model=torch.nn.Linear(64, 64), config=config)


def test_save_16bit_model_reads_swapped_shards(tmp_path) -> None:
    """stage3_gather_16bit_weights_on_model_save with every shard in the swap file: the saved
    weights are the model's (lr 0: unchanged by the step)."""
    import torch

    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}}}
    engine, *_ = rayzero.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 32)).sum())
    engine.step()
    assert engine.save_16bit_model(str(tmp_path / "out"))
    engine.close()
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert saved.keys() == initial.keys()
    assert all(torch.equal(saved[name], initial[name]) for name in initial)
