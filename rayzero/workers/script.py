"""A training script run as `__main__` on every worker, as `torchrun script.py ARGS` runs it.

[Note: scripts on workers]
`rayzero run train.py -- ARGS` and `rayzero.fit(rayzero.Script("train.py", args=[...]))` run an
unmodified script: programs built on the HF Trainer, Accelerate, Lightning or a bare
`deepspeed.initialize` loop form their own process group (`init_process_group` through env://), so
each worker gives the script what torchrun gives it and nothing more:

* RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK (= NODE_RANK),
  GROUP_WORLD_SIZE, ROLE_*, and torchelastic's TORCHELASTIC_RUN_ID (the run name: Lightning and
  `torch.distributed.is_torchelastic_launched()` take the launcher's ranks from it),
  TORCHELASTIC_RESTART_COUNT (= the attempt) and TORCHELASTIC_USE_AGENT_STORE=False (rank 0 hosts
  the rendezvous store, as with `init_process_group` by hand);
* `sys.argv = [path as given, *args]`, the script's directory first on `sys.path` (for `-m module`:
  the working directory, as `python -m`), the driver's working directory as cwd where it exists on
  the worker (same machine, shared filesystem, a job's working_dir), run with `runpy`;
* its output labelled by rank ([Note: rank-prefixed output] in rank_output.py);
* with `--config`, what `accelerate launch --use_deepspeed --deepspeed_config_file` sets
  (`accelerate_environment`), and the config in RAYZERO_CONFIG for `rayzero.initialize()`.

The worker does *not* form the default process group first (a second `init_process_group` in the
script would fail). The step-boundary machinery ([Note: agreed step boundary] in boundary.py) is
installed as the engine's hook before the script starts and comes alive when the script's first
rayzero engine steps: its agreement all-reduce runs on the script's default group, or on a gloo group
it creates then, collectively, at the first step, when that group is NCCL. Before that, a line of
output counts as progress for the hang detector, under `startup_grace_s` ([Note: hang detection]).

How the script ends is its exit status, as Python's: returning or `sys.exit(0)`/`sys.exit(None)` is
0, `sys.exit(n)` is n, `sys.exit("text")` prints the text and is 1, an exception prints its traceback
and is 1. A nonzero status is a failure of that rank (charged to `FailureConfig.max_failures`); the
controller restarts the group and every rank runs the script again from the top with
RAYZERO_ATTEMPT / `get_context().attempt` raised, `get_context().resuming` true and RAYZERO_RESUME_FROM
set when the run has a committed rayzero checkpoint. Once the retries are spent, `rayzero run` exits
with the status, naming the rank. A planned stop reaches a script through its engine, as for a loop:
`RunStopped` out of the next `engine(...)` call after the boundary checkpoint committed.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from rayzero.config.environment import ATTEMPT, CONFIG, NODE_LOCAL_DIR, RUN
from rayzero.workers.boundary import RunStopped
from rayzero.workers.rank_output import RankOutput

"""`1` in every process of a script run (`rayzero run SCRIPT.py`, `rayzero.fit(rayzero.Script(...))`)."""


@dataclass(frozen=True)
class ScriptTarget:
    """A training script for every worker to run as `__main__` ([Note: scripts on workers]).

    Users write `rayzero.Script(...)` (rayzero/integrations/script_args.py), which adds the pre-flight
    of trainer flags such as `--deepspeed ds.json` to `check_args`."""

    path: str
    """The script: a `.py` file (relative to the working directory, or absolute), or with `module=True`
    a module name run as `python -m path`."""
    args: Sequence[str] = ()
    """The script's own arguments: `sys.argv[1:]` on every worker."""
    module: bool = False
    """Run `path` as a module (`python -m`), found on the workers' `sys.path`."""

    def __post_init__(self) -> None:
        if isinstance(self.args, str) or not all(isinstance(arg, str) for arg in self.args):
            from rayzero.config.errors import RayZeroValueError

            raise RayZeroValueError(f"Script(args={self.args!r}): give a list of strings, e.g. "
                                    "args=[\"--lr\", \"1e-3\"] (sys.argv[1:] of the script)")
        object.__setattr__(self, "args", tuple(self.args))

    def check_args(self, world_size: int) -> None:
        """Check the script's own arguments on the driver before any worker starts (`world_size`: the
        run's first size). The base knows no framework's flags; `rayzero.Script` checks the HF
        Trainer's and DeepSpeed's config flags."""


@dataclass(frozen=True)
class ScriptLaunch:
    """A `ScriptTarget` resolved on the driver: what each worker needs to find and run it."""

    target: str
    """The path (or module name) as the user gave it: `sys.argv[0]` where it resolves on the worker."""
    args: tuple[str, ...]
    module: bool
    path: str | None
    """Absolute path of the file on the driver (None for a module)."""
    relative_path: str | None
    """The same file relative to the driver's working directory (found under a job's working_dir)."""
    cwd: str
    """The driver's working directory: the script's cwd on every worker where it exists."""
    working_dir: str | None = field(default=None)
    """What to ship as the runtime_env working_dir when joining a cluster from outside a job (the
    script's directory, as for `rayzero run file.py:function`)."""


@dataclass(frozen=True)
class ScriptExit:
    """How a script ended on one rank."""

    code: int
    """Its exit status (0: success)."""
    error: str | None = None
    """`Type: message` for a failure (`SystemExit: 3` for `sys.exit(3)`)."""
    traceback_text: str = ""


def locate_file(path: str, relative_path: str) -> Path:
    """The file on this worker: at its absolute path (same machine, shared filesystem), under the
    working directory by its path relative to the driver's (a job's working_dir), or by its name
    (the runtime_env working_dir rayzero ships when joining a cluster: the file's own directory)."""
    for candidate in (Path(path), Path.cwd() / relative_path, Path.cwd() / Path(path).name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"rayzero: {path} is not on this worker (nor {relative_path} under its working directory "
        f"{Path.cwd()}); put it on shared storage or submit with `ray job submit --working-dir DIR`, DIR "
        "containing the file"
    )


