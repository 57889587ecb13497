"""Reusable multi-process harness for engine parity tests (gloo on CPU).

- `spawn(world_size, fn, payload)`: run `fn(rank, world_size, payload)` in `world_size` new
  processes that share a gloo process group; returns each rank's (picklable) return value.
  The ranks fork from a server that has imported torch ([Note: ranks forked from a torch server]);
  a group still costs its imports and group formation, so callers run many cases per spawn.
- `ParityModel`: tied embeddings, a frozen layer, an unused parameter, odd sizes, a buffer.
- `Case` / `run_cases` (inside the workers) / `reference_run` (single process, fp32 torch) and
  `assemble_masters` to gather the fp32 master pieces every rank reports via `state_shards()`.
Stage-3 tests reuse all of it with `Case(stage=3, ...)`.
"""
from __future__ import annotations

import copy
import datetime
import faulthandler
import math
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rayzero.ports import server_port

VOCAB, HIDDEN, FFN, SEQ = 37, 13, 29, 5
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.01, 1.0
SGD_LR, SGD_MOMENTUM = 0.05, 0.9


def gloo_init(rank: int, world_size: int) -> None:
    """The default group-forming step of `spawn`: gloo from the spawn's arguments."""
    torch.set_num_threads(1)  # 2 shared cores: oversubscription only slows everyone down
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=120))


# [Note: ranks forked from a torch server]
# A rank started as a new interpreter (start method "spawn") imports torch first: ~1.2 s of CPU per
# rank, ~1.6-3.4 s per 2-rank group on this 2-core machine, and `make test` forms well over a hundred
# groups. The ranks fork instead from one server process (start method "forkserver", one server per
# pytest process) that has imported torch and nothing else of ours or of the tests': not rayzero, not a test module, and no
# CUDA (torch initialises it lazily, so a forked rank can still use it, as a spawned one could); a
# 2-rank group then starts in ~0.05 s. multiprocessing still hands each rank the parent's sys.path
# and working directory; a fork would not refresh the environment (the server's is from when it
# started), so `_entry` applies the parent's, as it is at `spawn`, before anything else runs. What the
# C library reads once at process start cannot be handed over that way. The one such setting the
# memory tests use, MALLOC_MMAP_THRESHOLD_ (glibc: a fixed mmap threshold, so freed large blocks go
# back to the kernel and a peak is what was live), `_entry` applies with glibc's own call instead,
# mallopt(M_MMAP_THRESHOLD), which sets the same threshold and turns off its dynamic adjustment as the
# variable does; it then holds for everything the rank allocates. The memory tests measure from a
# baseline taken in the rank (or compare two ranks forked alike), so what a rank inherits from the
# server is in both ends of the difference. With any other MALLOC_* variable set the ranks are new
# interpreters again.
# The server also imports torch._dynamo, torch's own module that every torch optimizer's constructor
# imports (torch.optim.Optimizer.__init__ -> torch._compile): ~0.8 s of CPU in each rank that builds
# an engine otherwise. With it preloaded, three engine/checkpoint test files took 17.5-17.9 CPU-s
# instead of 29.4-32.4 (tests/dist/test_engine_state.py, test_fidelity_engine.py,
# test_checkpoint_engine.py, all their processes counted).
_FORKED = multiprocessing.get_context("forkserver")
_FORKED.set_forkserver_preload(["torch", "torch._dynamo"])
_NEW_INTERPRETER = multiprocessing.get_context("spawn")
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3}
"""The environment variables a forked rank applies with glibc's mallopt (M_MMAP_THRESHOLD is -3 in
malloc.h) instead of needing a new interpreter: [Note: ranks forked from a torch server]."""


def _apply_mallopt(environment: dict[str, str]) -> None:
    import ctypes

    for variable, parameter in _MALLOPT.items():
        if variable in environment:
            libc = ctypes.CDLL(None)
            if libc.mallopt(parameter, int(environment[variable])) != 1:
                raise RuntimeError(f"mallopt({parameter}, {environment[variable]}) for {variable} failed")


