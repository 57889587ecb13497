"""rayzero.compat: DeepSpeed's Python API on rayzero's engine, for programs written against DeepSpeed.

[Note: the DeepSpeed compatibility layer]
Why. Most DeepSpeed users never call DeepSpeed themselves: Hugging Face's Trainer (`--deepspeed
ds.json`), Accelerate (a DeepSpeed plugin) and their own scripts reach it through `import deepspeed`.
To run those programs unchanged on rayzero's engine, `rayzero run SCRIPT.py` puts the directory
`rayzero/compat/site` first on the script workers' `sys.path` and `PYTHONPATH`. There, `deepspeed`
is a thin package re-exporting this layer, with a `deepspeed-0.19.8+rayzero.dist-info` beside it so
that transformers' and accelerate's `is_deepspeed_available()` and version checks find it (they ask
`importlib.metadata`; the `+rayzero` local version says which one it is). Nowhere else is that
directory on the path: outside script runs `import deepspeed` is whatever is installed (the bench
extra's real DeepSpeed stays the test oracle), and nothing here is imported.

What. The names transformers, accelerate and DeepSpeed's own examples use, mapped onto rayzero:
`initialize` (-> `rayzero.initialize`, building `DeepSpeedEngine`, a `ZeroEngine` with DeepSpeed's
checkpoint semantics and `config` mapping), `zero.Init` / `GatheredParameters`, `comm`,
`checkpointing`, `accelerator.get_accelerator()` (CPU as well as CUDA), `ops.adam`,
`utils.zero_to_fp32`, `runtime.lr_schedules`, `checkpoint.utils`. docs/deepspeed-api.md lists every
name with its rayzero counterpart; a DeepSpeed feature rayzero does not have (tensor/pipeline/sequence
parallelism, MoE, inference engines) raises `DeepSpeedNameRefused` naming it and saying why.

Runtime adjustments to other libraries, made only inside script runs (this package is imported only
when the site directory is on the path, or by the launcher through `install()`), each for one
defect that would otherwise stop an unchanged program:
1. accelerate's `PartialState` picks its communication backend from the accelerators it finds; on a
   CPU-only machine it finds none, keeps `backend=None` while handing DeepSpeed the process group,
   and then counts one process at local rank 0 on every rank (DeepSpeed 0.19.8 fails there with
   "train_batch_size ... 4 != 4 * 1 * 2"). `deepspeed.comm.is_initialized` / `init_distributed`,
   which accelerate calls at that moment, record the group's backend ("gloo") in accelerate's shared
   state when it holds None, so accelerate reads the world size and ranks from the group (comm.py).
2. transformers' `Trainer.train` is wrapped (trainer.py): when the run is restarted or resumed and
   the script passed no `resume_from_checkpoint`, it resumes from the newest complete `checkpoint-N`
   under `output_dir`; and it adds rayzero's `TrainerCallback`, which reports `on_log` metrics with
   `rayzero.report` and turns a planned stop or `checkpoint now` into a `checkpoint-N` saved at that
   step boundary. The Trainer has no public hook for either: its resume point is `train()`'s
   argument, and callbacks are passed by the script.
"""
from __future__ import annotations

import os

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
"""The directory holding the `deepspeed` package; prepended to sys.path / PYTHONPATH in script runs."""


def install() -> None:
    """Apply the runtime adjustments of [Note: the DeepSpeed compatibility layer] (idempotent).
    Called when the compat `deepspeed` package is imported; a launcher may call it before the
    script runs, so a Trainer without `--deepspeed` also resumes and reports."""
    from rayzero.compat import trainer

    trainer.install()


__all__ = ["SITE_DIR", "install"]
