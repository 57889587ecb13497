"""Resolving "auto" values (as the HF Trainer DeepSpeed integration does) and deriving batch keys.

Facts come from three places: the model's hidden size (bucket and persistence sizes), the world
size (batch keys), and trainer arguments in HF `TrainingArguments` names (learning rate, batch size,
precision, ...). Every value filled in leaves a note saying where it came from; an "auto" nothing
resolves is a problem naming the key and the fact that would resolve it.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from pydantic import Field, ValidationError

from rayzero.config.base import AUTO, AutoBool, Bool, ConfigModel, Float, Int
from rayzero.config.convert import to_problem
from rayzero.config.errors import Problem
from rayzero.config.model import RayZeroConfig


class TrainerFacts(ConfigModel):
    """Trainer arguments "auto" values are taken from (HF `TrainingArguments` names)."""

    per_device_train_batch_size: Optional[Int] = Field(None, ge=1)
    """Fills `train_micro_batch_size_per_gpu`."""
    gradient_accumulation_steps: Optional[Int] = Field(None, ge=1)
    """Fills `gradient_accumulation_steps`."""
    max_grad_norm: Optional[Float] = Field(None, ge=0)
    """Fills `gradient_clipping`."""
    learning_rate: Optional[Float] = Field(None, ge=0)
    """Fills `optimizer.params.lr` and `scheduler.params.warmup_max_lr`."""
    adam_beta1: Optional[Float] = None
    """Fills `optimizer.params.betas[0]`."""
    adam_beta2: Optional[Float] = None
    """Fills `optimizer.params.betas[1]`."""
    adam_epsilon: Optional[Float] = None
    """Fills `optimizer.params.eps`."""
    weight_decay: Optional[Float] = None
    """Fills `optimizer.params.weight_decay`."""
    warmup_steps: Optional[Float] = Field(None, ge=0)
    """Fills `scheduler.params.warmup_num_steps`: a step count (>= 1), or in [0, 1) a share of
    `max_steps` (transformers 5); at least 1, as HF fills it."""
    warmup_ratio: Optional[Float] = Field(None, ge=0, le=1)
    """With `max_steps`, fills `scheduler.params.warmup_num_steps` when `warmup_steps` is not given
    (transformers 4's name for the share)."""
    max_steps: Optional[Int] = Field(None, ge=1)
    """Fills `scheduler.params.total_num_steps`."""
    fp16: Optional[Bool] = None
    """Fills `fp16.enabled` (and `amp.enabled` with the apex backend)."""
    bf16: Optional[Bool] = None
    """Fills `bf16.enabled`."""
    fp16_opt_level: Optional[str] = None
    """Fills `amp.opt_level`."""
    half_precision_backend: Optional[str] = None
    """`apex` makes `amp.enabled: auto` follow `fp16` (and then refused); anything else means fp16."""


DECIDED_AT_RUN_TIME = frozenset({"checkpoint.interval", "data_types.keep_in_fp32_modules"})
""""auto" values chosen from what the run sees, never from facts: rayzero's checkpoint interval (from
what it measures) and DeepSpeed's keep_in_fp32_modules (from the model the engine is given)."""

# key path -> what would resolve it (for the error when nothing does)
_PROVIDERS = {
    "reduce_bucket_size": "the model's hidden size (hidden_size=..., `--hidden-size H`)",
    "stage3_prefetch_bucket_size": "the model's hidden size (hidden_size=..., `--hidden-size H`)",
    "stage3_param_persistence_threshold": "the model's hidden size (hidden_size=..., `--hidden-size H`)",
    "allgather_bucket_size": "the model's hidden size (hidden_size=..., `--hidden-size H`)",
    "train_batch_size": "world_size (`--world-size N`) with the micro batch and accumulation steps",
    "train_micro_batch_size_per_gpu": "trainer per_device_train_batch_size, or train_batch_size with world_size and a gradient_accumulation_steps value",
    "gradient_accumulation_steps": "trainer gradient_accumulation_steps, or the other batch keys with world_size",
}


class _Resolver:
    """Fills "auto" values and, like the HF integration, refuses explicit values that disagree
    with the trainer argument they mirror (a silent mismatch trains with the wrong setting)."""

    def __init__(self, notes: list[str], problems: list[Problem]) -> None:
        self.notes = notes
        self.problems = problems

    @staticmethod
    def _explicit(owner: Any, attr: str) -> bool:
        # Only a value the user wrote can disagree; a default the trainer overrides is not a conflict.
        return attr in owner if isinstance(owner, dict) else attr in owner.model_fields_set

    def fill(self, owner: Any, attr: str, path: str, value: Any, source: str, *,
             check: bool = True, fill_missing: bool = False) -> None:
        """Set `owner.attr` (a model or a params dict) to `value` if it is "auto" (or absent, with
        `fill_missing`); with `check`, an explicit different value is a problem."""
        if value is None:
            return
        current = owner.get(attr) if isinstance(owner, dict) else getattr(owner, attr)
        if isinstance(current, str) and current == AUTO or (current is None and fill_missing):
            if isinstance(owner, dict):
                owner[attr] = value
            else:
                setattr(owner, attr, value)
            label = "auto" if current is not None else "filled"
            self.notes.append(f"{label}: {path} = {value!r} from {source}")
        elif check and current is not None and current != value and self._explicit(owner, attr):
            self.problems.append(Problem(
                path, current, f"disagrees with {source} = {value!r}",
                f'write "auto" to take the trainer\'s value, or make the two agree'))


def resolve(
    config: RayZeroConfig,
    *,
    world_size: int | None,
    hidden_size: int | None,
    trainer: Mapping[str, Any] | None,
    allow_unresolved: bool,
    notes: list[str],
    problems: list[Problem],
) -> None:
    """Fill every "auto" the facts allow, derive the batch keys, and report the rest."""
    facts = _trainer_facts(trainer, problems)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        problems.append(Problem("world_size", world_size, "must be a positive integer", "pass the number of ranks"))
        world_size = None
    if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1):
        problems.append(Problem("hidden_size", hidden_size, "must be a positive integer", "pass the model's hidden size"))
        hidden_size = None
    fill = _Resolver(notes, problems).fill
    zero = config.zero_optimization
    if hidden_size is not None:
        h = hidden_size
        src = f"hidden_size={h}"
        # The hidden-size rules are recommendations for "auto", not facts a written value can contradict.
        fill(zero, "reduce_bucket_size", "zero_optimization.reduce_bucket_size", h * h, f"{src} (h²)", check=False)
        fill(zero, "allgather_bucket_size", "zero_optimization.allgather_bucket_size", h * h, f"{src} (h²)", check=False)
        fill(zero, "prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
             int(0.9 * h * h), f"{src} (0.9·h²)", check=False)
        fill(zero, "param_persistence_threshold", "zero_optimization.stage3_param_persistence_threshold",
             10 * h, f"{src} (10·h)", check=False)
    _from_trainer(config, facts, fill)
    if world_size is not None:
        _derive_batch(config, world_size, notes, problems)
    for path in config.unresolved_autos():
        if path in DECIDED_AT_RUN_TIME:
            continue
        provider = _provider(path)
        if allow_unresolved:
            notes.append(f"auto: {path} is still \"auto\"; it needs {provider}")
        else:
            problems.append(Problem(path, AUTO, "\"auto\" cannot be resolved from the facts given",
                                    f"give {provider}, or write a value"))


