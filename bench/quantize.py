"""Block quantization speed (rayzero/engine/quantize.py, ZeRO++'s qwZ/qgZ kernels), printed as JSON:

    python bench/quantize.py [--numel 16777216] [--rounds 9] [--device cpu|cuda] [--threads N]
                             [--chunks 65536,...] [--json out.json]

Side by side in one run, interleaved round by round (each round times every case once, in order):
quantize at 8 and 4 bits from fp32 and from bf16, dequantize into a preallocated fp32 and bf16 tensor,
and the baselines a quantized collective replaces: a cast fp32 -> bf16 into a preallocated tensor (what
an unquantized bf16 gather packs) and a plain bf16 copy. Each figure: median, min and max in ms over
`--rounds`; `ratio_to_bf16_copy` divides medians. `--chunks` also times quantize/dequantize (8 bits,
fp32) at other CPU chunk sizes (quantize.CPU_CHUNK_ELEMENTS). Wall time and this process's CPU
time (the figure to read on a shared machine with --threads 1).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench` as a package, rayzero from this tree

from bench import report
from rayzero.engine import quantize


def _cases(numel: int, device: str) -> dict[str, Callable[[], object]]:
    generator = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(numel, generator=generator, device=device)
    x16 = x32.to(torch.bfloat16)
    out32 = torch.empty(numel, device=device)
    out16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    q8, q4 = quantize.quantize_blockwise(x32, 8), quantize.quantize_blockwise(x32, 4, group_size=4096)
    return {
        "bf16_cast_from_fp32": lambda: out16.copy_(x32),
        "bf16_copy": lambda: out16.copy_(x16),
        "quantize8_fp32": lambda: quantize.quantize_blockwise(x32, 8),
        "quantize8_bf16": lambda: quantize.quantize_blockwise(x16, 8),
        "quantize4_fp32": lambda: quantize.quantize_blockwise(x32, 4, group_size=4096),
        "quantize4_bf16": lambda: quantize.quantize_blockwise(x16, 4, group_size=4096),
        "dequantize8_to_fp32": lambda: quantize.dequantize_blockwise(q8, torch.float32, out=out32),
        "dequantize8_to_bf16": lambda: quantize.dequantize_blockwise(q8, torch.bfloat16, out=out16),
        "dequantize4_to_fp32": lambda: quantize.dequantize_blockwise(q4, torch.float32, out=out32),
        "dequantize4_to_bf16": lambda: quantize.dequantize_blockwise(q4, torch.bfloat16, out=out16),
    }


def _chunk_cases(numel: int, chunks: list[int]) -> dict[str, Callable[[], object]]:
    x32 = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    out32 = torch.empty(numel)
    q8 = quantize.quantize_blockwise(x32, 8)

    def at(chunk: int, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            saved, quantize.CPU_CHUNK_ELEMENTS = quantize.CPU_CHUNK_ELEMENTS, chunk
            try:
                return fn()
            finally:
                quantize.CPU_CHUNK_ELEMENTS = saved
        return run

    cases = {}
    for chunk in chunks:
        cases[f"quantize8_fp32_chunk{chunk}"] = at(chunk, lambda: quantize.quantize_blockwise(x32, 8))
        cases[f"dequantize8_to_fp32_chunk{chunk}"] = at(
            chunk, lambda: quantize.dequantize_blockwise(q8, torch.float32, out=out32))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunks", default="", help="comma-separated CPU chunk sizes to compare too")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = _cases(args.numel, args.device)
    if args.chunks:
        cases.update(_chunk_cases(args.numel, [int(c) for c in args.chunks.split(",")]))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up: first-use costs out of the rounds
        fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - start_cpu) * 1e3)

    def spread(times: dict[str, list[float]]) -> dict:
        return {name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
                for name, values in times.items()}

    def ratios(times: dict[str, list[float]]) -> dict:
        baseline = statistics.median(times["bf16_copy"])
        return {name: statistics.median(values) / baseline for name, values in times.items()}

    result = {
        "numel": args.numel, "device": args.device, "threads": torch.get_num_threads(),
        "chunk_elements": quantize.CPU_CHUNK_ELEMENTS,
        "ms": spread(wall), "ratio_to_bf16_copy": ratios(wall),
        # CPU time of this process: on a shared machine the wall time also counts the time the
        # process waited for a core; with one thread the CPU time is the work done
        "cpu_ms": spread(cpu), "cpu_ratio_to_bf16_copy": ratios(cpu),
        "machine": report.machine_description(),
    }
    report.emit(result, args.json)


if __name__ == "__main__":
    main()
