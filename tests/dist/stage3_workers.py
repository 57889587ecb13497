"""What the stage-3 dist tests run inside their spawned ranks (tests/dist/test_stage3.py asserts).

Models (a deep Tower for the knobs, InitModel for zero.Init, ExternalUse for an external parameter),
the measurements, and `worker`, which runs every case of one world size in one spawned group.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from testkit.harness import Case, copy_case, run_cases

PARITY_ZERO = (("stage3_param_persistence_threshold", 20), ("stage3_prefetch_bucket_size", 100),
               ("stage3_max_live_parameters", 2000))
"""Small values so that persistence, prefetch and live-capping all act on the parity model."""


def parity_cases() -> list[Case]:
    return [Case(stage=3, precision=precision, gas=gas, zero=PARITY_ZERO)
            for precision in ("fp32", "bf16") for gas in (1, 2)]


FP16_CASE = Case(stage=3, precision="fp16", steps=10, zero=PARITY_ZERO, extra=(
    ("fp16", {"enabled": True, "loss_scale": 0, "initial_scale_power": 22, "hysteresis": 1,
              "loss_scale_window": 1000}),))
"""Logit gradients reach ~0.1 here, so a first scale of 2**22 overflows fp16 (max 65504): the first
steps must be skipped until the scale fits."""


# ---- a deeper model for the knob tests ---------------------------------------------------------
WIDTH, DEPTH = 24, 6
LAYER = WIDTH * WIDTH + WIDTH  # elements of one Linear
PSI = DEPTH * LAYER + 2 * WIDTH  # every parameter, all trainable; sizes divisible by 2 and 3


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.norm(x), y)


def tower_engine(zero: dict, seed: int = 0, micro_batch: int = 4):
    import rayzero

    torch.manual_seed(seed)
    model = Tower()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, **zero},
              "checkpoint": {"use_node_local_storage": False}}
    engine, _, _, _ = rayzero.initialize(model=model, config=config)
    return engine


def tower_step(engine, step: int, rank: int) -> float:
    gen = torch.Generator().manual_seed(step * 100 + rank)
    loss = engine(torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen))
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def measure(rank: int, zero: dict, steps: int = 3) -> dict:
    """Traffic and live parameters of the last of `steps` steps (the first one records the trace)."""
    base = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0}
    engine = tower_engine({**base, **zero})
    for step in range(steps):
        if step == steps - 1:
            engine.strategy.reset_peak_live()
            prefetched_before = engine.strategy.memory_stats()["prefetched_param_elements"]
        tower_step(engine, step, rank)
    stats = engine.memory_stats()
    comm = engine.comm_stats()
    out = {"all_gather": comm.get("all_gather", {}).get("elements", 0),
           "reduce_scatter": comm.get("reduce_scatter", {}).get("elements", 0),
           "total": comm["total"]["elements"], "peak_live": stats["peak_live_param_elements"],
           "persistent": stats["persistent_param_elements"], "params_bytes": stats["params"],
           "prefetched": stats["prefetched_param_elements"] - prefetched_before}
    engine.close()
    return out


KNOB_SETTINGS = {
    "baseline": {},
    "persist_100": {"stage3_param_persistence_threshold": 100},
    "persist_100_model_100": {"stage3_param_persistence_threshold": 100, "stage3_model_persistence_threshold": 100},
    "reuse_far": {"stage3_max_reuse_distance": 10**9},
    "reuse_far_live_1300": {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 1300},
    "prefetch_1200": {"stage3_prefetch_bucket_size": 1200},
    "prefetch_1200_live_1300": {"stage3_prefetch_bucket_size": 1200, "stage3_max_live_parameters": 1300},
}


# ---- GatheredParameters and Init (inside workers) --------------------------------------------
class ExternalUse(torch.nn.Module):
    """The root's forward reads `embed.weight` directly (an output projection tied by use)."""

    def __init__(self) -> None:
        from rayzero.zero import register_external_parameter

        super().__init__()
        self.embed = torch.nn.Embedding(11, 7)
        self.mix = torch.nn.Linear(7, 7)
        register_external_parameter(self, self.embed.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(torch.tanh(self.mix(self.embed(tokens))), self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def external_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return torch.randint(0, 11, (2, 3), generator=gen), torch.randint(0, 11, (2, 3), generator=gen)


def gathered_checks(rank: int, world: int) -> dict:
    import rayzero
    from rayzero.zero import GatheredParameters

    engine = tower_engine({"stage3_param_persistence_threshold": 0})  # default 1e5 keeps all whole
    for step in range(2):
        tower_step(engine, step, rank)
    masters = {s.spec.name[len("master/"):]: s for s in engine.state_shards() if s.spec.name.startswith("master/")}
    weight = engine.module.layers[0].weight
    out = {"released_numel": weight.numel()}
    with GatheredParameters(weight):
        full = weight.detach().clone()
        out["gathered_shape"] = tuple(weight.shape)
    piece = masters["layers.0.weight"]
    out["gathered_matches_master"] = bool(torch.equal(full.reshape(-1)[piece.spec.flat_start:piece.spec.flat_end],
                                                      piece.local))
    with GatheredParameters(engine.module.layers[0].parameters(), modifier_rank=world - 1), torch.no_grad():
        weight.fill_(0.5 if rank == world - 1 else 7.0)  # only the modifier rank's values count
    with GatheredParameters(weight):
        out["after_modify_all_half"] = bool((weight == 0.5).all())
    master = next(s for s in engine.state_shards() if s.spec.name == "master/layers.0.weight")
    out["master_modified"] = bool((master.local == 0.5).all())
    external = ExternalUse()
    expected = float(copy.deepcopy(external)(*external_batch(rank)))
    engine2 = rayzero.initialize(model=external, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]
    losses = []
    for _ in range(2):
        loss = engine2(*external_batch(rank))
        engine2.backward(loss)
        engine2.step()
        losses.append(float(loss.detach()))
    out["external_losses"] = (expected, losses)
    engine2.close()
    plain = torch.nn.Parameter(torch.ones(3))
    with GatheredParameters([plain], modifier_rank=0):
        plain.data.mul_(2)
    out["plain_untouched_by_context"] = plain.tolist()
    engine.close()
    return out


class Scaled(torch.nn.Module):
    """A custom module with its own init and a buffer (Init must replay reset_parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(dim))
        self.register_buffer("offset", torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.gain, 1.0, 0.1)
        with torch.no_grad():
            self.offset.copy_(torch.arange(self.offset.numel(), dtype=self.offset.dtype) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.offset


class InitModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(37, 15)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(15, 15), torch.nn.GELU(), Scaled(15),
                                          torch.nn.Linear(15, 15), torch.nn.LayerNorm(15))
        self.head = torch.nn.Linear(15, 37, bias=False)
        self.head.weight = self.embed.weight  # tied after construction

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(tokens))).float()
        return F.cross_entropy(logits.reshape(-1, 37), targets.reshape(-1))


class NoInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))


def init_checks(rank: int, world: int) -> dict:
    import rayzero
    from rayzero.zero import GatheredParameters, Init

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(5)
    normal = InitModel()
    torch.manual_seed(5)
    with Init(config=config):
        built = InitModel()
    # Peak memory of construction: at each module's init, how many parameter elements exist whole.
    whole_at_init: list[int] = []

    def counting_init(module: torch.nn.Module) -> None:
        module.reset_parameters()
        if holder:
            whole_at_init.append(sum(p.numel() for p in holder[0].parameters() if not p.is_meta))

    holder: list[torch.nn.Module] = []
    torch.manual_seed(5)
    with Init(config=config, param_init_fn=counting_init):
        holder.append(InitModel())
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in normal.modules())
    out = {"whole_at_init": whole_at_init, "largest_module": largest_module,
           "model_numel": sum(p.numel() for p in normal.parameters()),
           "max_local_numel": max(p.numel() for p in built.parameters()),
           "tied": built.head.weight is built.embed.weight,
           "buffer_equal": bool(torch.equal(built.blocks[2].offset, normal.blocks[2].offset))}
    with GatheredParameters(list(built.parameters())):
        out["params_equal"] = all(torch.equal(a, b) for a, b in zip(built.parameters(), normal.parameters()))
    losses = {}
    for label, model in (("init", built), ("normal", normal)):
        engine, _, _, _ = rayzero.initialize(model=model, config=config)
        losses[label] = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step * 10 + rank)
            loss = engine(torch.randint(0, 37, (2, 4), generator=gen), torch.randint(0, 37, (2, 4), generator=gen))
            engine.backward(loss)
            engine.step()
            losses[label].append(float(loss.detach()))
        engine.close()
    out["losses"] = losses
    try:
        with Init(config=config):
            NoInit()
        out["no_reset_error"] = None
    except ValueError as error:
        out["no_reset_error"] = str(error)
    return out


# ---- checkpoint: saved by 2 ranks, resumed by 3 (stage 3 both times) --------------------------
GLOBAL_BATCH = 12


def global_steps(engine, first: int, last: int, rank: int, world: int) -> list[float]:
    """Steps on this rank's slice of a fixed global batch; the global mean loss of each."""
    import torch.distributed as dist

    losses, micro = [], GLOBAL_BATCH // world
    for step in range(first, last):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, WIDTH, generator=gen), torch.randn(GLOBAL_BATCH, WIDTH, generator=gen)
        window = slice(rank * micro, (rank + 1) * micro)
        loss = engine(x[window], y[window])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


CHECKPOINT_ZERO = {"stage3_param_persistence_threshold": 30}  # biases persistent, weights partitioned


def checkpoint_checks(rank: int, world: int, root: str) -> dict:
    if world == 2:
        engine = tower_engine(CHECKPOINT_ZERO, micro_batch=GLOBAL_BATCH // world)
        global_steps(engine, 0, 3, rank, world)
        engine.save_checkpoint(root, asynchronous=False)
        reference = global_steps(engine, 3, 6, rank, world)
        engine.close()
        return {"reference": reference}
    engine = tower_engine(CHECKPOINT_ZERO, seed=1, micro_batch=GLOBAL_BATCH // world)  # other init
    engine.load_checkpoint(root)
    out = {"global_steps": engine.global_steps, "resumed": global_steps(engine, 3, 6, rank, world)}
    engine.close()
    return out


def worker(rank: int, world: int, payload: dict) -> dict:
    out = {"parity": run_cases(rank, world, payload["parity"])}
    if payload.get("stage2_bf16"):
        out["stage2_bf16"] = run_cases(rank, world, [Case(stage=2, precision="bf16", gas=1)])[0]
        out["fp16"], out["stage2_fp16"] = run_cases(rank, world, [FP16_CASE, copy_case(FP16_CASE, stage=2)])
    if payload.get("knobs"):
        out["knobs"] = {name: measure(rank, zero) for name, zero in KNOB_SETTINGS.items()}
    if payload.get("checkpoint_dir"):
        out["checkpoint"] = checkpoint_checks(rank, world, payload["checkpoint_dir"])
    if payload.get("extras"):
        out["gathered"] = gathered_checks(rank, world)
        out["init"] = init_checks(rank, world)
    return out