def _trainer_facts(trainer: Mapping[str, Any] | None, problems: list[Problem]) -> TrainerFacts:
    """Validated trainer arguments; bad ones are reported and left out, the rest still used."""
    given = dict(trainer or {})
    try:
        return TrainerFacts.model_validate(given)
    except ValidationError as error:
        for item in error.errors(include_url=False):
            problems.append(to_problem(item, TrainerFacts, ("trainer",)))
            given.pop(item["loc"][0], None)
    return TrainerFacts.model_validate(given)


def _provider(path: str) -> str:
    key = path.rsplit(".", 1)[-1].split("[")[0]
    if key in _PROVIDERS:
        return _PROVIDERS[key]
    if path == "optimizer.params.betas":
        return "trainer arguments adam_beta1 and adam_beta2"
    for name, field in TrainerFacts.model_fields.items():
        if f"`{path}`" in (field.description or ""):
            return f"trainer argument {name}"
    return "a trainer argument for it (no rule resolves this key)"


def _from_trainer(config: RayZeroConfig, facts: TrainerFacts, fill: Any) -> None:
    trainer = "trainer "
    # The trainer's batch arguments also fill absent keys: it is the trainer that feeds the data.
    fill(config, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu",
         facts.per_device_train_batch_size, trainer + "per_device_train_batch_size", fill_missing=True)
    fill(config, "gradient_accumulation_steps", "gradient_accumulation_steps",
         facts.gradient_accumulation_steps, trainer + "gradient_accumulation_steps", fill_missing=True)
    fill(config, "gradient_clipping", "gradient_clipping", facts.max_grad_norm, trainer + "max_grad_norm")
    if config.optimizer is not None:
        params = config.optimizer.params
        fill(params, "lr", "optimizer.params.lr", facts.learning_rate, trainer + "learning_rate")
        if facts.adam_beta1 is not None and facts.adam_beta2 is not None:
            fill(params, "betas", "optimizer.params.betas", [facts.adam_beta1, facts.adam_beta2],
                 trainer + "adam_beta1, adam_beta2")
        fill(params, "eps", "optimizer.params.eps", facts.adam_epsilon, trainer + "adam_epsilon")
        fill(params, "weight_decay", "optimizer.params.weight_decay", facts.weight_decay, trainer + "weight_decay")
    if config.scheduler is not None:
        params = config.scheduler.params
        # HF fills warmup_min_lr with 0 unconditionally: warm-up starts from zero.
        fill(params, "warmup_min_lr", "scheduler.params.warmup_min_lr", 0, "the HF convention (warm up from 0)",
             check=False)
        fill(params, "warmup_max_lr", "scheduler.params.warmup_max_lr", facts.learning_rate,
             trainer + "learning_rate")
        warmup, source = _warmup_steps(facts)
        fill(params, "warmup_num_steps", "scheduler.params.warmup_num_steps", warmup, source)
        fill(params, "total_num_steps", "scheduler.params.total_num_steps", facts.max_steps, trainer + "max_steps")
    apex = (facts.half_precision_backend or "").lower() == "apex"
    fill(config.fp16, "enabled", "fp16.enabled", None if facts.fp16 is None else facts.fp16 and not apex,
         trainer + "fp16")
    fill(config.bf16, "enabled", "bf16.enabled", facts.bf16, trainer + "bf16")
    if config.amp is not None:
        fill(config.amp, "enabled", "amp.enabled", None if facts.fp16 is None else facts.fp16 and apex,
             trainer + "fp16 with half_precision_backend")
        fill(config.amp, "opt_level", "amp.opt_level", facts.fp16_opt_level, trainer + "fp16_opt_level")


