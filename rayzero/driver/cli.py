"""`rayzero run TARGET [--config ds.json] --workers N [...] [-- ARGS]`.

TARGET is a training script, `path/to/train.py` (or `-m package.module`): it runs as `__main__` on
every worker, as torchrun runs it, with ARGS as its `sys.argv[1:]` ([Note: scripts on workers] in
rayzero/workers/script.py); `--config` is optional there. Or a loop, `path/to/file.py:function` or
`module:function`, called as `function({"argv": [ARGS]})` (or with no argument if it takes none);
`--config` is required there. Works on a laptop (a local Ray is started) and as the entrypoint of
`ray job submit -- rayzero run ...` (connects to the job's cluster through RAY_ADDRESS). Exits with
0, 2 for input refused before anything started, a failed script's own exit status, or 1.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayzero.config.cli import _trainer_arg
from rayzero.config.errors import RayZeroValueError
from rayzero.config.run_settings import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller.errors import TrainingFailedError
from rayzero.driver.say import say
from rayzero.driver.startup import StartupBoundError
from rayzero.workers.script import ScriptTarget

if TYPE_CHECKING:
    from pydantic import ValidationError
from rayzero.driver.shipping import (
    FileTarget,
    TargetImportError,
    _takes_an_argument,
    import_file,
    relative_to_cwd,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayzero run",
        description="Run a training script (as __main__ on every worker, as torchrun would) or a training "
        "loop on Ray workers. Arguments after `--` go to the script as sys.argv[1:], to a loop as "
        "config['argv'].",
    )
    parser.add_argument("target", nargs="?",
                        help="path/to/train.py (a script), or path/to/file.py:function / package.module:function "
                             "(a loop)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script, as `python -m MODULE`")
    parser.add_argument("--config", default=None,
                        help="DeepSpeed JSON config for the run: required for a loop; for a script optional, given "
                             "to rayzero.initialize() and to Accelerate as `accelerate launch --use_deepspeed "
                             "--deepspeed_config_file` would")
    parser.add_argument("--workers", type=_workers, default=1,
                        help="number of workers (ranks), or an elastic range MIN:MAX (e.g. 2:8); default 1")
    add_run_flags(parser)
    parser.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per worker; default 1")
    parser.add_argument("--resume-from", default=None, help="checkpoint URI/path to resume from")
    parser.add_argument("--max-failures", type=int, default=None,
                        help="worker failures the run may restart from in all (default: no total limit; "
                             "3 in a row without a newer checkpoint end it; 0: fail at the first)")
    parser.add_argument("--max-failures-without-progress", type=int, default=None, metavar="N",
                        help="failures in a row with no newer committed checkpoint that end the run (default 3; "
                             "0: no such limit)")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                        help="a rank with no progress this long after its first step is hung: its stacks are "
                             "printed and the group restarts (default 55, so a hang is reported within a minute; at least 10x the median step time; "
                             "0: off)")
    parser.add_argument("--placement-timeout", type=float, default=120.0,
                        help="seconds to wait for resources before failing (default 120)")
    return parser


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `rayzero run` and `rayzero demo` share, defined once: where the run goes, its name, its
    workers' GPUs and the trainer arguments for the config's "auto" values."""
    parser.add_argument("--storage", default=None,
                        help="root URI for runs (default $RAYZERO_STORAGE_ROOT, else ./runs)")
    parser.add_argument("--name", default=None, help="run name (default rayzero-<date>-<time>)")
    parser.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs per worker (default 0: CPU, gloo)")
    parser.add_argument("--trainer", type=_trainer_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="an HF trainer argument for the config's \"auto\" values (repeatable), e.g. "
                             "--trainer per_device_train_batch_size=4 --trainer learning_rate=3e-5")


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
    """`file.py:function` -> a FileTarget the workers import; `module:function` -> the function.

    The file is imported here too, so a file that does not compile or import, or lacks the function,
    is reported before any worker starts, naming file:line ([Note: shipping the loop]).
    """
    module_part, sep, function_name = target.rpartition(":")
    if not sep or not module_part or not function_name:
        raise RayZeroValueError(f"TARGET {target!r} must look like path/to/file.py:function or module:function")
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part).resolve()
        if not path.is_file():
            raise RayZeroValueError(f"TARGET {target!r}: no file {path}")
        module = import_file(path)
        function = _function_of(module, target, module_part, function_name)
        return FileTarget(str(path), relative_to_cwd(path), function_name, _takes_an_argument(function))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_part)
    except SyntaxError as error:
        raise TargetImportError(f"{error.filename}:{error.lineno}: {error.msg} (TARGET {target!r} does not "
                                "compile)") from None
    except ImportError as error:
        raise RayZeroValueError(f"TARGET {target!r}: cannot import {module_part!r}: {error}") from None
    # A module under the working directory is the user's own: shipping pickles it by value.
    return _function_of(module, target, module_part, function_name)


def _function_of(module: Any, target: str, module_part: str, function_name: str) -> Callable[..., Any]:
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RayZeroValueError(f"TARGET {target!r}: {module_part} has no function {function_name!r}")
    return function


# settings field -> the flag that sets it
_FLAGS = {
    "num_workers": "--workers", "min_workers": "--workers", "max_workers": "--workers",
    "resources_per_worker": "--cpus-per-worker/--gpus-per-worker", "use_gpu": "--gpus-per-worker",
    "placement_timeout_s": "--placement-timeout", "name": "--name", "storage": "--storage",
    "resume_from": "--resume-from", "max_failures": "--max-failures", "hang_timeout_s": "--hang-timeout",
    "max_failures_without_progress": "--max-failures-without-progress",
}


