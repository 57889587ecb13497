"""`rayzero.Script`, and the pre-flight of the DeepSpeed config a script's own arguments name.

[Note: script config flags]
A training script carries its DeepSpeed config in its own arguments: the HF Trainer's
`--deepspeed ds.json` (or `--deepspeed=ds.json`, or inline JSON; a TrainingArguments JSON file as the
only argument, with a `deepspeed` key, as HF's example scripts accept), or DeepSpeed's own
`--deepspeed_config ds.json` (`deepspeed.add_config_arguments`, where a bare `--deepspeed` is a
switch). `rayzero run SCRIPT.py` checks that file on the driver, before any worker starts, with the
checks of `rayzero config validate` (rayzero.driver.config_check.validated_config), so a bad key
is reported once, naming the flag, the key, the value and the fix, instead of by every rank later.

For `--deepspeed` the "auto" values are filled as the Trainer fills them: from the TrainingArguments
values on the script's command line and HF's defaults for the rest (rayzero.config.auto through
`with_trainer_semantics`); what only the Trainer knows at train time (the number of training steps
of a scheduler, from the dataset's length) stays "auto". The arguments are read with transformers'
own `HfArgumentParser(TrainingArguments)` (`parse_known_args`: the script's other flags are left to
it). Not `parse_args_into_dataclasses`: building `TrainingArguments` runs its `__post_init__`, which
checks the *driver's* hardware ("Your setup doesn't support bf16/gpu" on a CPU-only head node whose
workers have GPUs). Without transformers on the driver, the file is checked without those values.
`--deepspeed_config` is DeepSpeed's plain semantics: only the model's "auto"s are resolved (by
`rayzero.initialize`), any other "auto" is an error, as DeepSpeed would refuse it.

This module sits above the layers (it imports transformers); `rayzero run` (rayzero/cli.py) and
`rayzero.Script` bring it in, and the driver calls it through `ScriptTarget.check_args`.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayzero.config.errors import ConfigError, RayZeroValueError
from rayzero.workers.script import ScriptTarget

logger = logging.getLogger(__name__)

_TRAINER_FLAG = "--deepspeed"
_DEEPSPEED_FLAGS = ("--deepspeed_config", "--deepscale_config")  # deepspeed.add_config_arguments


@dataclass(frozen=True)
class Script(ScriptTarget):
    """A training script for `rayzero.fit`: run as `__main__` on every worker, as torchrun would.

        rayzero.fit(rayzero.Script("train.py", args=["--deepspeed", "ds.json", "--output_dir", "out"]),
                    scaling=rayzero.ScalingConfig(num_workers=2))

    `Script("pkg.train", module=True)` runs a module (`python -m pkg.train`). The config its arguments
    name is checked before any worker starts ([Note: script config flags]); `rayzero.fit(config=...)`
    is optional and, when given, reaches `rayzero.initialize()` and Accelerate ([Note: scripts on
    workers] in rayzero/workers/script.py)."""

    def check_args(self, world_size: int) -> None:
        check_config_flags(self.args, world_size)


@dataclass(frozen=True)
class ConfigFlag:
    """A DeepSpeed config named by a script's arguments."""

    flag: str
    """`--deepspeed`, `--deepspeed_config`, ... as written."""
    value: str | dict[str, Any]
    """The path, or the inline config."""
    trainer: bool
    """HF TrainingArguments semantics ("auto" from the trainer's values), else DeepSpeed's."""

    def describe(self) -> str:
        shown = self.value if isinstance(self.value, str) else json.dumps(self.value)
        return f"the script's argument {self.flag} {shown}"


