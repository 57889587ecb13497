"""What this build can run: the one check between "a valid DeepSpeed config" and "a config rayzero
trains with", used before anything starts.

[Note: valid vs runnable]
`load_config` answers DeepSpeed's question (does DeepSpeed 0.19 accept this file? the differential
corpus test holds it to that). A valid config may still ask for something this build does not
implement: a DeepSpeed-only optimizer (OneBitAdam, FusedLamb, ...), an Adam flag DeepSpeed's own
kernel cannot combine with, or an "auto" that only a trainer can fill while no trainer is there.
Those must be refused before a worker, a cluster or a pod starts, with the same words everywhere, so
every entry point calls `runnable_problems` / `check_runnable`: `rayzero config validate`,
`rayzero.fit` (driver, before Ray starts workers), `rayzero.initialize` (engine) and the operator
(before it creates a RayJob).
Offload modes are runnable (the engine's offload backends own their details).

Keys DeepSpeed implements and this build does not fall in two kinds. Those that only change
precision or speed (ZeRO++ quantisation, bf16 masters, DeepCompile, ...) are accepted with a warning
naming them: rayzero then trains the same update at full precision. Those that change *what* is
trained are refused here (`_changes_what_is_trained`): tensor or sequence parallelism would make
DeepSpeed train `world / degree` data-parallel ranks (another global batch) where rayzero would
train `world`; ZenFlow applies part of each update steps late. torch_autocast runs (engine/autocast.py)
and is refused only where DeepSpeed refuses it.
"""
from __future__ import annotations

from typing import Any

from rayzero.config.auto import DECIDED_AT_RUN_TIME
from rayzero.config.errors import ConfigError, Problem
from rayzero.config.model import RayZeroConfig
from rayzero.config.params import OPTIMIZER_PARAMS, RECOGNISED_OPTIMIZERS, SCHEDULER_PARAMS
from rayzero.config.sections import AUTOCAST_DTYPES
from rayzero.config.unimplemented import tensor_parallel_degree

MODEL_AUTOS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold")
"""Keys whose "auto" `rayzero.initialize` resolves from the model's hidden size."""

DEEPSPEED_ONLY_OPTIMIZERS = frozenset({
    "onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "muadam", "muadamw", "musgd", "muon",
})
"""DeepSpeed's own optimizer kernels (and mup's): no torch equivalent with the same update."""

TORCH_OPTIMIZERS = frozenset(RECOGNISED_OPTIMIZERS - DEEPSPEED_ONLY_OPTIMIZERS)
"""torch.optim classes DeepSpeed builds by name, as rayzero does (Adagrad included: DeepSpeed uses
torch.optim.Adagrad without CPU offload)."""


def runnable_problems(config: RayZeroConfig, *, trainer_present: bool = False) -> list[Problem]:
    """Every reason this build cannot train `config` (already loaded with `load_config`).

    `trainer_present=False` (the driver, the operator, `rayzero.initialize`): an "auto" other than
    the model-resolved bucket sizes and rayzero's own (`DECIDED_AT_RUN_TIME`, chosen while the run goes)
    can never be filled, so it is a problem now rather than on every
    worker after they started.
    """
    problems: list[Problem] = []
    _changes_what_is_trained(config, problems)
    _optimizer(config, problems)
    _scheduler(config, problems)
    if not trainer_present:
        for path in config.unresolved_autos():
            if path.rsplit(".", 1)[-1] in MODEL_AUTOS or path in DECIDED_AT_RUN_TIME:
                continue
            problems.append(Problem(
                path, "auto", "only a trainer can fill this \"auto\" (rayzero resolves only "
                f"{', '.join(MODEL_AUTOS)} from the model, and the batch keys from the world size)",
                "write a value, or load the config with the trainer's arguments: "
                "rayzero.config.load_config(path, trainer={...}, allow_unresolved=True)"))
    return problems


def check_runnable(config: RayZeroConfig, source: str = "config", *, trainer_present: bool = False) -> None:
    """Raise one `ConfigError` with every `runnable_problems` reason, if any."""
    problems = runnable_problems(config, trainer_present=trainer_present)
    if problems:
        raise ConfigError(problems, f"{source} (valid for DeepSpeed, but this build cannot run it)")


