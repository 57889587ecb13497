"""Checkpoint bandwidth vs the raw disk, and async blocking time vs a synchronous save.

    .venv/bin/python bench/checkpoint.py --json bench/checkpoint.json [--size-mb 1024] [--dir /tmp]

In one run, on the same directory: `dd` with direct I/O measures the disk (write oflag=direct,
read iflag=direct); a synchronous save (write + fsync + commit) and a load (read + checksum +
assembling every tensor) of a synthetic state of the same size measure rayzero; then an async save
measures how long the training thread is blocked. The shard files are evicted from the page cache
(posix_fadvise DONTNEED, no root needed) before each load so the load reads the disk like dd does.
Goals: save and load >= 0.80 of the disk bandwidth; async blocking <= 0.10 of the synchronous save.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec


def dd_bandwidth(path: str, size_mb: int) -> tuple[float, float]:
    """(write, read) bytes/s of `dd` with direct I/O in 64 MiB blocks."""
    blocks = max(1, size_mb // 64)

    def run(args: list[str]) -> float:
        result = subprocess.run(["dd", *args, "bs=64M", f"count={blocks}"], capture_output=True, text=True, check=True)
        match = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", result.stderr)
        return int(match.group(1)) / float(match.group(2))

    write = run(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"])
    read = run([f"if={path}", "of=/dev/null", "iflag=direct"])
    os.remove(path)
    return write, read


def synthetic_state(size_mb: int) -> list[ShardedTensor]:
    """A model-like state: a few large fp32 tensors and many small ones (~2% of the bytes)."""
    total = size_mb * (1 << 20) // 4
    shards, used, index = [], 0, 0
    small = max(1024, total // 50 // 200)
    while used < total:
        numel = small if index % 4 else min(total - used, max(small, total // 8))
        numel = min(numel, total - used)
        spec = ShardSpec(f"module/layer{index}.weight", (numel,), torch.float32, 0, numel)
        shards.append(ShardedTensor(spec, torch.randn(numel)))
        used += numel
        index += 1
    return shards


def async_vs_sync(work: str, size_mb: int, repeats: int) -> dict:
    """A real ZeroEngine (world 1, stage 1, SGD with momentum: module + master + momentum ~ size_mb)
    trains; the training thread's blocking time for an async save (inside save_checkpoint plus the
    wait at the snapshot fence before the next optimizer step) vs a synchronous save."""
    from rayzero.engine import checkpoint_io
    from rayzero.engine.api import initialize

    width = 2048
    layers = max(1, size_mb * (1 << 20) // (3 * 4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 1e-4, "momentum": 0.9}},
              "checkpoint": {"use_node_local_storage": False}}
    engine, *_ = initialize(model=model, config=config)
    inputs = torch.randn(8, width)

    def step() -> float:
        started = time.perf_counter()
        engine.backward(engine(inputs).square().mean())
        engine.step()
        return time.perf_counter() - started

    root = os.path.join(work, "engine")
    step_times = [step() for _ in range(3)]
    engine.save_checkpoint(root, tag="warmup")  # first save: builds the group, allocates the snapshot buffers
    checkpoint_io.wait_for_checkpoint(engine)
    syncs, blocked, async_totals = [], [], []
    for repeat in range(repeats):
        started = time.perf_counter()
        engine.save_checkpoint(root, tag=f"sync{repeat}", asynchronous=False)
        syncs.append(time.perf_counter() - started)
        checkpoint_io.wait_for_checkpoint(engine)  # its retention runs after the commit
        started = time.perf_counter()
        engine.save_checkpoint(root, tag=f"async{repeat}")
        while checkpoint_io.checkpointer_of(engine).saver.in_flight:  # keep training while it writes
            step_times.append(step())
        timings = checkpoint_io.wait_for_checkpoint(engine)
        async_totals.append(time.perf_counter() - started)
        blocked.append(timings.blocking)
    state_bytes = sum(s.local.numel() * s.local.element_size() for s in engine.state_shards())
    return {
        "engine_state_bytes": state_bytes,
        "engine_step_s": statistics.median(step_times),
        "sync_save_s": statistics.median(syncs),
        "async_blocking_s": statistics.median(blocked),
        "async_save_total_s": statistics.median(async_totals),
        "blocking_vs_sync": statistics.median(blocked) / statistics.median(syncs),
    }


def evict(tag_dir: str) -> None:
    for name in os.listdir(tag_dir):
        fd = os.open(os.path.join(tag_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the result here too")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true", help="bandwidth only, no engine run")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="rayzero-bench-ckpt-", dir=args.dir)
    try:
        state = synthetic_state(args.size_mb)
        nbytes = sum(shard.local.numel() * shard.local.element_size() for shard in state)
        specs = [shard.spec for shard in state]
        checkpointer = Checkpointer(CheckpointOptions(keep_last=1, async_save=False))
        disk_write, disk_read, saves, loads, write_phase, async_saves = [], [], [], [], [], []
        for repeat in range(args.repeats):
            write, read = dd_bandwidth(os.path.join(work, "dd.bin"), args.size_mb)
            disk_write.append(write)
            disk_read.append(read)
            started = time.perf_counter()
            checkpointer.save(work, f"sync{repeat}", repeat, 0, state, asynchronous=False)
            saves.append(nbytes / (time.perf_counter() - started))
            timings = checkpointer.wait()  # retention of the previous one, off the measured path
            write_phase.append(nbytes / timings.write)
            # async: snapshot into page-aligned buffers, then the background write needs no copy
            checkpointer.save(work, f"async{repeat}", repeat, 0, state, asynchronous=True)
            timings = checkpointer.wait()
            async_saves.append(nbytes / (timings.total - timings.blocking))
            evict(os.path.join(work, f"async{repeat}"))
            started = time.perf_counter()
            # into the (already allocated) state, as the engine does: streamed, checksummed, bounded memory
            loaded = checkpointer.load(work, specs, restore_rng=False,
                                       destinations={shard.spec.name: shard.local for shard in state})
            for spec in specs:
                loaded.read(spec)
            loads.append(nbytes / (time.perf_counter() - started))
            loaded.release()
        del state
        engine_result = {} if args.skip_engine else async_vs_sync(work, args.size_mb, args.repeats)
        result = {
            "bytes": nbytes,
            "repeats": args.repeats,
            "disk_write_bytes_per_s": statistics.median(disk_write),
            "disk_read_bytes_per_s": statistics.median(disk_read),
            "save_bytes_per_s": statistics.median(saves),
            "save_write_phase_bytes_per_s": statistics.median(write_phase),
            "async_save_bytes_per_s": statistics.median(async_saves),
            "async_save_vs_disk": statistics.median(async_saves) / statistics.median(disk_write),
            "load_bytes_per_s": statistics.median(loads),
            "save_vs_disk": statistics.median(saves) / statistics.median(disk_write),
            "load_vs_disk": statistics.median(loads) / statistics.median(disk_read),
            **engine_result,
            "samples": {"disk_write": disk_write, "disk_read": disk_read, "save": saves, "load": loads,
                        "async_save": async_saves},
        }
        result["goals"] = {
            "save_ge_0.80_disk": result["save_vs_disk"] >= 0.80,
            "load_ge_0.80_disk": result["load_vs_disk"] >= 0.80,
            "blocking_le_0.10_sync": result.get("blocking_vs_sync", float("inf")) <= 0.10,
        }
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
