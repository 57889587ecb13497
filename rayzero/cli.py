"""The `rayzero` command line.

Each sub-command lives in the module of its layer and exposes `main(argv) -> int`; it is imported
only when chosen, so `rayzero config validate` never pays for importing torch or ray.
"""
from __future__ import annotations

import importlib
import sys

# sub-command -> (module exposing `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("rayzero.config.cli", "validate a DeepSpeed config, export its JSON schema or docs"),
    "run": ("rayzero.driver.cli", "run a training loop on Ray: rayzero run file.py:fn --config ds.json"),
    "demo": ("rayzero.driver.demo", "train the built-in character language model (the main job)"),
    "checkpoint": ("rayzero.checkpoint.cli", "list, verify, consolidate or import checkpoints"),
    "plot": ("rayzero.plot", "draw a run's loss, throughput, lr and memory: rayzero plot RUN -o run.png"),
}


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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