def _optimizer(config: RayZeroConfig, problems: list[Problem]) -> None:
    section = config.optimizer
    if section is None:
        return
    name = section.type.lower()
    stage = config.zero_optimization.stage
    if name in DEEPSPEED_ONLY_OPTIMIZERS:
        problems.append(Problem(
            "optimizer.type", section.type, "a DeepSpeed-only optimizer kernel: rayzero builds Adam, AdamW, SGD "
            "and torch.optim optimizers",
            "use Adam or AdamW, or pass your own optimizer object to rayzero.initialize(optimizer=...) "
            "(with zero_allow_untested_optimizer: true at ZeRO stage 1-3)"))
    elif name in TORCH_OPTIMIZERS and stage > 0 and not config.zero_allow_untested_optimizer:
        problems.append(Problem(
            "optimizer.type", section.type, f"not tested with ZeRO stage {stage}: its update may read "
            "whole-parameter statistics, which a shard does not have",
            "set \"zero_allow_untested_optimizer\": true to use it anyway (as DeepSpeed requires), or use "
            "Adam, AdamW or SGD"))
    if name in OPTIMIZER_PARAMS and name != "sgd" and section.params.get("bias_correction") is False:
        # DeepSpeed's own Adam kernel runs this (rayzero's DeepSpeedAdam, engine/optimizers.py): it
        # has no AMSGrad or maximize, and torch's Adam (torch_adam) takes no bias_correction.
        for key, why in (("torch_adam", "torch's Adam always corrects (DeepSpeed fails to build it)"),
                         ("amsgrad", "DeepSpeed's Adam kernel has no AMSGrad variant"),
                         ("maximize", "DeepSpeed's Adam kernel only minimises")):
            if section.params.get(key) is True:
                problems.append(Problem(
                    f"optimizer.params.{key}", True, f"cannot be combined with bias_correction false: {why}",
                    f"remove {key}, or bias_correction"))


def _scheduler(config: RayZeroConfig, problems: list[Problem]) -> None:
    section = config.scheduler
    if section is not None and section.type not in SCHEDULER_PARAMS:  # load_config reports it already
        problems.append(Problem("scheduler.type", section.type, "not a scheduler this build has",
                                f"use one of: {', '.join(SCHEDULER_PARAMS)}"))


def _changes_what_is_trained(config: RayZeroConfig, problems: list[Problem]) -> None:
    """Refuse implemented-in-DeepSpeed features whose absence would train something else
    ([Note: valid vs runnable])."""
    tensor_parallel = tensor_parallel_degree(config.tensor_parallel)
    if tensor_parallel > 1:
        problems.append(Problem(
            "tensor_parallel.autotp_size", tensor_parallel, "tensor parallelism (AutoTP) is not implemented: "
            f"DeepSpeed would split each layer over {tensor_parallel} ranks and train world/{tensor_parallel} "
            "data-parallel replicas; rayzero would replicate the model and train another global batch",
            "remove `tensor_parallel` (or set autotp_size to 1) and shard with ZeRO stage 3 instead"))
    sequence_parallel = config.sequence_parallel_size
    if isinstance(sequence_parallel, (int, float)) and not isinstance(sequence_parallel, bool) \
            and sequence_parallel > 1:
        problems.append(Problem(
            "sequence_parallel_size", sequence_parallel, "Ulysses sequence parallelism is not implemented: "
            "DeepSpeed would count world/sequence_parallel_size data-parallel ranks in the batch size",
            "remove sequence_parallel_size (or set it to 1)"))
    if config.zero_optimization.zenflow is not None:
        problems.append(Problem(
            "zero_optimization.zenflow", config.zero_optimization.zenflow, "ZenFlow is not implemented: it "
            "applies the less important gradients some steps late, a different update from plain ZeRO",
            "remove zero_optimization.zenflow (rayzero steps every gradient at once; offload_optimizer "
            "with the step overlapped with backward is the nearest)"))
    autocast = config.torch_autocast
    if autocast is not None and autocast.enabled:
        _torch_autocast(config, autocast, problems)


def _torch_autocast(config: RayZeroConfig, autocast: Any, problems: list[Problem]) -> None:
    """What DeepSpeed refuses with torch_autocast, and the dtype autocast cannot compute in
    ([Note: torch_autocast] in rayzero/engine/autocast.py)."""
    if config.zero_optimization.zero_quantized_weights:
        # DeepSpeed 0.19.8 torch_autocast.py `_validate_auto_cast_settings`
        problems.append(Problem(
            "torch_autocast.enabled", True, "Cannot enable both torch autocast and zero quantized weights "
            "(DeepSpeed refuses them together)",
            "remove zero_optimization.zero_quantized_weights, or torch_autocast"))
    if autocast.dtype is not None and AUTOCAST_DTYPES[autocast.dtype] == "int8":
        problems.append(Problem(
            "torch_autocast.dtype", autocast.dtype, "torch.autocast computes in a floating dtype "
            "(DeepSpeed would reduce gradients in int8)", 'use "bfloat16" or "float16"'))
