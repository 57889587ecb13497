"""A script target on the driver: its pre-flight and what the workers get ([Note: scripts on workers]
in rayzero/workers/script.py).

Nothing of the script runs here (a training script trains when imported): the file is looked for and
compiled, a module is looked up, and the script's own config flags are checked by
`ScriptTarget.check_args`, all before any worker (or Ray) starts.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from rayzero.config.environment import SCRIPT
from rayzero.config.errors import RayZeroValueError
from rayzero.config.run_settings import FailureConfig
from rayzero.driver.shipping import TargetImportError, relative_to_cwd
from rayzero.workers.script import ScriptLaunch, ScriptTarget


def prepare_script(target: ScriptTarget, world_size: int) -> ScriptLaunch:
    """Check the script before anything starts; what every worker needs to run it."""
    cwd = os.getcwd()
    if target.module:
        launch = ScriptLaunch(target.path, tuple(target.args), True, None, None, cwd, _module_home(target.path, cwd))
    else:
        path = Path(target.path)
        if not path.is_file():
            raise RayZeroValueError(
                f"script {target.path!r}: no such file ({path.resolve()}); give the path of the training script "
                "(relative to the working directory or absolute), or `-m package.module` for a module")
        _check_compiles(path)
        resolved = path.resolve()
        launch = ScriptLaunch(target.path, tuple(target.args), False, str(resolved), relative_to_cwd(resolved), cwd,
                              str(resolved.parent))
    target.check_args(world_size)
    return launch


def script_environment(failure: FailureConfig) -> dict[str, str]:
    """The run-wide variables of a script run (each worker adds its own; see script.py)."""
    return {SCRIPT.name: "1", "TORCHELASTIC_MAX_RESTARTS": str(failure.max_failures)}


def _check_compiles(path: Path) -> None:
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as error:
        raise TargetImportError(f"{error.filename or path}:{error.lineno}: {error.msg} (the script does not "
                                "compile; no worker was started)") from None
    except ValueError as error:  # e.g. null bytes: not a Python source file
        raise TargetImportError(f"{path}: {error} (not a Python script; no worker was started)") from None


def _module_home(name: str, cwd: str) -> str | None:
    """The directory to ship for `-m name` (the working directory when the module lives under it, as
    `python -m` finds it there); None for an installed module. Raises when no such module exists."""
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as error:  # a parent package that does not import
        raise RayZeroValueError(f"-m {name}: cannot be looked up: {error}") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if spec is None:
        raise RayZeroValueError(f"-m {name}: no module named {name!r} on the driver's path (working directory "
                                f"{cwd} included); check the name, or give the script's file path instead")
    origin = spec.origin or ""
    if origin.endswith(".py"):
        _check_compiles(Path(origin))
    return cwd if origin and Path(origin).resolve().is_relative_to(Path(cwd).resolve()) else None
