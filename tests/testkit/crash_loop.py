"""A loop that reports a few steps and crashes once: rank 1 raises after step `crash_after` in attempt
0, and the next attempt starts at `resume_at`, as if the newest checkpoint were there (no engine: the
tests that use it check what the driver makes of a restart: metrics, progress lines, plots)."""
from __future__ import annotations

import time

import rayzero


def restarting_loop(config: dict) -> None:
    import torch.distributed as dist

    context = rayzero.get_context()
    first = 0 if context.attempt == 0 else config["resume_at"]
    for step in range(first, config["steps"]):
        time.sleep(config.get("sleep", 0.0))
        rayzero.report({"step": step, "attempt_seen": context.attempt, "loss": 5.0 - 0.5 * step,
                        "lr": 1e-3 * (step + 1), "samples": 8 * (step + 1)})
        # each step ends in a collective, as a training step does: rank 1 crashes after both ranks
        # reported the step (and rank 0 then waits in the next one's, as a real run does). Without it
        # rank 1 could run to its crash before rank 0 reported anything, and rank 0's reports made
        # after the failure went down with the group (CI saw metrics_history [2, 3, 4]).
        dist.barrier()
        if context.attempt == 0 and step == config["crash_after"] and context.rank == 1:
            raise RuntimeError(f"simulated crash after step {step}")
