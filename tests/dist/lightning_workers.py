"""What the ranks of tests/dist/test_lightning_strategy.py run: Lightning's own demo models trained by
`Trainer(strategy=RayZeroStrategy(...))` and by `strategy="ddp"`, in one spawned group (Lightning
forms the gloo group itself from RANK/WORLD_SIZE, as under torchrun)."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

DATA_SEED = 7
BATCHES = 4  # per epoch


def no_group(rank: int, world_size: int) -> None:
    """The spawn's init: no process group; the Trainer forms it (as under torchrun)."""
    torch.set_num_threads(1)


def _quiet_trainer(**kwargs: Any):
    import lightning.pytorch as pl

    options = {"accelerator": "cpu", "devices": 2, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "enable_checkpointing": False, "num_sanity_val_steps": 0,
               "limit_train_batches": BATCHES, "limit_val_batches": 2}
    options.update(kwargs)
    return pl.Trainer(**options)


def _strategy(spec: dict[str, Any]):
    from rayzero.lightning import RayZeroStrategy

    if spec.get("kind", "rayzero") == "ddp":
        return "ddp"
    return RayZeroStrategy(**spec.get("keywords", {}))


def steps_callback():
    """A callback recording the trainer's global_step where training starts and validation runs."""
    from lightning.pytorch.callbacks import Callback

    class Steps(Callback):
        def __init__(self) -> None:
            self.start_step: int | None = None
            self.validated = 0

        def on_train_start(self, trainer, pl_module) -> None:
            self.start_step = trainer.global_step

        def on_validation_end(self, trainer, pl_module) -> None:
            self.validated += 1

    return Steps()


