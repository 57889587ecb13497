"""Every `RAYZERO_*` environment variable rayzero reads, declared once: name, type, default, parser,
one line of documentation, and who sets it. docs/environment.md is generated from this table
(`python -m rayzero.config.environment_docs --write docs/environment.md`; checked by `make
docs-check` and tests/unit/test_environment.py, which also fails on a `RAYZERO_*` name in the source
that is not declared here).

[Note: environment variables]
Code reads a variable through its declaration (`COLLECTIVE_TIMEOUT_S.get()`), never through
`os.environ` by name: the declaration parses the text, applies the default, names the variable and
its value when the value does not parse, and reads a deprecated name (with a FutureWarning naming
the new one) for one release after a rename. Who sets a variable is its `Role`:

  SETTING   a user, a deployment (the Helm chart, a pod spec) or the Kubernetes operator sets it; some
            are also passed on by rayzero from the driver to its workers (RAYZERO_CONFIG under
            `rayzero run`, set by hand under torchrun)
  PROVIDED  rayzero sets it in a worker for the user's loop or script to read (`RAYZERO_ATTEMPT`)
  INTERNAL  rayzero's own processes hand it to each other; documented so a reader knows what it is,
            not to be set

What the driver hands every worker of a run and nobody else sets or reads travels as one value,
RAYZERO_RUN (a JSON `RunHandoff`), read where it is needed. Values that are set per attempt
(RAYZERO_ATTEMPT, RAYZERO_RESUME_FROM, RAYZERO_CONFIG) or per rank (RAYZERO_NODE_ID,
RAYZERO_NODE_LOCAL_DIR) by other parties stay variables of their own, as do those a user may set
(RAYZERO_CHECKPOINT_DIR, RAYZERO_RUN_LINEAGE, RAYZERO_COLLECTIVE_TIMEOUT_S under torchrun).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rayzero.config.errors import RayZeroValueError

T = TypeVar("T")


class Role(enum.Enum):
    """Who sets a variable ([Note: environment variables])."""

    SETTING = "setting"
    PROVIDED = "provided"
    INTERNAL = "internal"


class EnvironmentValueError(RayZeroValueError):
    """An environment variable holds a value rayzero cannot use."""


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: how to read it, and what docs/environment.md says about it."""

    name: str
    parse: Callable[[str], T]
    """Text -> value; raises ValueError (or KeyError, TypeError) on a bad value."""
    type: str
    """The value's kind as docs/environment.md shows it, e.g. "seconds", "a URI", "true/false"."""
    default: T | None
    """The value when the variable is unset (or empty, unless `empty_is_unset` is False)."""
    doc: str
    role: Role
    group: str
    """The heading it appears under in docs/environment.md."""
    default_text: str | None = None
    """What docs/environment.md says for the default when `default` alone does not say it."""
    deprecated_names: tuple[str, ...] = ()
    """Former names, still read (with a FutureWarning naming this one) when this one is unset."""
    empty_is_unset: bool = True
    """An empty value means unset; False where "" means something (RAYZERO_DURABLE_URI: no copy)."""

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The raw text, from this name or a deprecated one; None when unset."""
        env = os.environ if environ is None else environ
        value = env.get(self.name)
        if value is None:
            for old in self.deprecated_names:
                if old in env:
                    warnings.warn(f"environment variable {old} is deprecated and will not be read in the next "
                                  f"release: set {self.name} instead", FutureWarning, stacklevel=3)
                    value = env[old]
                    break
        if value is not None and self.empty_is_unset and not value.strip():
            return None
        return value

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.text(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value, else the default."""
        text = self.text(environ)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except (ValueError, KeyError, TypeError):
            raise EnvironmentValueError(f"{self.name}={text!r}: use {self.type} or unset it ({self.name}: "
                                        f"{self.doc})") from None


def _bool(text: str) -> bool:
    return {"true": True, "1": True, "false": False, "0": False}[text.strip().lower()]


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(value)
        return value
    return parse


def declared() -> list[Variable[Any]]:
    """Every variable declared below, in order (docs/environment.md's order)."""
    return [value for value in globals().values() if isinstance(value, Variable)]


