"""The `rayzero` command line.

Each sub-command lives in the module of its layer and exposes `main(argv) -> int`; it is imported
only when chosen, so `rayzero config validate` never pays for importing torch or ray.
"""
from __future__ import annotations

import importlib
import os
import sys

# sub-command -> (module exposing `main(argv) -> int`, or "module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("rayzero.config.cli", "validate a DeepSpeed config, export its JSON schema or docs"),
    "run": ("rayzero.cli:run_main", "run a training script or loop on Ray: rayzero run train.py --workers 2 -- ARGS"),
    "demo": ("rayzero.driver.demo", "train the built-in character language model (the main job)"),
    "checkpoint": ("rayzero.checkpoint.cli", "list, verify, consolidate or import checkpoints; `now` on a live run"),
    "status": ("rayzero.control_api.cli:status_main", "live runs' status: rayzero status [NAME] [--json] [--watch]"),
    "stop": ("rayzero.control_api.cli:stop_main", "planned stop of a live run: checkpoint, then end it"),
    "scale": ("rayzero.control_api.cli:scale_main", "resize a live run: rayzero scale NAME WORKERS"),
    "kill": ("rayzero.control_api.cli:kill_main", "end a live run now, without a checkpoint"),
    "estimate": ("rayzero.engine.estimate", "memory per device / host / NVMe for every stage and offload option"),
    "plot": ("rayzero.plot", "draw a run's loss, throughput, lr and memory: rayzero plot RUN -o run.png"),
}
# `rayzero checkpoint now NAME` talks to a live run; the other `checkpoint` commands read files.
CHECKPOINT_NOW = "rayzero.control_api.cli:checkpoint_now_main"


def run_main(argv: list[str]) -> int:
    """`rayzero run`: the driver's command, with script targets as `rayzero.Script` so a script's trainer
    flags (`--deepspeed ds.json`) are checked before anything starts. Wired here, above the layers: the
    driver may not import the integrations (import-linter: "integrations sit on top")."""
    from rayzero.driver import cli as run_cli
    from rayzero.integrations.script_args import Script

    return run_cli.main(argv, script_type=Script)


def _usage() -> str:
    lines = ["usage: rayzero COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "`rayzero COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from rayzero import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"rayzero: unknown command {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    target = SUBCOMMANDS[name][0]
    if name == "checkpoint" and rest[:1] == ["now"]:
        target, rest = CHECKPOINT_NOW, rest[1:]
    module_name, _, function = target.partition(":")
    try:
        return int(getattr(importlib.import_module(module_name), function or "main")(rest) or 0)
    except BrokenPipeError:
        # `rayzero status | head`: the reader went away. Python's advice: point stdout at devnull so
        # the interpreter's final flush does not raise again, and end quietly as `head` expects.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
