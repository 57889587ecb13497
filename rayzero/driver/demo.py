"""`rayzero demo`: train the built-in character language model (rayzero/demo) on Ray workers.

Prints a short summary (steps, initial/final loss, throughput, where metrics and the checkpoint
went); `--json PATH` writes it as JSON too.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rayzero.config.run_settings import RunConfig, ScalingConfig
from rayzero.controller.errors import TrainingFailedError
from rayzero.driver.cli import add_run_flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    parser.add_argument("--workers", type=int, default=2, help="workers / ranks (default 2)")
    parser.add_argument("--config", default=None,
                        help="DeepSpeed JSON config (default: ZeRO stage 3, AdamW, micro batch 16)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the summary here")
    add_run_flags(parser)  # --storage, --name, --gpus-per-worker, --trainer, as `rayzero run`
    return parser


def summarize(result: Any, steps: int, workers: int) -> dict[str, Any]:
    losses = [m["loss"] for m in result.metrics_history if isinstance(m.get("loss"), (int, float))]
    if not losses:
        raise TrainingFailedError("the demo loop reported no loss; nothing to summarize")
    tail = losses[-10:]  # a mean over the last steps: one batch's loss is noisy
    return {
        "steps": len(losses),
        "requested_steps": steps,
        "workers": workers,
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "samples_per_s": result.timings.get("samples_per_s"),
        "tokens_per_s": result.timings.get("tokens_per_s"),
        "fit_to_first_step_s": result.timings.get("fit_to_first_report_s"),
        "total_s": result.timings.get("total_s"),
        "metrics": result.metrics_path,
        "checkpoint": result.checkpoint,
        "run": result.path,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from rayzero.config import ConfigError
    from rayzero.demo.train import DEFAULT_DS_CONFIG, train_loop
    from rayzero.driver.fit import fit

    resources = {"CPU": 1.0}
    if args.gpus_per_worker:
        resources["GPU"] = args.gpus_per_worker
    try:
        result = fit(
            train_loop,
            config=args.config or DEFAULT_DS_CONFIG,
            scaling=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus_per_worker > 0,
                                  resources_per_worker=resources),
            run=RunConfig(name=args.name, storage=args.storage),
            train_loop_config={"steps": args.steps},
            trainer=dict(args.trainer) or None,
        )
        summary = summarize(result, args.steps, args.workers)
    except ConfigError as error:
        print(f"rayzero demo: the config was rejected, no worker was started.\n{error}", file=sys.stderr)
        return 2
    except TrainingFailedError as error:
        print(f"rayzero demo: {error}", file=sys.stderr)
        return 1
    rate = summary["tokens_per_s"]
    print(
        f"\nrayzero demo: {summary['steps']} steps on {args.workers} workers, "
        f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the last 10 steps)"
        + (f", {summary['samples_per_s']:.1f} samples/s, {rate:.0f} tokens/s" if rate else "")
        + f"\n  first step {summary['fit_to_first_step_s']:.1f}s after start, total {summary['total_s']:.1f}s"
        f"\n  metrics:    {summary['metrics']}\n  checkpoint: {summary['checkpoint'] or 'none'}"
        f"\n  picture:    rayzero plot {summary['metrics'].rsplit('/', 1)[0]} -o run.png"
    )
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(summary, handle, indent=2)
        print(f"  summary:    {args.json_path}")
    return 0