SETTING, PROVIDED, INTERNAL = Role.SETTING, Role.PROVIDED, Role.INTERNAL
_RUN, _CKPT, _ENGINE, _CONTROL, _OPERATOR = ("Runs and the driver", "Checkpoints", "Engine", "Control service",
                                              "Kubernetes operator")

# Runs and the driver -----------------------------------------------------------------------------
ADDRESS = Variable("RAYZERO_ADDRESS", str, "a Ray address", None,
                   "the Ray cluster `rayzero run` / `rayzero.fit` joins (before RAY_ADDRESS); unset: a local Ray "
                   "is started ([Note: joining only when asked])", SETTING, _RUN)
STORAGE_ROOT = Variable("RAYZERO_STORAGE_ROOT", str, "a URI or a path", None,
                        "root under which runs keep their directories when --storage / RunConfig.storage is not "
                        "given", SETTING, _RUN, default_text="./runs")
CONFIG = Variable("RAYZERO_CONFIG", str, "a path or JSON text", None,
                  "the DeepSpeed config `rayzero.initialize()` uses without `config=` (rayzero sets it on its "
                  "workers; set it yourself under torchrun)", SETTING, _RUN)
RESUME_FROM = Variable("RAYZERO_RESUME_FROM", str, "a URI or a path", None,
                       "checkpoint the run resumes from (the operator sets it on a retried attempt); on a worker, "
                       "the attempt's resume point (`get_context().resume_from`, `engine.steps()`)", SETTING, _RUN)
COLLECTIVE_TIMEOUT_S = Variable("RAYZERO_COLLECTIVE_TIMEOUT_S", float, "seconds (a number)", 300.0,
                                "bound of every process-group collective (rayzero sets it on its workers from "
                                "FailureConfig.process_group_timeout_s)", SETTING, _RUN)
CHECKPOINT_DIR = Variable("RAYZERO_CHECKPOINT_DIR", str, "a URI or a path", None,
                          "where `save_checkpoint()` / `load_checkpoint()` without a directory go (rayzero sets "
                          "it on its workers to the run's checkpoints/)", SETTING, _RUN)
NODE_LOCAL_DIR = Variable("RAYZERO_NODE_LOCAL_DIR", str, "a path", None,
                          "this node's fast local disk (the operator's pods and the worker image set it); "
                          "rayzero gives each Ray node its own directory under it", SETTING, _RUN,
                          default_text="the temporary directory")
RUN_LINEAGE = Variable("RAYZERO_RUN_LINEAGE", str, "text", None,
                       "the run lineage whose checkpoints retention rotates (rayzero.fit sets one per run name); "
                       "set a stable id to rotate across restarts outside rayzero.fit", SETTING, _RUN,
                       default_text="a new id per process group")
ATTEMPT = Variable("RAYZERO_ATTEMPT", int, "an integer", 0,
                   "the controller's attempt: 0 first, +1 per restart or resize (`get_context().attempt`)",
                   PROVIDED, _RUN)
SCRIPT = Variable("RAYZERO_SCRIPT", _bool, "1", False,
                  "1 in a training script run by `rayzero run` / `rayzero.fit(rayzero.Script(...))`", PROVIDED, _RUN,
                  default_text="unset")
NODE_ID = Variable("RAYZERO_NODE_ID", str, "a Ray node id", None,
                   "the Ray node a rank runs on, set per rank by the worker group (`get_context().node_id`, "
                   "replica placement)", INTERNAL, _RUN, default_text="node0 (one node)")