def config_flags(args: Sequence[str]) -> Iterator[ConfigFlag]:
    """Every DeepSpeed config the arguments name ([Note: script config flags])."""
    args = list(args)
    if len(args) == 1 and args[0].endswith(".json") and Path(args[0]).is_file():
        values = _json(args[0], f"the script's argument {args[0]}")
        if isinstance(values, Mapping) and values.get("deepspeed"):
            yield ConfigFlag(f"{args[0]} (key \"deepspeed\")", values["deepspeed"], trainer=True)
        return
    index = 0
    while index < len(args):
        name, equals, value = args[index].partition("=")
        index += 1
        if name not in (_TRAINER_FLAG, *_DEEPSPEED_FLAGS):
            continue
        if not equals:
            if index == len(args) or args[index].startswith("-"):
                continue  # DeepSpeed's switch `--deepspeed` (its config comes with --deepspeed_config)
            value = args[index]
            index += 1
        inline = value.lstrip().startswith("{")
        yield ConfigFlag(name, _json(value, f"the script's argument {name}") if inline else value,
                         trainer=name == _TRAINER_FLAG)


def check_config_flags(args: Sequence[str], world_size: int) -> None:
    """Validate each config the script's arguments name; `ConfigError` (naming the flag) or
    `RayZeroValueError` for a missing file."""
    from rayzero.driver.config_check import validated_config

    for found in config_flags(args):
        if isinstance(found.value, str) and not Path(found.value).is_file():
            raise RayZeroValueError(
                f"{found.describe()}: no such file ({Path(found.value).resolve()}); give the path of the DeepSpeed "
                "JSON config relative to the working directory `rayzero run` starts in, or an absolute one")
        facts = trainer_facts(args) if found.trainer else None
        try:
            validated_config(found.value, world_size, facts, allow_unresolved=found.trainer)
        except ConfigError as error:
            raise ConfigError(error.problems, f"{found.describe()} (checked with the values the script's "
                                              "command line gives the trainer)" if found.trainer
                              else found.describe()) from None


def trainer_facts(args: Sequence[str]) -> dict[str, Any] | None:
    """The TrainingArguments values "auto" takes ([Note: script config flags]), from the script's
    command line and HF's defaults; None when transformers is not importable here."""
    try:
        from transformers import HfArgumentParser, TrainingArguments
    except ImportError:
        logger.warning("transformers is not importable on the driver: the script's --deepspeed config is checked "
                       "without its TrainingArguments values")
        return None
    from rayzero.config.auto import TrainerFacts

    args = list(args)
    if len(args) == 1 and args[0].endswith(".json"):
        values = _json(args[0], f"the script's argument {args[0]}")
        return _facts({key: value for key, value in values.items() if key in TrainerFacts.model_fields})
    parser = HfArgumentParser(TrainingArguments, allow_abbrev=False)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace, _ = parser.parse_known_args(args)
    except SystemExit:
        problem = errors.getvalue().strip().splitlines()[-1:] or ["?"]
        raise RayZeroValueError(
            f"the script's arguments do not parse as HF TrainingArguments ({problem[0]}); the Trainer in the script "
            "would stop on the same error: fix the argument's value") from None
    return _facts({key: getattr(namespace, key) for key in TrainerFacts.model_fields if hasattr(namespace, key)})


def _facts(values: Mapping[str, Any]) -> dict[str, Any]:
    """TrainingArguments values in the shape TrainerFacts takes (transformers 5: `warmup_steps` below
    1 is a ratio of the training steps; `max_steps` -1 means from the dataset)."""
    facts = {key: value for key, value in values.items() if value is not None}
    warmup = facts.pop("warmup_steps", 0) or 0
    if 0 < warmup < 1:
        facts["warmup_ratio"] = warmup
    elif warmup >= 1:
        facts["warmup_steps"] = int(warmup)
    if facts.get("max_steps", -1) <= 0:
        facts.pop("max_steps", None)
    return facts


def _json(text_or_path: str, where: str) -> Any:
    try:
        text = text_or_path if text_or_path.lstrip().startswith("{") else Path(text_or_path).read_text()
        return json.loads(text)
    except (OSError, ValueError) as error:
        raise RayZeroValueError(f"{where}: not readable as JSON ({error}); give a DeepSpeed JSON config file "
                                "or an inline JSON object") from None