def torchelastic_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What torchrun's agent sets beyond the rendezvous variables the worker group sets."""
    return {
        "ROLE_RANK": env["RANK"],
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": env["WORLD_SIZE"],
        "TORCHELASTIC_RUN_ID": RUN.get(env).name or "none",
        "TORCHELASTIC_RESTART_COUNT": str(ATTEMPT.get(env)),
        "TORCHELASTIC_MAX_RESTARTS": env.get("TORCHELASTIC_MAX_RESTARTS", "-1"),  # -1: no total limit
        # torchrun's agent hosts the store and sets True; here rank 0 hosts it (env:// as by hand)
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def accelerate_environment(config_json: str, directory: str) -> dict[str, str]:
    """What `accelerate launch --use_deepspeed --deepspeed_config_file ds.json` gives its processes
    (accelerate's utils/launch.py `prepare_deepspeed_cmd_env`, with no accelerate config file and no
    other flag), the config written to a file this worker can read."""
    os.makedirs(directory, exist_ok=True)
    config_file = os.path.join(directory, "deepspeed_config.json")
    with open(config_file, "w") as handle:
        json.dump(json.loads(config_json), handle, indent=2)
    return {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": config_file,
        "ACCELERATE_MIXED_PRECISION": os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),  # the config decides
        "ACCELERATE_CONFIG_DS_FIELDS": "",  # no field comes from an accelerate config file
    }


# [Note: the DeepSpeed-compatible module in script runs]
# A script written for DeepSpeed (`import deepspeed`, directly or through the HF Trainer, Accelerate
# or Lightning) should train on rayzero's engine unchanged. rayzero ships a `deepspeed`-compatible
# package in rayzero/compat/site/ (written by the HF integration); `use_compat_modules` puts that
# directory ahead of site-packages on this worker's `sys.path` and PYTHONPATH (for the script's child
# processes) just before a script runs, so `import deepspeed` inside the run resolves to it. It is
# called only there (rayzero.workers.actor, for `rayzero run SCRIPT.py` / `rayzero.fit(rayzero.Script(...))`):
# the driver, `rayzero run file.py:function` loops, torchrun and every other process keep importing
# whatever `deepspeed` is installed (the bench extra's real DeepSpeed stays importable as itself).
# Where the directory does not exist, nothing changes.
COMPAT_SITE = Path(__file__).resolve().parents[1] / "compat" / "site"


def use_compat_modules(site: Path = COMPAT_SITE, environ: dict[str, str] | None = None) -> bool:
    """Put `site` first on `sys.path` and PYTHONPATH ([Note: the DeepSpeed-compatible module in script
    runs]); False (and no change) when it does not exist."""
    if not site.is_dir():
        return False
    environ = os.environ if environ is None else environ
    entry = str(site)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    existing = [part for part in environ.get("PYTHONPATH", "").split(os.pathsep) if part and part != entry]
    environ["PYTHONPATH"] = os.pathsep.join([entry, *existing])
    return True


def _exit_of(error: SystemExit) -> ScriptExit:
    """Python's own mapping of `sys.exit(x)` to an exit status."""
    code = error.code
    if code is None:
        return ScriptExit(0)
    if isinstance(code, int):
        return ScriptExit(code, f"SystemExit: {code}" if code else None)
    print(code, file=sys.stderr)  # what the interpreter prints for sys.exit("text")
    return ScriptExit(1, f"SystemExit: {code}")


def _from_the_script(frames: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on, as `python script.py` prints it (without
    runpy's and this module's frames)."""
    while frames is not None and frames.tb_frame.f_code.co_filename in (runpy.__file__, "<frozen runpy>", __file__):
        frames = frames.tb_next
    return frames


def run_script(launch: ScriptLaunch, rank: int, on_output: Callable[[], None] | None = None) -> ScriptExit:
    """Run the script as `__main__` in this process ([Note: scripts on workers]); `RunStopped` (a
    planned stop) passes through, every other ending is returned as a `ScriptExit`."""
    if os.path.isdir(launch.cwd):
        os.chdir(launch.cwd)
    use_compat_modules()
    config = CONFIG.get()
    if config:
        where = NODE_LOCAL_DIR.get() or tempfile.gettempdir()
        name = f"{RUN.get().name or 'run'}-attempt{ATTEMPT.get()}-rank{rank}"
        os.environ.update(accelerate_environment(config, os.path.join(where, "scripts", name)))
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    with RankOutput(rank, on_output):
        try:
            if launch.module:
                sys.path.insert(0, os.getcwd())
                sys.argv = [launch.target, *launch.args]  # runpy sets argv[0] to the module's file
                runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
            else:
                assert launch.path is not None and launch.relative_path is not None
                found = locate_file(launch.path, launch.relative_path)
                as_given = Path(launch.target)
                argv0 = launch.target if as_given.is_file() and as_given.resolve() == found.resolve() else str(found)
                sys.path.insert(0, str(found.resolve().parent))
                sys.argv = [argv0, *launch.args]
                runpy.run_path(argv0, run_name="__main__")
            return ScriptExit(0)
        except RunStopped:
            raise
        except SystemExit as error:
            return _exit_of(error)
        except BaseException as error:  # noqa: BLE001 - the script's failure, reported as Python would
            text = "".join(traceback.format_exception(type(error), error, _from_the_script(error.__traceback__)))
            print(text, end="", file=sys.stderr)
            return ScriptExit(1, f"{type(error).__name__}: {error}", text)
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
