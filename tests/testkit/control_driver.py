"""A real `rayzero.fit` run that serves the control plane, as the script a user would run:

    python control_driver.py NAME STORAGE_URI [STEPS] [WORKERS]

A linear model trained with SGD until STEPS (default: practically forever) or until the control
service stops it; it resumes from `context.resume_from`, never saves by itself (so a checkpoint
proves a control call), and reports step, loss, the step it started at and the wall time. Ends by
printing one `RESULT {...}` line (`result(output)` reads it back). Used by the control-plane end to
end tests, on a local Ray (tests/ray) and under the operator (tests/k8s).
"""
from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

PATH = Path(__file__)
"""Run this file in a subprocess: `[sys.executable, str(PATH), name, storage, ...]`."""


def loop(config: dict) -> None:
    import torch

    import rayzero

    context = rayzero.get_context()
    torch.manual_seed(0)
    engine, _, _, _ = rayzero.initialize(model=torch.nn.Linear(8, 1))
    if context.resume_from:
        engine.load_checkpoint(context.resume_from)
    started_at = engine.global_steps
    inputs, targets = torch.randn(16, 8), torch.randn(16, 1)
    should_stop = getattr(context, "should_stop", lambda: False)
    while engine.global_steps < config["steps"] and not should_stop():
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        rayzero.report({"step": engine.global_steps, "loss": float(loss), "started_at": started_at,
                        "time": time.time()})
        time.sleep(config["sleep"])


def result(output: str) -> dict:
    """The `RESULT {...}` line of the script's output, as a dict."""
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return ast.literal_eval(line[len("RESULT "):])


def main(name: str, storage: str, steps: str = "100000", workers: str = "2") -> None:
    import rayzero

    outcome = rayzero.fit(loop, config={"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0,
                                        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
                          scaling=rayzero.ScalingConfig(num_workers=int(workers)),
                          run=rayzero.RunConfig(name=name, storage=storage, progress_interval_s=60),
                          train_loop_config={"steps": int(steps), "sleep": 0.05})
    history = outcome.metrics_history
    first = [m for m in history if "started_at" in m][:1]
    print("RESULT", {"stopped": getattr(outcome, "stopped", None), "steps": len(history),
                     "started_at": first[0]["started_at"] if first else None,
                     "last_step": history[-1]["step"] if history else None,
                     "step_times": [m["time"] for m in history if "time" in m][-20:]}, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
