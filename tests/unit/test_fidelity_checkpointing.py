"""`rayzero.checkpointing` (DeepSpeed's activation-checkpointing API): same gradients and dropout as
the plain model, less memory held between forward and backward (measured as a process's resident
memory, in ranks forked from the tests' torch server), and the config section / Lightning keywords
feed it."""
from __future__ import annotations

import pytest
import torch

from rayzero import checkpointing
from rayzero.config import RayZeroConfig

pytestmark = pytest.mark.unit


class Tower(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(2 * width, width)) for _ in range(depth))
        self.use_checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpointing.checkpoint(block, x) if self.use_checkpoint else block(x))
        return x.square().mean()


@pytest.fixture(autouse=True)
def _fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_same_loss_gradients_and_dropout_as_the_plain_model(cpu_checkpointing):
    checkpointing.configure(None, checkpoint_in_cpu=cpu_checkpointing, synchronize=True, profile=True)
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        model = Tower(16, 3)
        model.use_checkpoint = use
        x = torch.randn(8, 16, requires_grad=True)
        torch.manual_seed(1)  # the dropout masks: the recompute must draw the same ones
        loss = model(x)
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
    (loss0, xgrad0, grads0), (loss1, xgrad1, grads1) = results
    assert torch.equal(loss0, loss1) and torch.equal(xgrad0, xgrad1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def _measure_held(rank: int, world_size: int, use: bool) -> int:
    """KiB of memory the first forward holds for backward, in a rank forked from the torch server."""
    import resource

    torch.manual_seed(0)
    # warm-up on a tiny tower: the first checkpoint call imports ~80 MiB of torch modules
    tiny = Tower(8, 1)
    tiny.use_checkpoint = use
    tiny(torch.randn(2, 8)).backward()
    model = Tower(512, 8)
    model.use_checkpoint = use
    x = torch.randn(1024, 512)

    # With a fixed mmap threshold (set by the caller) every large tensor is mmap'ed and returned to
    # the OS when freed, so the peak after the first forward (no gradients exist yet) is the model,
    # the input and what forward keeps for backward
    def resident_kib() -> int:  # current RSS, not the peak: an earlier transient must not mask the activations
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() // 1024

    base = resident_kib()
    loss = model(x)  # activations held from here until backward frees them
    peak = resident_kib()
    loss.backward()
    return peak - base


def _held(use: bool) -> int:
    from testkit.harness import spawn

    (held,) = spawn(1, _measure_held, use, mmap_threshold=131072)  # glibc: freed = returned
    return held


def test_checkpointing_saves_activation_memory():
    # Without checkpointing each of 8 blocks keeps its input (2 MiB) and ~3 activations of
    # 1024 x 1024 fp32 (4 MiB each) until backward; with it only the input: the peak must drop.
    plain, checkpointed = _held(False), _held(True)
    assert plain > 40 * 1024, f"the plain model should hold tens of MiB of activations, held {plain} KiB"
    assert checkpointed <= 0.5 * plain, f"checkpointed held {checkpointed} KiB vs plain {plain} KiB"


def test_configure_reads_the_config_section_and_the_lightning_keywords():
    checkpointing.configure(None, deepspeed_config={"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
        "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "number_checkpoints": 4}})
    assert checkpointing.is_configured()
    current = checkpointing.settings()
    assert current.cpu_checkpointing and current.synchronize_checkpoint_boundary and current.number_checkpoints == 4
    config = RayZeroConfig.from_lightning(cpu_checkpointing=True, partition_activations=True)
    checkpointing.configure(None, deepspeed_config=config)
    assert checkpointing.settings().cpu_checkpointing and checkpointing.settings().partition_activations


def test_deepspeeds_preconditions_and_model_parallelism_are_checked():
    with pytest.raises(ValueError, match="partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, contiguous_checkpointing=True, partition_activations=True)

    class TwoWayModelParallel:
        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="model-parallel size 2"):
        checkpointing.configure(TwoWayModelParallel())


def test_initialize_applies_the_config_section():
    import rayzero

    engine, *_ = rayzero.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"cpu_checkpointing": True}})
    try:
        assert checkpointing.is_configured() and checkpointing.settings().cpu_checkpointing
    finally:
        engine.close()
