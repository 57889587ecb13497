"""The Hugging Face Trainer inside a rayzero run: resume by itself, report, save on planned stops.

[Note: the Trainer in a rayzero run]
A Trainer script keeps its state in its own `checkpoint-N` directories under `output_dir`: weights,
the engine's sharded checkpoint (`global_stepN/`, written by `DeepSpeedEngine.save_checkpoint`),
the LR scheduler, RNG states and `trainer_state.json` (step, epoch, log history: what tells it how
many batches to skip). A restart must therefore go through `Trainer.train(resume_from_checkpoint=
...)`; resuming the engine alone would leave the Trainer counting from step 0 and re-apply steps.
So `Trainer.train` is wrapped ([Note: the DeepSpeed compatibility layer], item 2):
- when the run is restarted by the controller or resumed by a same-name rerun or `--resume-from`
  (`get_context().resuming`) and the script passed no checkpoint, `train` gets the newest
  *complete* `checkpoint-N`: one with `trainer_state.json` (the Trainer writes it last) and, when it
  holds an engine checkpoint, a committed manifest for step N. Rank 0 chooses; every rank takes its
  choice, so all resume from the same step.
- rayzero's `TrainerCallback` (trainer_callback.py) is added: `on_log` -> `rayzero.report` (step,
  loss, learning rate, samples: what `rayzero status`, metrics.parquet, the progress line and
  `rayzero plot` read); `on_step_end` -> when the ranks agreed on a planned stop or a `checkpoint
  now` at this step (the engine's step-boundary hook, [Note: agreed step boundary]), ask the Trainer
  to save `checkpoint-N` now, and for a stop to end training. The boundary hook has already saved
  the engine into the run's checkpoint directory at that step (which makes a rerun resume); the
  Trainer's own checkpoint-N at the same step is the one it resumes from.
transformers may be imported before or after this runs: if `transformers.trainer` is not loaded yet,
the wrap is applied right after it is (a one-shot import hook), so the script is never touched.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import re
import sys
from typing import Any

_TRAINER_MODULE = "transformers.trainer"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_WRAPPED = "__rayzero_wrapped__"


def install() -> None:
    """Wrap `transformers.Trainer.train` now, or as soon as transformers' trainer module loads."""
    module = sys.modules.get(_TRAINER_MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_wrap` right after `transformers.trainer` executes (one shot, then removes itself)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TRAINER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _wrap(module)
        spec.loader.exec_module = exec_module
        return spec


def _wrap(module: Any) -> None:
    trainer_class = module.Trainer
    original = trainer_class.train
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        from rayzero.compat.trainer_callback import add_callback

        add_callback(self)
        if resume_from_checkpoint in (None, False) and _resume_due():
            resume_from_checkpoint = _agreed(newest_complete_checkpoint(self.args.output_dir)) or resume_from_checkpoint
        return original(self, resume_from_checkpoint, *args, **kwargs)
    setattr(train, _WRAPPED, True)
    trainer_class.train = train


def _resume_due() -> bool:
    """This process continues earlier training of the same run: a restart, a same-name rerun, or a
    resume point given (`get_context().resuming`)."""
    from rayzero.workers.session import get_context

    return get_context().resuming


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` under `output_dir` that a Trainer can resume from, or None."""
    from rayzero.checkpoint.manifest import committed_tags

    if not output_dir or not os.path.isdir(output_dir):
        return None
    found = sorted(((int(match.group(1)), entry.path) for entry in os.scandir(output_dir)
                    if entry.is_dir() and (match := _CHECKPOINT.match(entry.name))), reverse=True)
    for step, path in found:
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            continue  # the Trainer writes it last: anything without it was cut short
        has_engine_checkpoint = any(name.startswith("global_step") for name in os.listdir(path))
        if has_engine_checkpoint and step not in {committed for committed, _ in committed_tags(path)}:
            continue
        return path
    return None


def _agreed(choice: str | None) -> str | None:
    """Rank 0's choice on every rank (they may look at the directory at slightly different times)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return choice
    holder = [choice]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
