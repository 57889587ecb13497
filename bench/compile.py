"""engine.compile() against the same engine eager, side by side in one process ([Note: compiling
stage 3] in rayzero/engine/compile.py).

    python bench/compile.py --json bench/results/compile-cpu.json               # CPU: a small GPT
    python bench/compile.py --device cuda --size gpt2-medium --precision bf16   # the issue's GPU check

Two engines on two copies of the same model (same seed), one eager and one compiled, in one
process group of one rank (gloo on CPU, NCCL on CUDA), trained on the same batches. After the
compiled engine's first step (which compiles; its seconds are reported as `compile_s`) and
`--warmup` more steps each, `--rounds` interleaved rounds time `--steps` steps of each engine, the
order alternating per round; a step is forward + backward + optimizer step, the device idle at the
clock's stops. Per round: each engine's median step, in wall and in the process's CPU seconds (what
other load on a shared machine moves least; on CUDA the wall figure is the one that counts); the
speedup is eager / compiled (> 1: compiled faster), reported as the median over rounds with its
min and max. Losses of both engines are kept
for every step: they must agree (fp32: ~1e-5).

Models (bench/models.py's GPT: pre-norm blocks in a ModuleList, untied head): `small` is its `full`
size (4.2 M parameters, width 256, 4 blocks, seq 128, batch 8); `gpt2-medium` is GPT-2 medium's
shape (24 blocks of width 1024, 16 heads, vocab 50257, seq 1024; ~405 M parameters untied), batch 8.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # `bench` as a package

import torch

from bench.models import FULL, GPT, GPTSpec

SIZES = {"small": FULL["gpt"],
         "gpt2-medium": GPTSpec(vocab_size=50257, width=1024, depth=24, heads=16, sequence_length=1024,
                                batch_per_rank=8)}


def _batch(spec: GPTSpec, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    shape = (spec.batch_per_rank, spec.sequence_length + 1)
    tokens = torch.randint(0, spec.vocab_size, shape, generator=generator)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _config(stage: int, precision: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # every parameter gathered and released, as in bench/engine.py
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine(spec: GPTSpec, stage: int, precision: str, device: torch.device) -> Any:
    import rayzero

    torch.manual_seed(1234)
    model = GPT(spec).to(device)
    engine, *_ = rayzero.initialize(model=model, config=_config(stage, precision))
    return engine


def _step(engine: Any, spec: GPTSpec, step: int, device: torch.device) -> tuple[float, float, float]:
    """Seconds of one optimizer step (device idle at both ends), the process's CPU seconds in it
    (all threads; what other load on the cores moves least), and its loss."""
    inputs = _batch(spec, step, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    loss = engine(*inputs)
    engine.backward(loss)
    engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, time.process_time() - cpu_started, float(loss)


def run_stage(args: argparse.Namespace, stage: int, device: torch.device) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    spec = SIZES[args.size]
    torch._dynamo.reset()
    counters.clear()
    eager = _engine(spec, stage, args.precision, device)
    compiled = _engine(spec, stage, args.precision, device)
    compiled.compile(backend=args.backend, compile_kwargs=json.loads(args.compile_kwargs))
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    compile_s, _, first = _step(compiled, spec, 0, device)  # traces and compiles
    losses["compiled"].append(first)
    losses["eager"].append(_step(eager, spec, 0, device)[2])
    step = 0
    for step in range(1, 1 + args.warmup):
        for name, engine in (("eager", eager), ("compiled", compiled)):
            losses[name].append(_step(engine, spec, step, device)[2])
    rounds: dict[str, list[float]] = {"eager": [], "compiled": [], "eager_cpu": [], "compiled_cpu": []}
    for round_index in range(args.rounds):
        order = (("eager", eager), ("compiled", compiled))
        for name, engine in order if round_index % 2 == 0 else order[::-1]:
            times, cpu_times = [], []
            for offset in range(args.steps):
                seconds, cpu_seconds, loss = _step(engine, spec, step + 1 + offset, device)
                times.append(seconds)
                cpu_times.append(cpu_seconds)
                losses[name].append(loss)
            rounds[name].append(statistics.median(times))
            rounds[f"{name}_cpu"].append(statistics.median(cpu_times))
        step += args.steps
    speedups = [e / c for e, c in zip(rounds["eager"], rounds["compiled"])]
    cpu_speedups = [e / c for e, c in zip(rounds["eager_cpu"], rounds["compiled_cpu"])]
    pairs = list(zip(losses["eager"], losses["compiled"]))
    row = {"stage": stage, "size": args.size, "precision": args.precision, "backend": args.backend,
           "device": str(device), "compile_s": compile_s,
           "eager_step_s_rounds": rounds["eager"], "compiled_step_s_rounds": rounds["compiled"],
           "eager_step_cpu_s_rounds": rounds["eager_cpu"],
           "compiled_step_cpu_s_rounds": rounds["compiled_cpu"],
           "speedup_median": statistics.median(speedups), "speedup_min": min(speedups),
           "speedup_max": max(speedups),
           "cpu_speedup_median": statistics.median(cpu_speedups), "cpu_speedup_min": min(cpu_speedups),
           "cpu_speedup_max": max(cpu_speedups),
           "max_loss_difference": max(abs(a - b) for a, b in pairs),
           "losses": losses, "dynamo": {"graphs": counters["stats"]["unique_graphs"],
                                        "graph_breaks": sum(counters["graph_break"].values()),
                                        "recompiles": sum(counters["recompiles"].values())}}
    eager.close()
    compiled.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--stages", default="3", help="comma-separated ZeRO stages (default 3)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--compile-kwargs", default="{}", help="engine.compile's compile_kwargs, as JSON")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from rayzero.ports import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision != "fp32"
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    rows = [run_stage(args, int(stage), device) for stage in args.stages.split(",")]
    result = {"results": rows, "meta": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "argv": sys.argv[1:]}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
