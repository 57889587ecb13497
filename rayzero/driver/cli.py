"""`rayzero run TARGET --config ds.json --workers N [...] [-- loop args]`.

TARGET is `path/to/file.py:function` or `module:function`. The function is called as
`function({"argv": [loop args]})` (or with no argument if it takes none). Works on a laptop (a
local Ray is started) and as the entrypoint of `ray job submit -- rayzero run ...` (connects to
the job's cluster through RAY_ADDRESS).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayzero.config.errors import RayZeroValueError
from rayzero.controller.configs import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller.errors import TrainingFailedError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayzero run",
        description="Run a training loop on Ray workers. Arguments after `--` go to the loop as "
        "config['argv'].",
    )
    parser.add_argument("target", help="path/to/file.py:function or package.module:function")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config for the run")
    parser.add_argument("--workers", type=_workers, default=1,
                        help="number of workers (ranks), or an elastic range MIN:MAX (e.g. 2:8); default 1")
    parser.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs per worker (0: CPU, gloo)")
    parser.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per worker; default 1")
    parser.add_argument("--storage", default=None, help="root URI for runs (default ./runs)")
    parser.add_argument("--name", default=None, help="run name (default rayzero-<date>-<time>)")
    parser.add_argument("--resume-from", default=None, help="checkpoint URI/path to resume from")
    parser.add_argument("--max-failures", type=int, default=0, help="worker failures to retry (-1: always)")
    parser.add_argument("--placement-timeout", type=float, default=120.0,
                        help="seconds to wait for resources before failing (default 120)")
    return parser


def _workers(text: str) -> int | tuple[int, int]:
    """`--workers N` or `--workers MIN:MAX` (elastic)."""
    try:
        if ":" in text:
            low, high = text.split(":", 1)
            return int(low), int(high)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: give a count (4) or a range MIN:MAX (2:8)") from None


def load_target(target: str) -> Callable[..., Any]:
    """Import `file.py:function` or `module:function`; ValueError naming what is wrong otherwise."""
    import ray.cloudpickle  # Ray pickles with its own copy of cloudpickle

    module_part, sep, function_name = target.rpartition(":")
    if not sep or not module_part or not function_name:
        raise RayZeroValueError(f"TARGET {target!r} must look like path/to/file.py:function or module:function")
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part).resolve()
        if not path.is_file():
            raise RayZeroValueError(f"TARGET {target!r}: no file {path}")
        module_name = f"rayzero_target_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        sys.path.insert(0, str(path.parent))  # the file's own helper imports, as `python file.py` has
        spec.loader.exec_module(module)
        by_value = True
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ImportError as error:
            raise RayZeroValueError(f"TARGET {target!r}: cannot import {module_part!r}: {error}") from None
        file = getattr(module, "__file__", None) or ""
        # Code under the working directory is not installed on the workers: ship it by value.
        by_value = file.startswith(os.getcwd() + os.sep) and not module_part.startswith("rayzero.")
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RayZeroValueError(  # noqa: TRY004 - a user error in TARGET, reported with the usage errors
            f"TARGET {target!r}: {module_part} has no function {function_name!r}")
    if by_value:
        ray.cloudpickle.register_pickle_by_value(module)
    return function


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    loop_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, loop_args = argv[:split], argv[split + 1:]
    args = _parser().parse_args(argv)

    from rayzero.config import ConfigError
    from rayzero.driver.fit import fit

    try:
        function = load_target(args.target)
        takes_config = len(inspect.signature(function).parameters) > 0
        if loop_args and not takes_config:
            raise RayZeroValueError(f"{args.target} takes no argument, so the loop args {loop_args} cannot reach it; "
                             "give it one parameter (config['argv'] holds them)")
        resources = {"CPU": args.cpus_per_worker}
        if args.gpus_per_worker:
            resources["GPU"] = args.gpus_per_worker
        scaling = ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.gpus_per_worker > 0,
            resources_per_worker=resources,
            placement_timeout_s=args.placement_timeout,
        )
        run = RunConfig(name=args.name, storage=args.storage, resume_from=args.resume_from)
        failure = FailureConfig(max_failures=args.max_failures)
        result = fit(
            function,
            config=args.config,
            scaling=scaling,
            run=run,
            failure=failure,
            train_loop_config={"argv": loop_args} if takes_config else None,
        )
    except ConfigError as error:
        print(f"rayzero run: the config was rejected, no worker was started.\n{error}", file=sys.stderr)
        return 2
    except ValueError as error:  # bad target / scaling arguments (pydantic's ValidationError too)
        print(f"rayzero run: {error}", file=sys.stderr)
        return 2
    except TrainingFailedError as error:
        print(f"rayzero run: {error}", file=sys.stderr)
        return 1
    ending = "stopped (planned, checkpoint committed)" if result.stopped else "finished"
    print(f"[rayzero] {ending}: {len(result.metrics_history)} report(s); last metrics {result.metrics}")
    print(f"[rayzero] metrics log: {result.metrics_path}")
    if result.checkpoint:
        print(f"[rayzero] checkpoint: {result.checkpoint}")
    return 0