def _entry(rank: int, world_size: int, port: int, fn: Callable, payload: Any, out_dir: str,
           init: Callable[[int, int], None], environment: dict[str, str]) -> None:
    _apply_mallopt(environment)  # first: before the rank allocates anything of its own
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      RAYZERO_COLLECTIVE_TIMEOUT_S="120")  # a hung peer fails the test, not the suite
    # the parent asks for every thread's stack with SIGUSR1 when the group runs past its time
    stacks = open(os.path.join(out_dir, f"rank{rank}.stacks"), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    result: Any
    try:
        init(rank, world_size)
        result = ("ok", fn(rank, world_size, payload))
    except BaseException:  # noqa: BLE001 - report everything: the parent shows it
        result = ("error", traceback.format_exc())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn(world_size: int, fn: Callable, payload: Any = None, timeout_s: float = 600,
          init: Callable[[int, int], None] = gloo_init, mmap_threshold: int | None = None) -> list[Any]:
    """Run `fn(rank, world_size, payload)` on every rank of a fresh group; results by rank.

    `init(rank, world_size)` forms the group in each rank (module-level, so it pickles), with
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT already in the environment. `mmap_threshold`
    (bytes) fixes glibc's mmap threshold in the ranks, as MALLOC_MMAP_THRESHOLD_ would: freed large
    blocks go back to the kernel, so a memory peak is what was live.
    """
    environment = dict(os.environ)
    if mmap_threshold is not None:
        environment["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    read_at_start = any(key.startswith("MALLOC_") and key not in _MALLOPT for key in environment)
    context = _NEW_INTERPRETER if read_at_start else _FORKED  # [Note: ranks forked from a torch server]
    port = server_port()  # the group's MASTER_PORT: [Note: ports below the ephemeral range]
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [context.Process(target=_entry, args=(r, world_size, port, fn, payload, out_dir, init, environment))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s  # for the whole group, not per rank
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in late:  # where each late rank is: its threads' stacks (faulthandler, in _entry)
            os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0 if late else 0.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if rank in late:
                with open(os.path.join(out_dir, f"rank{rank}.stacks")) as stacks:
                    raise RuntimeError(f"rank {rank} of {world_size} was still running after {timeout_s:.0f} s; "
                                       f"its threads' stacks then:\n{stacks.read()[-6000:]}")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {world_size} produced no result (it crashed)")
            status, value = torch.load(path, weights_only=False)
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            results.append(value)
    return results


class ParityModel(torch.nn.Module):
    """Small, awkward on purpose: tied embedding/head, frozen layer, unused parameter, odd sizes
    (no size divisible by 2 or 3), a buffer used in forward. forward returns the mean CE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.1)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.down = torch.nn.Linear(FFN, HIDDEN)
        self.unused = torch.nn.Parameter(torch.randn(7))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = (self.embed(tokens) + self.pos) * self.scale.to(self.pos.dtype)  # fp32 under bf16 too: [Note: buffers keep their dtype]
        h = h + torch.tanh(self.frozen(h))
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        logits = self.head(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_model(seed: int = 0) -> ParityModel:
    torch.manual_seed(seed)
    return ParityModel()


def param_groups(model: torch.nn.Module) -> list[dict]:
    """HF-style groups: weight decay on matrices only (the unused vector must see no decay)."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return tokens, targets


@dataclass(frozen=True)
class Case:
    stage: int
    precision: str = "fp32"  # fp32 | bf16 | fp16
    gas: int = 1
    steps: int = 20
    micro_batch: int = 2
    zero: tuple = ()
    """Extra zero_optimization items as (key, value) pairs (frozen dataclass)."""
    extra: tuple = ()
    """Extra top-level config items as (key, value) pairs."""
    optimizer: str = "adamw"
    """`adamw` with clipping at CLIP, or `sgd` (momentum) without clipping. Adam's update and
    clipping are both nearly invariant to a constant gradient scale, so only the SGD cases can
    catch a wrong 1/world or 1/gas factor; the AdamW cases catch a wrong global norm."""

    @property
    def lr(self) -> float:
        return LR if self.optimizer == "adamw" else SGD_LR

    @property
    def clip(self) -> float:
        return CLIP if self.optimizer == "adamw" else 0.0

    def config(self) -> dict:
        zero = {"stage": self.stage, "reduce_bucket_size": 200, **dict(self.zero)}
        optimizer = ({"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
                     if self.optimizer == "adamw" else
                     {"type": "SGD", "params": {"lr": SGD_LR, "momentum": SGD_MOMENTUM,
                                                "weight_decay": WEIGHT_DECAY}})
        cfg = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
            "optimizer": optimizer,
            "zero_optimization": zero,
            "bf16": {"enabled": self.precision == "bf16"},
            "fp16": {"enabled": self.precision == "fp16"},
        }
        cfg.update(dict(self.extra))
        return cfg


@dataclass
class CaseResult:
    case: Case
    losses: list[float]
    """This rank's mean micro-batch loss per optimizer step."""
    masters: list[tuple[str, tuple, int, int, torch.Tensor]] = field(default_factory=list)
    """(name, global_shape, start, end, values) of every `master/` piece this rank holds."""
    comm: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def train_steps(engine: Any, rank: int, world: int, case: Case, first: int, last: int) -> list[float]:
    """Optimizer steps [first, last) of `case` on this rank; this rank's mean loss per step."""
    losses = []
    for step in range(first, last):
        tokens, targets = global_batch(step, world * case.gas * case.micro_batch)
        total = 0.0
        for micro in range(case.gas):
            start = (micro * world + rank) * case.micro_batch
            window = slice(start, start + case.micro_batch)
            loss = engine(tokens[window], targets[window])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / case.gas)
    return losses


def master_pieces(engine: Any) -> list[tuple[str, tuple, int, int, torch.Tensor]]:
    return [(s.spec.name[len("master/"):], s.spec.global_shape, s.spec.flat_start, s.spec.flat_end,
             s.local.detach().clone()) for s in engine.state_shards() if s.spec.name.startswith("master/")]


def start_engine(rank: int, case: Case, model_factory: Callable = build_model) -> tuple[Any, torch.nn.Module]:
    """`rayzero.initialize` on the parity model, every rank starting from different weights."""
    import rayzero

    model = model_factory()
    with torch.no_grad():  # ranks start different: the engine must broadcast rank 0's state
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.add_(rank)
    engine, _, _, _ = rayzero.initialize(model=model, config=case.config(),
                                         model_parameters=param_groups(model))
    return engine, model


def train_case(rank: int, world: int, case: Case, model_factory: Callable = build_model,
               probe: Callable | None = None) -> CaseResult:
    """Run one case on this rank (inside a `spawn`ed worker); `probe(engine)` adds to `extra`."""
    engine, model = start_engine(rank, case, model_factory)
    losses = train_steps(engine, rank, world, case, 0, case.steps)
    masters = master_pieces(engine)
    untrained = model_factory()  # rank 0's initial weights: what every rank started from
    frozen_kept = all(torch.equal(p.float(), q) for (n, p), (_, q) in zip(
        model.named_parameters(), untrained.named_parameters()) if not q.requires_grad) and all(
        torch.equal(b.float(), c) for b, c in zip(model.buffers(), untrained.buffers()))
    result = CaseResult(case, losses, masters, engine.comm_stats(), engine.memory_stats(),
                        {"skipped_steps": engine.skipped_steps, "extra_state": engine.extra_state(),
                         "frozen_kept": frozen_kept, **(probe(engine) if probe else {})})
    engine.close()
    return result


def run_cases(rank: int, world: int, cases: list[Case]) -> list[CaseResult]:
    return [train_case(rank, world, case) for case in cases]


def assemble_masters(per_rank: list[CaseResult]) -> dict[str, torch.Tensor]:
    """Full fp32 parameters from every rank's master pieces (overlaps must agree exactly)."""
    full: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, shape, start, end, values in result.masters:
            flat = full.setdefault(name, torch.full((math.prod(shape),), float("nan"))).view(-1)
            flat[start:end] = values.float()
    return {name: tensor for name, tensor in full.items()}


def reference_run(world: int, case: Case, model_factory: Callable = build_model, gradient_factor: float = 1.0
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 torch on the whole global batch: the losses and trainable parameters
    a correct data-parallel run must reproduce (with every gradient times `gradient_factor`)."""
    model = model_factory()
    if case.optimizer == "adamw":
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    else:
        optimizer = torch.optim.SGD(param_groups(model), lr=SGD_LR, momentum=SGD_MOMENTUM)
    losses = []
    for step in range(case.steps):
        tokens, targets = global_batch(step, world * case.gas * case.micro_batch)
        loss = model(tokens, targets)
        (loss * gradient_factor if gradient_factor != 1.0 else loss).backward()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], case.clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters() if p.requires_grad}
    return losses, params


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (per tensor: elementwise ratios explode near zero)."""
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual.float() - expected.float()).abs().max() / scale)


def copy_case(case: Case, **changes: Any) -> Case:
    return copy.replace(case, **changes) if hasattr(copy, "replace") else Case(**{**case.__dict__, **changes})


def assert_matches_reference(precision: str, losses: list[float], full: dict[str, torch.Tensor],
                             ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    """The parity rule shared by the CPU (gloo) and GPU tiers: gathered masters and the mean loss
    trajectory against a single-process fp32 reference. Why bf16 gets these tolerances: see the
    docstring of tests/dist/test_parity.py."""
    assert sorted(full) == sorted(ref_params), "every trainable parameter (tied once, frozen never)"
    assert all(not torch.isnan(t).any() for t in full.values()), "ranks' master pieces cover every element"
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if precision == "fp32":
        param_diff = max(max_rel_diff(full[n], ref_params[n]) for n in ref_params)
        assert loss_diff <= 1e-5, f"loss trajectory differs by {loss_diff:.2e}"
        assert param_diff <= 1e-5, f"final parameters differ by {param_diff:.2e}"
    else:
        abs_diff = max(float((full[n] - ref_params[n]).abs().max()) for n in ref_params)
        assert loss_diff <= 1e-2, f"bf16 loss trajectory differs by {loss_diff:.2e}"
        assert abs_diff <= 0.05, f"bf16 parameters differ by {abs_diff:.3f}"
    assert torch.equal(full["unused"], ref_params["unused"].float()), "an unused parameter must not move"
