"""How a training loop travels from the driver to the workers.

[Note: shipping the loop]
Two shapes reach `rayzero.fit`:

* `rayzero run file.py:fn` gives a `FileTarget`: a small reference (the file's path, and its path
  relative to the job's working directory) that the worker imports itself, as `python file.py` or
  torchrun would on each rank. Nothing of the module is pickled, so whatever its module level holds
  (a tokenizer, a config, `import torch.distributed as dist`) is built again on the worker. The file
  is found at its absolute path (same machine, shared filesystem) or under the worker's working
  directory (`ray job submit --working-dir`, or the runtime_env the CLI sets when it joins a
  cluster; see rayzero.driver.cluster).
* Any other callable is pickled once, here, into a `ShippedLoop` (bytes): code the workers can import
  (anything installed: torch, transformers, rayzero) by reference; the user's own modules, which a
  remote worker cannot import, by value. Third-party modules are never registered for by-value
  pickling. A user module the loop refers to as an object (`import helpers` ... `helpers.fn()`)
  travels as its source and is imported (or, where a worker cannot import it, executed) there, so
  its module-level objects are built on the worker, never pickled. Modules that are `types.ModuleType` subclasses (torch's `ConfigModule`, `torch.ops`,
  which plain cloudpickle cannot pickle: "cannot pickle 'ConfigModuleInstance'") are pickled as a
  reference to their importable name. Pickling once on the driver also means the controller only
  forwards bytes: the loop is never re-pickled in a process that lacks the driver's modules.

When something truly cannot be pickled, `UnshippableLoopError` names the object (a global, a closure
variable or a default of the loop) and says how to fix it, instead of Ray's serializer dump.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayzero.config.errors import RayZeroValueError
from rayzero.workers.script import ScriptLaunch, locate_file


class UnshippableLoopError(RayZeroValueError):
    """The training loop (or something it refers to) cannot be sent to the workers."""


# ---------------------------------------------------------------------------------------------------
# Reconstructing on the worker (these run there; they must stay importable from rayzero alone)


def import_by_name(dotted: str) -> Any:
    """The object at `dotted`: the longest importable module prefix, then attributes (torch.ops.aten)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"cannot import {dotted!r} on this worker")


