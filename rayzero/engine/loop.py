"""`engine.steps(total)`: the training loop that resumes by itself.

[Note: a loop that resumes]
`for step in range(total)` starts at 0 after every restart and every same-name rerun: it trains the
steps again, and its reports overwrite rows that were already right. The loop that is right after a
restart starts at the checkpoint's step and leaves at a planned stop. `engine.steps(total)` is that
loop, so copying the obvious shape gives the right one:

    for step in engine.steps(total):
        loss = engine(batch_for(step)); engine.backward(loss); engine.step()

When first called in a process that was given a resume point (`rayzero.get_context().resume_from`,
set after a restart, a resize or for a same-name rerun) it loads that checkpoint unless the loop
already loaded one; the checkpoint's `client_state` is then `engine.resumed_client_state`. It yields
`engine.global_steps` (optimizer steps done) while that is below `total` and the run was not told
to stop ([Note: agreed step boundary] in rayzero/workers/boundary.py: the stop checkpoint is already
committed when it leaves). One iteration may hold one micro step or a whole accumulation window:
it asks again after each. Under torchrun there is no resume point and no stop: `range` from the
engine's step.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from rayzero.config.environment import RESUME_FROM

logger = logging.getLogger("rayzero.engine")


def steps(engine: Any, total: int, stop_requested: Any) -> Iterator[int]:
    """See [Note: a loop that resumes]. Loads the resume point now (so the caller can read
    `engine.resumed_client_state` before the first step); `stop_requested()` is true once a planned
    stop committed."""
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ValueError(f"engine.steps(total={total!r}): give the number of optimizer steps to train, an int >= 0")
    resume = RESUME_FROM.get()
    if resume and not engine.resumed and engine.global_steps == 0:
        _, client_state = engine.load_checkpoint(resume)
        engine.resumed_client_state = client_state
        logger.info("resumed from %s at step %d", resume, engine.global_steps)
    engine.resumed = True  # a second steps() call in the same process does not load again
    return _count(engine, total, stop_requested)


def _count(engine: Any, total: int, stop_requested: Any) -> Iterator[int]:
    while engine.global_steps < total and not stop_requested():
        yield engine.global_steps
