"""rayzero's `TrainerCallback` ([Note: the Trainer in a rayzero run] in trainer.py)."""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from rayzero.workers import session
from rayzero.workers.boundary import BoundaryRequest


def _handled_request() -> tuple[int, int] | None:
    """(kind, step) of the newest request the ranks carried out at an agreed boundary, if any."""
    active = session._ACTIVE
    boundary = getattr(active, "boundary", None)
    handled = getattr(boundary, "_handled", None)  # written under the boundary's lock, read whole
    return None if handled is None else (handled.kind, handled.step)


class RayZeroCallback(TrainerCallback):
    """Reports the Trainer's logs to rayzero and saves `checkpoint-N` where the ranks agreed to."""

    def __init__(self) -> None:
        self._saved_for: tuple[int, int] | None = None  # the handled request already turned into a save
        # Everything logged at the current step: the Trainer logs a step's loss, then maybe its eval
        # or the end-of-training summary at the same step, and rayzero's metrics log keeps one row
        # per (rank, step), the newest; so each report carries the step's metrics so far.
        self._step_metrics: dict[str, Any] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        metrics = {key: value for key, value in (logs or {}).items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if not metrics:
            return
        if self._step_metrics.get("step") != state.global_step:
            self._step_metrics = {}
        metrics = self._step_metrics = {**self._step_metrics, **metrics}
        metrics["step"] = state.global_step
        metrics["samples"] = (state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps
                              * args.world_size)
        if getattr(state, "num_input_tokens_seen", 0):
            metrics["tokens"] = state.num_input_tokens_seen
        session.report(metrics)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handled = _handled_request()
        if handled is None or handled == self._saved_for or handled[1] != state.global_step:
            return
        self._saved_for = handled
        control.should_save = True
        if handled[0] == BoundaryRequest.STOP:
            control.should_training_stop = True


def add_callback(trainer: Any) -> None:
    """Add rayzero's callback to `trainer` once."""
    if not any(isinstance(callback, RayZeroCallback) for callback in trainer.callback_handler.callbacks):
        trainer.add_callback(RayZeroCallback())