def user_module(name: str, source: str, filename: str) -> types.ModuleType:
    """The user's module `name` on a worker: imported when the worker can, else built from the
    source shipped with the loop — its module-level objects are created here, never pickled."""
    existing = sys.modules.get(name)
    if existing is not None:
        return existing
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__package__ = name if filename.endswith("__init__.py") else name.rpartition(".")[0]
    sys.modules[name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the user's own module
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _takes_an_argument(function: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(function).parameters) > 0
    except (TypeError, ValueError):
        return True


def _loop_signature(takes_argument: bool) -> inspect.Signature:
    parameters = [inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if takes_argument else []
    return inspect.Signature(parameters)


class ShippedLoop:
    """A loop pickled once on the driver; unpickled (once per process) where it is called."""

    def __init__(self, payload: bytes, name: str, takes_argument: bool) -> None:
        self.payload = payload  # cloudpickle bytes of the user's function
        self.name = name  # module.qualname, for messages
        self.takes_argument = takes_argument  # the worker passes the config only to a loop that takes one
        self._function: Callable[..., Any] | None = None

    @property
    def __signature__(self) -> inspect.Signature:  # what the worker inspects to pass the config
        return _loop_signature(self.takes_argument)

    def __getstate__(self) -> dict[str, Any]:
        return {"payload": self.payload, "name": self.name, "takes_argument": self.takes_argument}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["payload"], state["name"], state["takes_argument"])

    def function(self) -> Callable[..., Any]:
        if self._function is None:
            import ray.cloudpickle

            self._function = ray.cloudpickle.loads(self.payload)
        return self._function

    def __call__(self, *args: Any) -> Any:
        return self.function()(*args)

    def __repr__(self) -> str:
        return f"ShippedLoop({self.name})"


@dataclass(frozen=True)
class FileTarget:
    """`path/to/file.py:function`, imported by the worker itself (see [Note: shipping the loop])."""

    path: str
    """Absolute path of the file on the driver's machine."""
    relative_path: str
    """The same file relative to the driver's working directory (found under a job's working_dir)."""
    function_name: str
    takes_argument: bool

    @property
    def working_dir(self) -> str:
        """The file's directory: shipped as the runtime_env working_dir when joining a cluster."""
        return str(Path(self.path).parent)

    @property
    def __signature__(self) -> inspect.Signature:
        return _loop_signature(self.takes_argument)

    def locate(self) -> Path:
        return locate_file(self.path, self.relative_path)

    def function(self) -> Callable[..., Any]:
        return getattr(import_file(self.locate()), self.function_name)

    def __call__(self, *args: Any) -> Any:
        return self.function()(*args)


def _module_name_for(path: Path) -> str:
    return f"rayzero_target_{path.stem}"


def import_file(path: Path) -> types.ModuleType:
    """Import a file as a module (once per process); its directory goes on sys.path for its own imports.

    Errors that a user can cause (syntax, import) are raised as `TargetImportError` naming file:line.
    """
    path = path.resolve()
    name = _module_name_for(path)
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == str(path):
        return existing
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # the file's own helper imports, as `python file.py` has
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        raise TargetImportError(
            f"{error.filename or path}:{error.lineno}: {error.msg} (the target file does not compile)"
        ) from None
    except Exception as error:  # noqa: BLE001 - any import-time failure of the user's file
        del sys.modules[name]
        raise TargetImportError(f"{_innermost_line(error, path)}: importing it raised "
                                f"{type(error).__name__}: {error}") from None
    return module


class TargetImportError(RayZeroValueError):
    """The target file of `rayzero run` does not compile or raises while being imported."""


def _innermost_line(error: BaseException, path: Path) -> str:
    """`file:line` of the deepest frame of `error` inside the target file (else the file alone)."""
    where = str(path)
    frame = error.__traceback__
    while frame is not None:
        if Path(frame.tb_frame.f_code.co_filename).resolve() == path:
            where = f"{path}:{frame.tb_lineno}"
        frame = frame.tb_next
    return where


# ---------------------------------------------------------------------------------------------------
# Pickling on the driver


def _installed_roots() -> set[Path]:
    return {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}


def is_installed(module: types.ModuleType) -> bool:
    """True for code every worker can import: the interpreter's, site-packages, rayzero, ray."""
    if module.__name__.split(".")[0] in ("rayzero", "ray") or module.__name__ in sys.builtin_module_names:
        return True
    file = getattr(module, "__file__", None)
    if not file:
        return True  # builtins, namespace packages: importable by name
    resolved = Path(file).resolve()
    if any(part in ("site-packages", "dist-packages") for part in resolved.parts):
        return True
    return any(root in resolved.parents for root in _installed_roots())


def _user_modules() -> Iterator[types.ModuleType]:
    """Modules the driver imported from the user's own files (workers on other nodes lack them)."""
    for name, module in list(sys.modules.items()):
        if name == "__main__" or not isinstance(module, types.ModuleType):
            continue
        if getattr(module, "__file__", None) and not is_installed(module):
            yield module


def _pickler_class() -> type:
    import ray.cloudpickle

    by_value = ray.cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES

    class LoopPickler(ray.cloudpickle.CloudPickler):
        """cloudpickle, plus: module objects of ModuleType subclasses travel as their importable name."""

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is types.ModuleType and obj.__name__ in by_value and getattr(obj, "__file__", None):
                # `import helpers` then `helpers.fn()` in the loop: the module object itself is a
                # global. Its source travels, not its contents (which may hold anything).
                try:
                    source = Path(obj.__file__).read_text()
                except (OSError, UnicodeDecodeError):
                    return super().reducer_override(obj)
                return user_module, (obj.__name__, source, obj.__file__)
            if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
                name = getattr(obj, "__name__", None)
                if isinstance(name, str):
                    try:
                        same = import_by_name(name) is obj
                    except (ImportError, AttributeError):
                        same = False
                    if same:
                        return import_by_name, (name,)
            return super().reducer_override(obj)

    return LoopPickler


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _pickler_class()(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def ship(train_loop: Callable[..., Any]) -> Callable[..., Any]:
    """What `rayzero.fit` hands to the controller for `train_loop` (see [Note: shipping the loop])."""
    if isinstance(train_loop, (FileTarget, ShippedLoop, ScriptLaunch)):  # references the workers resolve
        return train_loop
    import ray.cloudpickle

    registered = []
    for module in _user_modules():
        if module.__name__ not in ray.cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES:
            ray.cloudpickle.register_pickle_by_value(module)
            registered.append(module)
    try:
        payload = _dumps(train_loop)
    except Exception as error:  # noqa: BLE001 - any pickling failure becomes one named error
        raise _explain(train_loop, error) from None
    finally:
        for module in registered:  # the registration is process-wide: leave the driver as we found it
            ray.cloudpickle.unregister_pickle_by_value(module)
    name = f"{getattr(train_loop, '__module__', '?')}.{getattr(train_loop, '__qualname__', repr(train_loop))}"
    return ShippedLoop(payload, name, _takes_an_argument(train_loop))


def _references(function: Any) -> Iterator[tuple[str, Any]]:
    """(how the loop refers to it, object) for a function's globals, closure cells and defaults."""
    code = getattr(function, "__code__", None)
    if code is None:
        yield "the loop itself", function
        return
    import ray.cloudpickle

    globals_ = getattr(function, "__globals__", {})
    for name in sorted(ray.cloudpickle.cloudpickle._extract_code_globals(code)):
        if name in globals_:
            yield f"global {name!r}", globals_[name]
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for index, value in enumerate(function.__defaults__ or ()):
        yield f"default argument #{index}", value


def _find_culprit(function: Any, depth: int = 0) -> tuple[str, Any, BaseException] | None:
    for where, value in _references(function):
        try:
            _dumps(value)
        except Exception as error:  # noqa: BLE001
            if isinstance(value, types.FunctionType) and depth < 3 and value is not function:
                inner = _find_culprit(value, depth + 1)
                if inner is not None:
                    return f"{where} -> {inner[0]}", inner[1], inner[2]
            return where, value, error
    return None


def _explain(function: Any, error: BaseException) -> UnshippableLoopError:
    loop = getattr(function, "__qualname__", type(function).__name__)
    culprit = _find_culprit(function)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if culprit is None:
        return UnshippableLoopError(
            f"the training loop {loop} cannot be sent to the workers: {first_line}. Define it at module "
            "level in a file and run it with `rayzero run file.py:{loop}`, which imports the file on the workers")
    where, value, inner = culprit
    reason = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    return UnshippableLoopError(
        f"the training loop {loop} cannot be sent to the workers: its {where} "
        f"({type(value).__module__}.{type(value).__qualname__}) cannot be pickled ({reason}). "
        "Create it inside the loop, or define it in an importable module, or run the loop with "
        "`rayzero run file.py:function` (the file is imported on the workers, nothing pickled)"
    )


def relative_to_cwd(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return os.path.basename(path)