def _flag_problems(error: ValidationError, args: argparse.Namespace) -> str:
    """pydantic's errors in the CLI's words: one line per flag, naming the value given."""
    lines = []
    for item in error.errors():
        field = str(item["loc"][0]) if item.get("loc") else ""
        message = str(item.get("msg", "")).removeprefix("Value error, ").replace("Input should be", "must be")
        if not field and ":" in message and "=" in message.split(":")[0]:  # "num_workers=0: give ..."
            field, _, message = message.partition(":")
            field, message = field.split("=")[0].strip(), message.strip()
        if not field:  # a whole-model check whose message names its field itself: say it as it is
            lines.append(message)
            continue
        flag = _FLAGS.get(field.rpartition(".")[2], field)
        value = getattr(args, flag.lstrip("-").split("/")[0].replace("-", "_"), item.get("input"))
        lines.append(f"{flag} {value}: {message}")
    return "; ".join(lines)


def quiet_ray_log_labels() -> None:
    """For a script run: Ray prints worker lines on this driver without its `(pid=...)` label and
    without folding the ranks' lines together, the script's own `[rank N] ` label is what remains
    ([Note: rank-prefixed output] in rayzero/workers/rank_output.py). Ray reads both settings when it
    is imported: a caller that imported Ray already keeps Ray's labels."""
    if "ray" in sys.modules:
        return
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    ours = r"^\[rank \d+\] "
    theirs = os.environ.get("RAY_DEDUP_LOGS_ALLOW_REGEX")
    os.environ["RAY_DEDUP_LOGS_ALLOW_REGEX"] = f"(?:{theirs})|{ours}" if theirs else ours


def _target(args: argparse.Namespace, loop_args: list[str],
            script_type: type[ScriptTarget]) -> tuple[Callable[..., Any], dict[str, Any] | None]:
    """(what to run, the loop's config) from TARGET / -m: a script, or a loop and its config."""
    if args.module and args.target:
        raise RayZeroValueError(f"give either TARGET ({args.target!r}) or -m {args.module}, not both")
    if args.module or (args.target and args.target.endswith(".py")):
        return script_type(args.module or args.target, loop_args, module=bool(args.module)), None
    if not args.target or ":" not in args.target:
        raise RayZeroValueError(f"TARGET {args.target!r}: give a script (path/to/train.py or -m package.module) or a "
                                "loop (path/to/file.py:function or module:function)")
    if args.config is None:
        raise RayZeroValueError(f"--config is required for a loop target ({args.target}): give the DeepSpeed JSON "
                                "config (rayzero.initialize() in the loop uses it)")
    function = load_target(args.target)
    takes_config = len(inspect.signature(function).parameters) > 0
    if loop_args and not takes_config:
        raise RayZeroValueError(f"{args.target} takes no argument, so the loop args {loop_args} cannot reach it; "
                                "give it one parameter (config['argv'] holds them)")
    return function, {"argv": loop_args} if takes_config else None


def main(argv: list[str] | None = None, script_type: type[ScriptTarget] = ScriptTarget) -> int:
    """`script_type`: what a script target becomes; `rayzero run` passes `rayzero.Script`, which checks
    the script's trainer flags (`--deepspeed ds.json`) before anything starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    loop_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, loop_args = argv[:split], argv[split + 1:]
    args = _parser().parse_args(argv)
    if args.module or (args.target and args.target.endswith(".py")):
        quiet_ray_log_labels()

    from pydantic import ValidationError

    from rayzero.config import ConfigError
    from rayzero.driver.cluster import ClusterUnreachableError
    from rayzero.driver.fit import fit

    try:
        target, loop_config = _target(args, loop_args, script_type)
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
        given = {"max_failures": args.max_failures, "hang_timeout_s": args.hang_timeout,
                 "max_failures_without_progress": args.max_failures_without_progress}
        failure = FailureConfig(**{key: value for key, value in given.items() if value is not None})
        result = fit(
            target,
            config=args.config,
            scaling=scaling,
            run=run,
            failure=failure,
            train_loop_config=loop_config,
            trainer=dict(args.trainer) or None,
        )
    except ConfigError as error:
        print(f"rayzero run: the config was rejected, no worker was started.\n{error}", file=sys.stderr)
        return 2
    except ValidationError as error:  # a flag's value the settings models refuse
        print(f"rayzero run: {_flag_problems(error, args)}", file=sys.stderr)
        return 2
    except (ValueError, ClusterUnreachableError) as error:  # bad target, cluster too small or gone
        print(f"rayzero run: {error}", file=sys.stderr)
        return 2
    except StartupBoundError as error:  # the local Ray could not start on a machine this busy
        print(f"rayzero run: {error}", file=sys.stderr)
        return 1
    except TrainingFailedError as error:
        print(f"rayzero run: {error}", file=sys.stderr)
        if error.exit_code:  # a script's own exit status, as torchrun passes it on
            print(f"rayzero run: the script exited with status {error.exit_code} on rank {error.rank}",
                  file=sys.stderr)
            return error.exit_code
        return 1
    ending = "stopped (planned, checkpoint committed)" if result.stopped else "finished"
    say(f"[rayzero] {ending}: {len(result.metrics_history)} report(s); last metrics {result.metrics}")
    say(f"[rayzero] metrics log: {result.metrics_path}")
    if result.checkpoint:
        say(f"[rayzero] checkpoint: {result.checkpoint}")
    return 0