@dataclass(frozen=True)
class RunHandoff:
    """What `rayzero.fit` hands every worker of a run and nothing else sets ([Note: environment
    variables]): one JSON value in RAYZERO_RUN."""

    name: str = ""
    """The run's name (`get_context().run_name`)."""
    storage: str = ""
    """The run's directory URI (`get_context().storage`)."""
    resuming: bool = False
    """A rerun under the same name and storage (`get_context().resuming`)."""
    node_local_checkpoints: bool = False
    """Checkpoints go to each node's disk ([Note: node-local runs] in rayzero/workers/boundary.py)."""
    trainer: dict[str, Any] | None = None
    """HF trainer arguments the config's "auto" values take (`--trainer`, `fit(trainer=)`)."""
    notes_shown: tuple[str, ...] | None = None
    """Config notes the driver logged already ([Note: config notes once] in rayzero/config/loader.py);
    None outside rayzero.fit."""

    def to_text(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> RunHandoff:
        values = json.loads(text)
        names = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(values, dict) or not set(values) <= names:
            raise ValueError(text)
        if values.get("notes_shown") is not None:
            values["notes_shown"] = tuple(values["notes_shown"])
        return cls(**values)


RUN = Variable("RAYZERO_RUN", RunHandoff.from_text, "JSON", RunHandoff(),
               "what rayzero.fit hands every worker of a run: name, storage, resuming, node-local checkpoints, "
               "trainer arguments, config notes shown (rayzero/config/environment.py `RunHandoff`)",
               INTERNAL, _RUN, default_text="outside rayzero.fit: none")

# Checkpoints: overrides of the config's `checkpoint` section ([Note: checkpoint settings precedence])
CHECKPOINT_REPLICAS = Variable("RAYZERO_CHECKPOINT_REPLICAS", int, "an integer", None,
                               "overrides `checkpoint.replicas`", SETTING, _CKPT, default_text="the config's")
DURABLE_URI = Variable("RAYZERO_DURABLE_URI", lambda text: text.strip() or None, "a URI", None,
                       "overrides `checkpoint.durable_uri`; empty turns the configured copy off", SETTING, _CKPT,
                       default_text="the config's", empty_is_unset=False)
CHECKPOINT_KEEP_LAST = Variable("RAYZERO_CHECKPOINT_KEEP_LAST", int, "an integer", None,
                                "overrides `checkpoint.keep_last`", SETTING, _CKPT, default_text="the config's")
CHECKPOINT_ASYNC_SAVE = Variable("RAYZERO_CHECKPOINT_ASYNC_SAVE", _bool, "true or false", None,
                                 "overrides `checkpoint.async_save`", SETTING, _CKPT, default_text="the config's")
CHECKPOINT_UPLOAD_THREADS = Variable("RAYZERO_CHECKPOINT_UPLOAD_THREADS", int, "an integer", None,
                                     "overrides `checkpoint.upload_threads`", SETTING, _CKPT,
                                     default_text="the config's")
CHECKPOINT_TIMEOUT_S = Variable("RAYZERO_CHECKPOINT_TIMEOUT_S", float, "seconds (a number)", None,
                                "overrides `checkpoint.timeout_s`", SETTING, _CKPT,
                                default_text="the config's (1800)")

# Engine ---------------------------------------------------------------------------------------------
CPU_STEP_THREADS = Variable("RAYZERO_CPU_STEP_THREADS", int, "an integer", None,
                            "threads of one rank's CPU optimizer step under offload", SETTING, _ENGINE,
                            default_text="the cores this process may use / LOCAL_WORLD_SIZE")
OFFLOAD_OVERLAP_STEP = Variable("RAYZERO_OFFLOAD_OVERLAP_STEP", _choice("auto", "1", "0"), "auto, 1 or 0", "auto",
                                "the offloaded CPU optimizer step overlapped with backward: auto (with an "
                                "accelerator), 1 always, 0 never", SETTING, _ENGINE)
STAGE3_STALL_CHECK_S = Variable("RAYZERO_STAGE3_STALL_CHECK_S", float, "seconds (a number)", 10.0,
                                "a stage-3 collective stalled this long is checked for ranks running different "
                                "modules; 0 turns the check off", SETTING, _ENGINE)

# Control service ------------------------------------------------------------------------------------
CONTROL_HOST = Variable("RAYZERO_CONTROL_HOST", str, "an address", None,
                        "address the run's control service binds", SETTING, _CONTROL,
                        default_text="the controller node's address (127.0.0.1 for a local Ray)")
CONTROL_PORT = Variable("RAYZERO_CONTROL_PORT", int, "a port number", None, "port the run's control service binds",
                        SETTING, _CONTROL, default_text="a free port")
CONTROL_TOKEN = Variable("RAYZERO_CONTROL_TOKEN", str, "a token", None,
                         "the run's bearer token: the service takes it instead of making one; clients send it",
                         SETTING, _CONTROL, default_text="a new token, in a local token file")
CONTROL_TOKEN_DIR = Variable("RAYZERO_CONTROL_TOKEN_DIR", str, "a path", None,
                             "private directory of the local token files", SETTING, _CONTROL,
                             default_text="~/.rayzero/control")
CONTROL_TLS_CERT = Variable("RAYZERO_CONTROL_TLS_CERT", str, "a path", None,
                            "PEM certificate the control service serves TLS with (with RAYZERO_CONTROL_TLS_KEY)",
                            SETTING, _CONTROL)
CONTROL_TLS_KEY = Variable("RAYZERO_CONTROL_TLS_KEY", str, "a path", None,
                           "PEM private key of RAYZERO_CONTROL_TLS_CERT", SETTING, _CONTROL)
CONTROL_TLS_CA = Variable("RAYZERO_CONTROL_TLS_CA", str, "a path", None,
                          "PEM CA a client pins (`--ca-file`); the service names it in control.json",
                          SETTING, _CONTROL)

CONTROL_SERVICE_VARIABLES = (CONTROL_HOST, CONTROL_PORT, CONTROL_TOKEN_DIR, CONTROL_TLS_CERT, CONTROL_TLS_KEY,
                             CONTROL_TLS_CA)
"""What the driver forwards to the controller actor, where the control service starts. Not the token:
a runtime env is readable through Ray's state API."""

# Kubernetes operator (read by rayzero_operator) -----------------------------------------------------
OPERATOR_RESYNC_S = Variable("RAYZERO_OPERATOR_RESYNC_S", float, "seconds (a number)", 30.0,
                             "how often the operator reconciles every RayZeroJob again", SETTING, _OPERATOR,
                             deprecated_names=("RAYZERO_OPERATOR_RESYNC_SECONDS",))
OPERATOR_CONTROL_TIMEOUT_S = Variable("RAYZERO_OPERATOR_CONTROL_TIMEOUT_S", float, "seconds (a number)", 5.0,
                                      "bound of one operator call to a run's control service", SETTING, _OPERATOR,
                                      deprecated_names=("RAYZERO_OPERATOR_CONTROL_TIMEOUT_SECONDS",))
OPERATOR_CONTROL_REFRESH_S = Variable("RAYZERO_OPERATOR_CONTROL_REFRESH_S", float, "seconds (a number)", 5.0,
                                      "seconds between two status refreshes of a running job", SETTING, _OPERATOR,
                                      deprecated_names=("RAYZERO_OPERATOR_CONTROL_REFRESH_SECONDS",))
OPERATOR_CHECKPOINT_TIMEOUT_S = Variable("RAYZERO_OPERATOR_CHECKPOINT_TIMEOUT_S", float, "seconds (a number)", 600.0,
                                         "how long a checkpoint-now or stop the operator asks for may take",
                                         SETTING, _OPERATOR,
                                         deprecated_names=("RAYZERO_OPERATOR_CHECKPOINT_TIMEOUT_SECONDS",))
OPERATOR_ALLOWED_HOST_PATHS = Variable("RAYZERO_OPERATOR_ALLOWED_HOST_PATHS", str, "a JSON list of paths", None,
                                       "host directories a RayZeroJob may mount as node-local storage (Helm value "
                                       "allowedHostPaths)", SETTING, _OPERATOR,
                                       default_text="the operator's default list", empty_is_unset=False)
OPERATOR_CRASH_AFTER = Variable("RAYZERO_OPERATOR_CRASH_AFTER", str, "a reconcile step", None,
                                "fault injection for the Kubernetes tests: the operator exits right after this "
                                "step of a reconcile (ConfigMap, RayJob, status)", INTERNAL, _OPERATOR)
