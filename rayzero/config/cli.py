"""`rayzero config validate|schema|docs`.

    rayzero config validate FILE [--world-size N] [--hidden-size H] [--trainer KEY=VALUE ...] [--allow-auto]
        prints the normalised config (stdout) and every warning/resolution (stderr); exit 0,
        or every problem (stderr), including what this build cannot run (rayzero.config.runnable); exit 2.
    rayzero config schema [--output FILE]     JSON schema of the DeepSpeed config
    rayzero config docs [--write P | --check P]  the reference (docs/config.md)
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

EXIT_INVALID = 2


def _trainer_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r} (e.g. learning_rate=3e-5)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero config", description="DeepSpeed-compatible config tools")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check a DeepSpeed JSON config and print it normalised")
    validate.add_argument("file", help="path to the DeepSpeed JSON config")
    validate.add_argument("--world-size", type=int, help="number of ranks (derives/checks batch keys)")
    validate.add_argument("--hidden-size", type=int, help="model hidden size (resolves \"auto\" bucket sizes)")
    validate.add_argument("--trainer", type=_trainer_arg, action="append", default=[], metavar="KEY=VALUE",
                          help="a trainer argument for \"auto\" values, HF names (repeatable), "
                               "e.g. --trainer learning_rate=3e-5 --trainer fp16=true")
    validate.add_argument("--allow-auto", action="store_true",
                          help="keep \"auto\" values nothing resolves (warn) instead of failing")
    schema = sub.add_parser("schema", help="print the JSON schema")
    schema.add_argument("--output", help="write to this file instead of stdout")
    docs = sub.add_parser("docs", help="print or write the configuration reference")
    group = docs.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH")
    group.add_argument("--check", metavar="PATH")
    return parser


def _validate(args: argparse.Namespace) -> int:
    from rayzero.config.errors import ConfigError
    from rayzero.config.loader import load_config
    from rayzero.config.runnable import check_runnable
    from rayzero.config.trainer import with_trainer_semantics

    # This command prints every note itself (below), once: the loader's own log lines would repeat
    # the warnings among them.
    config_logger = logging.getLogger("rayzero.config")
    previous_level = config_logger.level
    config_logger.setLevel(logging.ERROR)
    try:
        source, trainer = args.file, dict(args.trainer) if args.trainer else None
        if trainer:  # as `rayzero run --trainer` sees it: HF's defaults for every value not given
            source, trainer = with_trainer_semantics(args.file, trainer)
        config = load_config(source, world_size=args.world_size, hidden_size=args.hidden_size,
                             trainer=trainer, allow_unresolved=args.allow_auto)
        # --allow-auto keeps "auto" on purpose (a trainer fills it later): only the rest is checked.
        check_runnable(config, args.file, trainer_present=args.allow_auto)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        config_logger.setLevel(previous_level)
    print(json.dumps(config.to_deepspeed_dict(), indent=2))
    for note in config.notes:
        print(note, file=sys.stderr)
    print(f"valid: {args.file} ({len(config.notes)} note(s))", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "validate":
        return _validate(args)
    if args.command == "schema":
        from rayzero.config.model import RayZeroConfig

        text = json.dumps(RayZeroConfig.model_json_schema(by_alias=True), indent=2) + "\n"
        if args.output:
            with open(args.output, "w") as handle:
                handle.write(text)
        else:
            sys.stdout.write(text)
        return 0
    from rayzero.config.docs import main as docs_main

    forwarded = ["--write", args.write] if args.write else ["--check", args.check] if args.check else []
    return docs_main(forwarded)


if __name__ == "__main__":
    sys.exit(main())
