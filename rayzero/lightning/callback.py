"""`RayZeroCallback`: what RayZeroStrategy adds to the Trainer's callbacks, so a Lightning script needs
no rayzero code: progress reports and planned stops.

Reports: after every optimizer step of the engine (not every micro-batch), `rayzero.report` gets
`step` (the trainer's `global_step`, as Lightning's logs and checkpoint names count it), `loss` (the
mean of `training_step`'s losses since the last report), `lr` (the first parameter group's), `epoch`,
`samples` (cumulative over all ranks, and over restarts and resumed fits: the count is part of the
callback's state in every checkpoint Lightning writes) and every scalar the module logged (`self.log(...)`, as the
Trainer's loggers see them). `rayzero status`, the progress line, metrics.parquet and `rayzero plot`
read those keys. Under plain torchrun they stay in the process (`rayzero.workers.local_reports()`).

[Note: Lightning planned stops]
A planned stop (`rayzero stop`, a resize, SIGTERM, a node drain) makes the engine's step-boundary
hook save at one step every rank reaches ([Note: agreed step boundary]). That save is the engine's
alone: it has no loop progress, so Lightning could not resume from it. The boundary is inside
`engine.step()`, i.e. inside Lightning's optimizer step, where the loops' counters are half-updated;
Lightning can only be checkpointed once the batch is done. So at `on_train_batch_end` of that step
(every rank is there: the stop was agreed) this callback writes a Lightning checkpoint
(`resume.stop_checkpoint_path`), waits for its commit, and sets `trainer.should_stop`: the fit ends
the way EarlyStopping ends it, `trainer.fit` returns, and `rayzero.get_context().should_stop()` is
true for code after it. Lightning then ends the epoch early (validation, and ModelCheckpoint may save
at the same step with the epoch counted as done); a restart prefers the stop's own checkpoint at that
step (`checkpoints.PLANNED_STOP`), which resumes inside the epoch. It then takes the engine's step-boundary hook off: the hook would refuse
the forward passes of the validation Lightning still runs on stopping (it ends loops that never
check `should_stop`). Should Lightning go on training (its `min_epochs`/`min_steps` not reached),
the next batch raises `RunStopped`, the worker's clean-stop signal.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from rayzero.engine.engine import set_step_boundary_hook
from rayzero.lightning.checkpoints import PLANNED_STOP
from rayzero.lightning.resume import stop_checkpoint_path
from rayzero.workers import RunStopped, get_context, report

logger = logging.getLogger(__name__)


class RayZeroCallback(Callback):
    """Reports progress to rayzero and honours planned stops ([Note: Lightning planned stops])."""

    def __init__(self) -> None:
        self._losses: list[float] = []  # training_step losses since the last report
        self._samples = 0  # samples this rank trained on in this fit
        self._samples_before = 0  # samples of all ranks before this fit: from the checkpoint it resumed
        self._world_size = 1
        self._reported_step = -1  # the engine's global_steps at the last report
        self._lr = 0.0  # the learning rate of the step under way (read before the scheduler moves it)
        self.stopped_at: str | None = None  # the checkpoint a planned stop wrote
        self._stopping = False  # the stop checkpoint is being written

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._losses, self._samples, self.stopped_at = [], 0, None
        self._world_size = trainer.world_size
        self._reported_step = trainer.strategy.engine.global_steps

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.stopped_at is not None:
            raise RunStopped(f"the run was stopped at step {trainer.global_step} (checkpoint {self.stopped_at}); "
                             "Lightning went on training because min_epochs/min_steps were not reached")
        self._lr = float(trainer.strategy.engine.get_lr()[0])
        try:
            self._samples += extract_batch_size(batch)
        except Exception as error:  # noqa: BLE001 - a batch Lightning cannot size still trains; count none
            logger.debug("rayzero: no batch size for the samples count: %s", error)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # automatic optimization hands back the loss divided by accumulate_grad_batches
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._losses.append(float(loss.detach()) * scale)
        engine = trainer.strategy.engine
        if engine.global_steps != self._reported_step:
            self._reported_step = engine.global_steps
            report(self._metrics(trainer, engine))
        if get_context().should_stop() and self.stopped_at is None:
            self._stop(trainer)

    def _metrics(self, trainer: Any, engine: Any) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        for name, value in trainer.logged_metrics.items():
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                metrics[name] = float(value)
        metrics.update(step=trainer.global_step, epoch=trainer.current_epoch, lr=self._lr,
                       samples=self._samples_total())
        if self._losses:
            metrics["loss"] = sum(self._losses) / len(self._losses)
            self._losses = []
        return metrics

    def _samples_total(self) -> int:
        return self._samples_before + self._samples * self._world_size

    def state_dict(self) -> dict[str, Any]:
        # Lightning keeps it in the checkpoint's "callbacks" and hands it back on resume, so a restart
        # or a resumed fit counts on from the checkpoint instead of from 0 (all ranks' samples: a
        # resume at another world size counts on correctly too).
        return {"samples": self._samples_total()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._samples_before = int(state_dict.get("samples", 0))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._stopping:
            checkpoint[PLANNED_STOP] = True  # preferred by a restart over what Lightning saves after it

    def _stop(self, trainer: Any) -> None:
        path = stop_checkpoint_path(trainer)
        self._stopping = True
        try:
            trainer.save_checkpoint(path)
        finally:
            self._stopping = False
        trainer.strategy.engine.wait_for_checkpoint()  # committed before the group may go down
        self.stopped_at = path
        trainer.should_stop = True
        set_step_boundary_hook(None)  # the stop is saved and agreed; validation may still run forward
        if trainer.is_global_zero:
            logger.warning("rayzero: planned stop at step %d, checkpoint %s", trainer.global_step, path)
