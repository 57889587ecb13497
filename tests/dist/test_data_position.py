"""The training dataloader resumes mid-epoch at any world size ([Note: data position]).

`rayzero.initialize(training_data=...)` builds the loader on a `ResumableSampler`; a checkpoint
stores the consumed samples and `load_checkpoint` puts the sampler back there. An uninterrupted
2-rank run saves mid-epoch and keeps going across an epoch boundary; 3-rank and 1-rank runs resume
from that checkpoint. Every item carries its own index, so each run reports the exact global order
of the samples each optimizer step consumed: the resumed runs must consume the very same sequence
(no sample repeated, none skipped), and so train to the same losses.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from testkit.harness import spawn

from rayzero.checkpoint.manifest import read_latest

DATASET_SIZE = 62  # 5 global batches per epoch; the 2-sample tail is dropped every epoch
GLOBAL_BATCH = 12
SAMPLES_PER_EPOCH = DATASET_SIZE // GLOBAL_BATCH * GLOBAL_BATCH
SAVE_AT = 3  # mid-way through epoch 0
TOTAL_STEPS = 9  # epoch 1 starts at step 5
MICRO_BATCH = {1: 6, 2: 3, 3: 4}  # world -> micro batch; gas = 12 / (micro x world): 2, 2, 1
STAGE = {1: 0, 2: 2, 3: 1}  # the checkpoint reshards across stages too


class IndexedData(torch.utils.data.Dataset):
    """Item i is (i, features(i), target(i)): what a batch holds says which samples it consumed."""

    def __len__(self) -> int:
        return DATASET_SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = torch.sin(index * torch.arange(1.0, 5.0))
        return torch.tensor(index), features, torch.cos(torch.tensor([index / 7.0]))


def _engine(world: int):
    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH[world],
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": STAGE[world]},
        "checkpoint": {"use_node_local_storage": False},
    }
    engine, _, loader, _ = rayzero.initialize(model=model, config=config, training_data=IndexedData())
    assert engine.training_dataloader is loader
    return engine, loader


def _train(engine, loader, world: int, until: int, save_at: tuple[int, ...] = (),
           root: str | None = None) -> tuple[list[list[int]], list[float]]:
    """Train until `until` optimizer steps, epoch after epoch as a resumable loop does (starting at
    the sampler's epoch), saving after the steps in `save_at`; per step, the global sample order
    and the global mean loss."""
    orders, losses, micro_indices, micro_losses = [], [], [], []
    sampler = loader.sampler
    while engine.global_steps < until:
        for indices, features, targets in loader:
            loss = torch.nn.functional.mse_loss(engine(features), targets)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            micro_indices.append(indices.tolist())
            micro_losses.append(loss.item())
            if not boundary:
                continue
            orders.append(_global_order(micro_indices, world))
            total = torch.tensor(sum(micro_losses))
            if world > 1:
                dist.all_reduce(total)
            losses.append(total.item() / (world * len(micro_losses)))
            micro_indices, micro_losses = [], []
            if engine.global_steps in save_at:
                engine.save_checkpoint(root)  # async: the files are written while training goes on
            if engine.global_steps == until:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    return orders, losses


def _global_order(micro_indices: list[list[int]], world: int) -> list[int]:
    """This step's samples in epoch order: micro batch j, item i of rank r is position
    (j * micro + i) * world + r of the step's contiguous run (see [Note: data position])."""
    per_rank = [None] * world
    dist.all_gather_object(per_rank, micro_indices)
    micro = len(micro_indices[0])
    return [per_rank[r][j][i] for j in range(len(micro_indices)) for i in range(micro) for r in range(world)]


def _uninterrupted(rank: int, world: int, root: str) -> dict:
    engine, loader = _engine(world)
    orders, losses = _train(engine, loader, world, TOTAL_STEPS, save_at=(SAVE_AT, TOTAL_STEPS), root=root)
    engine.close()  # waits for a save in flight, so the checkpoint is committed now
    return {"orders": orders, "losses": losses, "latest": read_latest(root)}


def _resumed(rank: int, world: int, root: str) -> dict:
    engine, loader = _engine(world)
    path, _ = engine.load_checkpoint(root, tag=f"global_step{SAVE_AT}")
    assert path is not None and engine.global_steps == SAVE_AT
    orders, losses = _train(engine, loader, world, TOTAL_STEPS)
    engine.close()
    return {"orders": orders, "losses": losses}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    root = str(tmp_path_factory.mktemp("data-position"))
    results = {2: spawn(2, _uninterrupted, root)}
    for world in (3, 1):
        results[world] = spawn(world, _resumed, root)
    return {world: by_rank[0] for world, by_rank in results.items()}


def test_the_uninterrupted_run_sees_each_sample_once_per_epoch(runs) -> None:
    orders = runs[2]["orders"]
    assert len(orders) == TOTAL_STEPS and all(len(order) == GLOBAL_BATCH for order in orders)
    per_epoch = SAMPLES_PER_EPOCH // GLOBAL_BATCH
    first_epoch = [index for order in orders[:per_epoch] for index in order]
    second_epoch = [index for order in orders[per_epoch:] for index in order]
    assert len(set(first_epoch)) == SAMPLES_PER_EPOCH and set(first_epoch) <= set(range(DATASET_SIZE))
    assert len(set(second_epoch)) == len(second_epoch), "no sample twice within an epoch"
    assert first_epoch[:len(second_epoch)] != second_epoch, "each epoch is shuffled anew"


def test_close_waits_for_the_async_save_in_flight(runs) -> None:
    assert runs[2]["latest"] == f"global_step{TOTAL_STEPS}", "the save just before close() is committed"


@pytest.mark.parametrize("world", [3, 1])
def test_resume_at_another_world_size_consumes_the_same_samples(runs, world: int) -> None:
    reference = runs[2]["orders"][SAVE_AT:]
    resumed = runs[world]["orders"]
    assert resumed == reference, "same samples in the same global order: none repeated, none skipped"


@pytest.mark.parametrize("world", [3, 1])
def test_resume_at_another_world_size_trains_to_the_same_losses(runs, world: int) -> None:
    reference = runs[2]["losses"][SAVE_AT:]
    resumed = runs[world]["losses"]
    assert len(resumed) == len(reference)
    for got, want in zip(resumed, reference):
        assert got == pytest.approx(want, rel=1e-5), (resumed, reference)