def boring(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Lightning's BoringModel on BoringDataModule (its data drawn at construction, so every
    strategy sees the same samples); saves with trainer.save_checkpoint(spec['save'])."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from rayzero.workers import local_reports

    class ConstantRate(BoringModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)  # BoringModel's, without its 10x decay per epoch

    class BuiltInConfigureModel(BoringModel):
        """Its layer built in `configure_model` (under the strategy's model_sharded_context)."""

        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.partitioned_at_build: bool | None = None

        def configure_model(self) -> None:
            self.layer = torch.nn.Linear(32, 2)
            # under rayzero.zero.Init a parameter is a meta stand-in until the context partitions it
            self.partitioned_at_build = self.layer.weight.device.type == "meta"

    class Manual(BoringModel):
        """Manual optimization: Lightning hands backward and the step to the strategy as written."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = self.step(batch)
            self.manual_backward(loss)
            optimizer.step()
            return {"loss": loss}

    class TwoOptimizers(Manual):  # Lightning itself allows several only with manual optimization
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.2)]

    kinds = {"constant_rate": ConstantRate, "configure_model": BuiltInConfigureModel, "manual": Manual,
             "two_optimizers": TwoOptimizers}
    pl.seed_everything(DATA_SEED, verbose=False)
    model, data = kinds.get(spec.get("model"), BoringModel)(), BoringDataModule()
    if spec.get("model_seed") is not None:  # a different start, to show that a checkpoint loaded
        torch.manual_seed(spec["model_seed"])
        model = BoringModel()
    steps = steps_callback()
    options = dict(spec.get("trainer", {}))
    if spec.get("plugin"):  # fp16 on the CPU: Lightning would turn precision="16-mixed" into bf16 there
        from rayzero.lightning import RayZeroPrecision

        options["plugins"] = [RayZeroPrecision(spec["plugin"])]
    trainer = _quiet_trainer(strategy=_strategy(spec), max_epochs=spec.get("epochs", 1), callbacks=[steps],
                             **options)
    reports_before = len(local_reports())
    if spec.get("refused"):  # a setting the strategy refuses: the error every rank raises
        try:
            trainer.fit(model, datamodule=data)
        except Exception as error:  # noqa: BLE001 - returned for the test to read
            return {"refused": f"{type(error).__name__}: {error}"}
        return {"refused": None}
    trainer.fit(model, datamodule=data, ckpt_path=spec.get("ckpt_path"))
    out: dict[str, Any] = {"start_step": steps.start_step, "global_step": trainer.global_step,
                           "reports": [r.metrics for r in local_reports()[reports_before:]],
                           "weight_dtype": trainer.lightning_module.layer.weight.dtype,
                           "partitioned_at_build": getattr(model, "partitioned_at_build", None)}
    if spec.get("save"):
        trainer.save_checkpoint(spec["save"])
    if spec.get("predict"):
        out["predictions"] = predict(rank, {**spec, "ckpt_path": spec["predict"]})["predictions"]
    return out


def streams(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The issue's program: `seed_everything(0)`, Lightning's BoringModel with its own dataloaders
    (its dataset drawn when `train_dataloader` runs), 10 steps (or on from spec['ckpt_path'] to
    spec['max_steps']); the random streams at `on_train_start` and, once trained, at the end; saves the
    weights to spec['save']."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel
    from random_streams import random_states

    class AtTrainStart(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.states = random_states()

    pl.seed_everything(0, verbose=False)
    model, at_start = BoringModel(), AtTrainStart()
    trainer = _quiet_trainer(strategy=_strategy(spec), max_steps=spec.get("max_steps", 10), limit_train_batches=1.0,
                             callbacks=[at_start])
    trainer.fit(model, ckpt_path=spec.get("ckpt_path"))
    trainer.save_checkpoint(spec["save"])
    return {"at_train_start": at_start.states, "at_end": random_states(), "global_step": trainer.global_step}


def predict(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh Trainer (validate/test/predict only: an engine with no optimizer step) predicting with
    the weights of spec['ckpt_path'], on `devices` ranks."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    pl.seed_everything(DATA_SEED, verbose=False)
    BoringModel()  # the same draws as the training runs, then their data
    data = BoringDataModule()
    trainer = _quiet_trainer(strategy=_strategy(spec), devices=spec.get("devices", 2))
    return {"predictions": trainer.predict(BoringModel(), datamodule=data, ckpt_path=spec["ckpt_path"])}


def transformer(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Lightning's demo LightningTransformer (its Transformer, small) on WikiText2 read from a synthetic
    text file (WikiText2(download=False): nothing is downloaded)."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos import LightningTransformer, Transformer, WikiText2
    from torch.utils.data import DataLoader

    class Tiny(LightningTransformer):
        def __init__(self, vocab_size: int) -> None:
            pl.LightningModule.__init__(self)
            self.model = Transformer(vocab_size=vocab_size, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)

        def prepare_data(self) -> None:
            pass  # the demo's would download WikiText2

    dataset = WikiText2(data_dir=Path(spec["data_dir"]), block_size=8, download=False)
    pl.seed_everything(DATA_SEED, verbose=False)
    model = Tiny(dataset.vocab_size)
    trainer = _quiet_trainer(strategy=_strategy(spec), max_epochs=1)
    trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=2))
    trainer.save_checkpoint(spec["save"])
    return {"global_step": trainer.global_step}


def write_text(path: str, words: int = 600, vocabulary: int = 30) -> None:
    """A WikiText2-like file: lines of words from a small vocabulary, the same on every call."""
    chooser = random.Random(0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = [" ".join(f"w{chooser.randrange(vocabulary)}" for _ in range(12)) for _ in range(words // 12)]
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def planned_stop(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A planned stop through the real step-boundary hook of a rayzero worker (installed by hand, as
    the Ray worker installs it): rank 0 alone is asked to stop after batch `ask_at`; the ranks agree on
    the next step, the trainer saves and stops. Then, as a restart (RAYZERO_ATTEMPT=1), a new Trainer
    that calls plain fit(model) resumes from the stop checkpoint by itself."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from rayzero.engine.engine import set_step_boundary_hook
    from rayzero.workers import session
    from rayzero.workers.boundary import BoundaryRequest, StepBoundary

    class AskToStop(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if rank == 0 and trainer.global_step == spec["ask_at"]:
                boundary.request(1, BoundaryRequest.STOP)  # as the controller's request reaches one rank

    def run(attempt: int) -> dict[str, Any]:
        os.environ["RAYZERO_ATTEMPT"] = str(attempt)
        pl.seed_everything(DATA_SEED, verbose=False)
        model, data = BoringModel(), BoringDataModule()
        if attempt:
            torch.manual_seed(123)
            model = BoringModel()  # another start: only the checkpoint can bring it back
        steps = steps_callback()
        checkpoints = ModelCheckpoint(dirpath=spec["dirpath"], save_top_k=0)
        trainer = _quiet_trainer(strategy=_strategy(spec), max_epochs=2, enable_checkpointing=True,
                                 callbacks=[steps, checkpoints] + ([] if attempt else [AskToStop()]))
        trainer.fit(model, datamodule=data)
        from rayzero.workers import get_context

        out = {"start_step": steps.start_step, "global_step": trainer.global_step, "validated": steps.validated,
               "should_stop": trainer.should_stop, "context_should_stop": get_context().should_stop(),
               "files": sorted(os.listdir(spec["dirpath"]))}
        trainer.save_checkpoint(spec["save"].format(attempt=attempt))
        return out

    boundary = StepBoundary(rank, "node", checkpoint_dir=spec["run_dir"])
    os.environ["RAYZERO_CHECKPOINT_DIR"] = spec["run_dir"]
    session.activate(session.WorkerSession(rank=rank, boundary=boundary))
    set_step_boundary_hook(boundary)
    try:
        stopped = run(0)
    finally:
        set_step_boundary_hook(None)
        session.activate(None)
    try:
        resumed = run(1)
    finally:
        os.environ.pop("RAYZERO_ATTEMPT", None)
    return {"stopped": stopped, "resumed": resumed, "stop_committed": boundary.stop_committed}


CASES = {"boring": boring, "streams": streams, "predict": predict, "transformer": transformer,
         "planned_stop": planned_stop}


def run_cases(rank: int, world_size: int, cases: list[tuple[str, str, dict]]) -> dict[str, Any]:
    """Each (name, kind, spec) in order on every rank; results by name (one failure fails the spawn)."""
    return {name: CASES[kind](rank, spec) for name, kind, spec in cases}