def _warmup_steps(facts: TrainerFacts) -> tuple[int | None, str]:
    """`TrainingArguments.get_warmup_steps` (transformers 5.24): a count >= 1 as is, a share in
    [0, 1) of the training steps; then at least 1, as `HfTrainerDeepSpeedConfig` fills
    `warmup_num_steps` (DeepSpeed 0.19.6+ refuses 0). None when a share has no `max_steps` to apply to."""
    steps, share = facts.warmup_steps, None
    if steps is not None and steps >= 1:
        return max(1, int(steps)), "trainer warmup_steps"
    if steps is not None and steps > 0:
        share, name = steps, "warmup_steps"
    elif facts.warmup_ratio:
        share, name = facts.warmup_ratio, "warmup_ratio"
    if share is None:
        return (1, "trainer warmup_steps (0: one step, as HF fills it)") if steps is not None else (
            None, "trainer warmup_steps")
    if facts.max_steps is None:
        return None, f"trainer {name} with max_steps"
    return max(1, math.ceil(share * facts.max_steps)), f"trainer {name} × max_steps"


def _derive_batch(config: RayZeroConfig, world: int, notes: list[str], problems: list[Problem]) -> None:
    """DeepSpeed's rule: train_batch_size = micro × accumulation × world; derive the missing ones."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = [getattr(config, name) for name in names]
    total, micro, steps = (None if value == AUTO else value for value in given)
    autos = [value == AUTO for value in given[1:]]
    if all(autos) or (any(autos) and total is None):
        return  # not determined by the batch keys: reported as an unresolved "auto"
    src = f"world_size={world}"
    if total is not None and micro is not None and steps is not None:
        if total != micro * steps * world:
            problems.append(Problem(
                "train_batch_size", total,
                f"must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size "
                f"= {micro} × {steps} × {world} = {micro * steps * world}",
                "fix one of the three, or drop train_batch_size and let rayzero derive it"))
        return
    if total is None and micro is None:
        problems.append(Problem("train_batch_size", None,
                                "either train_batch_size or train_micro_batch_size_per_gpu is required",
                                "set train_micro_batch_size_per_gpu (samples per rank per forward)"))
        return
    if total is None:
        steps = steps or 1
        derived = {"train_batch_size": micro * steps * world, "gradient_accumulation_steps": steps}
        rule = f"micro {micro} × gas {steps} × {src}"
    else:
        divisor = (micro or 1) * world if micro is not None else (steps or 1) * world
        quotient, rest = divmod(total, divisor)
        if rest or quotient < 1:
            known = f"micro {micro}" if micro is not None else f"gas {steps or 1}"
            problems.append(Problem(
                "train_batch_size", total, f"is not a whole multiple of {known} × {src} = {divisor}",
                f"make train_batch_size a multiple of {divisor}, or change the world size"))
            return
        if micro is None:
            derived = {"train_micro_batch_size_per_gpu": quotient, "gradient_accumulation_steps": steps or 1}
            rule = f"train_batch_size {total} ÷ (gas {steps or 1} × {src})"
        else:
            derived = {"gradient_accumulation_steps": quotient}
            rule = f"train_batch_size {total} ÷ (micro {micro} × {src})"
    for name, value in derived.items():
        if getattr(config, name) in (None, AUTO):
            setattr(config, name, value)
            notes.append(f"derived: {name} = {value} from {rule}")
