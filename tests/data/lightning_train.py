"""A Lightning training script as a user writes it: Lightning's demo BoringModel trained with
`RayZeroStrategy(stage=3, offload_optimizer=True)`, checkpointed by `ModelCheckpoint` every epoch, and
no other rayzero code: no resume logic, no reporting.

    torchrun --nproc_per_node 2 lightning_train.py OUT [--epochs N]
    rayzero run lightning_train.py --workers 2 -- OUT [--epochs N]
    rayzero.fit(lightning_train.train, train_loop_config={"out": OUT}, ...)

`--crash-at-epoch E` (tests only): on the first attempt of a rayzero run, rank 1 dies at the start of
epoch E (once its last checkpoint is committed); `--batch-sleep S`: each batch takes S seconds more. `reference_weights(epochs)` is the oracle the tests
compare with: what the same SGD steps give computed with plain torch, no Lightning loop, no engine.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

BATCHES = 4  # per epoch and rank
SEED = 7


def train(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
    from lightning.pytorch.loggers import CSVLogger

    from rayzero.lightning import RayZeroStrategy

    class CrashOnce(Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            import rayzero

            if trainer.current_epoch == config["crash_at_epoch"] and rayzero.get_context().attempt == 0 \
                    and trainer.global_rank == 1:
                trainer.strategy.engine.wait_for_checkpoint()
                os._exit(1)

    class Slow(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            time.sleep(config["batch_sleep"])

    pl.seed_everything(SEED)
    model, data = BoringModel(), BoringDataModule()
    out = config["out"]
    callbacks = [ModelCheckpoint(every_n_epochs=1, save_top_k=-1)]  # <out>/lightning_logs/version_N/checkpoints
    if config.get("crash_at_epoch") is not None:
        callbacks.append(CrashOnce())
    if config.get("batch_sleep"):
        callbacks.append(Slow())
    trainer = pl.Trainer(strategy=RayZeroStrategy(stage=3, offload_optimizer=True), accelerator="cpu", devices=2,
                         max_epochs=config.get("epochs", 2), limit_train_batches=BATCHES, limit_val_batches=2,
                         default_root_dir=out, logger=CSVLogger(out), callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))


def reference_weights(epochs: int) -> dict[str, Any]:
    """BoringModel's own optimizer and scheduler stepped by hand on the batches two ranks see: the
    DistributedSampler Lightning puts on a train dataloader (shuffled with the seed, reshuffled each
    epoch), gradients averaged over the ranks."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
    from torch.utils.data import DistributedSampler

    pl.seed_everything(SEED, verbose=False)
    model, data = BoringModel(), BoringDataModule()
    data.setup("fit")
    [optimizer], [scheduler] = model.configure_optimizers()
    samplers = [DistributedSampler(data.random_train, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
                for rank in (0, 1)]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(sampler) for sampler in samplers]
        for step in range(BATCHES):
            batch = torch.stack([data.random_train[order[step]] for order in orders])
            model.loss(model(batch)).backward()  # the mean over both ranks' samples
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at-epoch", type=int, default=None)
    parser.add_argument("--batch-sleep", type=float, default=0.0)
    arguments = parser.parse_args()
    train({"out": arguments.out, "epochs": arguments.epochs, "crash_at_epoch": arguments.crash_at_epoch,
           "batch_sleep": arguments.batch_sleep})
