"""`rayzero status|stop|scale|kill` and `rayzero checkpoint now`: talk to a live run.

A run is named as `rayzero run --name` / RunConfig.name named it, under the same storage (`--storage`,
default `$RAYZERO_STORAGE_ROOT`, else ./runs); its control.json gives the address and TLS details. The
token is never there: `--token-file`, $RAYZERO_CONTROL_TOKEN, or, on the controller's node, the run's
local token file. From a machine that cannot read the storage, pass `--address HOST:PORT` instead of NAME.
Exit codes: 0 done, 1 the run refused or could not be reached, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from rayzero.config.errors import RayZeroError


def _command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A control command's parser with the run it acts on, defined once for every command: NAME (or
    --address) and how to reach and trust its control service."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("name", nargs="?", help="run name (as given to rayzero run --name / RunConfig.name)")
    parser.add_argument("--storage", default=None,
                        help="root URI of the runs, as given to the run (default $RAYZERO_STORAGE_ROOT, else ./runs)")
    parser.add_argument("--address", default=None, help="HOST:PORT of the run's control service, instead of NAME")
    parser.add_argument("--token-file", default=None,
                        help="file holding the run's token (default: $RAYZERO_CONTROL_TOKEN, else the run's local "
                             "token file on the controller's node)")
    parser.add_argument("--tls", action="store_true", help="the service at --address speaks TLS")
    parser.add_argument("--ca-file", default=None,
                        help="the run's PEM CA certificate, pinned (default $RAYZERO_CONTROL_TLS_CA)")
    parser.add_argument("--server-name", default=None,
                        help="with --address: the name the service's certificate carries (control.json's "
                             "server_name)")
    return parser


def _client(args: argparse.Namespace, prog: str):

    from rayzero.config.environment import CONTROL_TOKEN
    from rayzero.control_api.client import connect

    if args.address:
        if args.name:
            raise _Usage(f"{prog}: give NAME or --address, not both")
        if not args.token_file and not CONTROL_TOKEN.get():
            raise _Usage(f"{prog}: --address needs --token-file FILE (the run's token) or {CONTROL_TOKEN.name}")
        return connect(address=args.address, token_file=args.token_file, ca_file=args.ca_file, tls=args.tls,
                       server_name=args.server_name)
    if not args.name:
        raise _Usage(f"{prog}: give the run NAME (or --address HOST:PORT --token-file FILE)")
    return connect(args.name, storage=args.storage, token_file=args.token_file, ca_file=args.ca_file)


class _Usage(Exception):
    """Bad arguments: exit 2 with the message."""


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def _ago(moment: float, now: float) -> str:
    return f"{max(0.0, now - moment):.1f}s ago" if moment else "never"


def _optional(status: Any, field: str, text: str) -> str:
    return text.format(getattr(status, field)) if status.HasField(field) else "-"


def goodput_text(status: Any) -> str:
    """`93.2% of 1h02m (start-up 4.1%, restart 1.2%, ...)`: kept training time over wall time."""
    if not status.HasField("goodput") or not status.wall_s:
        return "-"
    wall = status.wall_s
    causes = sorted(((cause, seconds) for cause, seconds in status.badput_s.items() if seconds > 0), key=lambda c: -c[1])
    minutes, seconds = divmod(int(wall), 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{100 * status.goodput:.1f}% of {hours}h{minutes:02d}m{seconds:02d}s" if hours else \
        f"{100 * status.goodput:.1f}% of {minutes}m{seconds:02d}s"
    return text + (" (" + ", ".join(f"{cause} {100 * value / wall:.1f}%" for cause, value in causes) + ")"
                   if causes else "")


def status_line(status: Any) -> str:
    """One line: what `--watch` prints per update."""
    return (f"{time.strftime('%H:%M:%S')} {status.state:<12} attempt {status.attempt} "
            f"workers {status.world_size} step {status.step} loss {_optional(status, 'loss', '{:.4f}')} "
            f"samples/s {_optional(status, 'samples_per_s', '{:.1f}')} failures {status.failures}/{status.max_failures} "
            f"goodput {_optional(status, 'goodput', '{:.1%}')}"
            + (f"  {status.message}" if status.message else ""))


def status_table(status: Any) -> str:
    """The compact table of `rayzero status NAME`."""
    now = time.time()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.started_at)) if status.started_at else "?"
    budget = "unlimited" if status.max_failures < 0 else str(status.max_failures)
    lines = [
        f"run        {status.run_name}   state {status.state}   attempt {status.attempt}   started {started}",
        f"workers    {status.world_size} (elastic range {status.min_workers}-{status.max_workers})   "
        f"failures {status.failures} of {budget}",
        f"progress   step {status.step}   loss {_optional(status, 'loss', '{:.4f}')}   "
        f"samples/s {_optional(status, 'samples_per_s', '{:.1f}')}   "
        f"tokens/s {_optional(status, 'tokens_per_s', '{:.0f}')}   last report {_ago(status.last_report_time, now)}",
        f"goodput    {goodput_text(status)}",
    ]
    if "checkpoint_interval_s" in status.extra:  # [Note: a checkpoint interval from the numbers]
        lines.append(f"interval   a checkpoint every {status.extra['checkpoint_interval_s']} s"
                     + (f"   {status.extra['checkpoint_interval_inputs']}" if "checkpoint_interval_inputs" in status.extra
                        else ""))
    if status.checkpoints:
        for index, checkpoint in enumerate(status.checkpoints):
            label = "checkpoint" if index == 0 else ""
            lines.append(f"{label:<10} {checkpoint.tier:<10} step {checkpoint.step:<8} {checkpoint.location}")
    else:
        lines.append("checkpoint none committed yet")
    if status.message:
        lines.append(f"message    {status.message}")
    if status.ranks:
        lines.append("")
        lines.append(f"{'rank':>4}  {'node':<14} {'heartbeat':>9} {'step':>8} {'micro':>8} {'peak mem':>10} {'host mem':>10}")
        for rank in status.ranks:
            lines.append(f"{rank.rank:>4}  {rank.node_id[:14]:<14} {rank.heartbeat_age_s:>8.1f}s {rank.step:>8} "
                         f"{rank.micro_step:>8} {_human_bytes(rank.memory_bytes):>10} "
                         f"{_human_bytes(rank.host_memory_bytes):>10}")
    for key, value in sorted(status.extra.items()):
        lines.append(f"{key:<10} {value}")
    return "\n".join(lines)


def _status(argv: list[str]) -> int:
    parser = _command_parser("rayzero status", "Show a live run's status.")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per line with --watch)")
    parser.add_argument("--watch", action="store_true", help="keep printing updates until the run ends")
    parser.add_argument("--interval", type=float, default=0.0,
                        help="with --watch: most seconds between updates (default 0.5, at most 1)")
    args = parser.parse_args(argv)
    from rayzero.control_api.client import status_dict

    if not args.name and not args.address:
        return _list_live_runs(args)
    with _client(args, parser.prog) as client:
        if not args.watch:
            status = client.status()
            print(json.dumps(status_dict(status), indent=2) if args.json else status_table(status))
            return 0
        for status in client.watch(args.interval):
            print(json.dumps(status_dict(status)) if args.json else status_line(status), flush=True)
    return 0


def _list_live_runs(args: argparse.Namespace) -> int:
    """`rayzero status` with no NAME: one line per live run under the storage root."""
    from rayzero.control_api.client import connect, status_dict
    from rayzero.control_api.discovery import live_runs, storage_root

    names = live_runs(args.storage)  # each found by name: its token comes from this node or the environment
    if not names:
        print(f"no live run under {storage_root(args.storage)} (none has a control.json); pass --storage "
              "as given to the runs", file=sys.stderr)
        return 1
    rows = {}
    for name in names:
        try:
            with connect(name, storage=args.storage, ca_file=args.ca_file, timeout_s=3) as client:
                rows[name] = client.status()
        except RayZeroError as error:
            rows[name] = error
    if args.json:
        print(json.dumps({name: status_dict(row) if not isinstance(row, Exception) else {"error": str(row)}
                          for name, row in rows.items()}, indent=2))
        return 0
    for name, row in rows.items():
        print(f"{name:<24} " + (status_line(row) if not isinstance(row, Exception) else f"unreachable: {row}"))
    return 0


def _checkpoint_text(checkpoint: Any) -> str:
    return f"step {checkpoint.step} ({checkpoint.tier}) at {checkpoint.location}"


def _on_the_run(parser: argparse.ArgumentParser, argv: list[str],
                operation: Callable[[Any, argparse.Namespace], Any]) -> tuple[argparse.Namespace, Any]:
    """Parse a control command's arguments, reach its run, and return (arguments, what `operation`
    returned from the run's client)."""
    args = parser.parse_args(argv)
    with _client(args, parser.prog) as client:
        return args, operation(client, args)


def _timeout(parser: argparse.ArgumentParser, waited_for: str) -> argparse.ArgumentParser:
    parser.add_argument("--timeout", type=float, default=600.0,
                        help=f"seconds to wait for {waited_for} (default 600)")
    return parser


def _checkpoint_now(argv: list[str]) -> int:
    parser = _timeout(_command_parser("rayzero checkpoint now", "Checkpoint a live run at the next step every "
                                      "rank reaches; returns once it is committed."), "the commit")
    parser.add_argument("--json", action="store_true", help="print the checkpoint as JSON")
    started = time.monotonic()
    args, checkpoint = _on_the_run(parser, argv, lambda client, args: client.checkpoint_now(args.timeout))
    if args.json:
        print(json.dumps({"tier": checkpoint.tier, "location": checkpoint.location, "step": checkpoint.step,
                          "time": checkpoint.time, "seconds": time.monotonic() - started}))
    else:
        print(f"committed checkpoint {_checkpoint_text(checkpoint)} in {time.monotonic() - started:.1f}s")
    return 0


def _stop(argv: list[str]) -> int:
    parser = _timeout(_command_parser(
        "rayzero stop", "Planned stop: checkpoint at the next common step, then end the run."), "the final checkpoint")
    _, checkpoint = _on_the_run(parser, argv, lambda client, args: client.stop(args.timeout))
    print("stopped; the run ended before a final checkpoint could be taken" if checkpoint is None else
          f"stopped after checkpoint {_checkpoint_text(checkpoint)}")
    return 0


def _workers_wanted(text: str) -> int:
    try:
        workers = int(text)
    except ValueError:
        workers = 0
    if workers < 1:
        raise argparse.ArgumentTypeError(f"workers must be an integer >= 1, got {text!r}")
    return workers


def _scale(argv: list[str]) -> int:
    parser = _command_parser(
        "rayzero scale", "Resize a live run (checkpoint, regroup, resume) within its elastic range.")
    parser.add_argument("workers", type=_workers_wanted, help="workers (ranks) wanted")
    args, _ = _on_the_run(parser, argv, lambda client, args: client.scale(args.workers))
    print(f"scaling {args.name or args.address} to {args.workers} worker(s)")
    return 0


def _kill(argv: list[str]) -> int:
    parser = _command_parser("rayzero kill", "End a live run now, without a checkpoint.")
    parser.add_argument("--reason", default="killed with `rayzero kill`", help="why, for the run's log")
    _on_the_run(parser, argv, lambda client, args: client.kill(args.reason))
    print("killed")
    return 0


def _guarded(command: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return command(argv)
    except _Usage as error:
        print(error, file=sys.stderr)
        return 2
    except RayZeroError as error:
        print(f"rayzero: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) and getattr(error, "code", None) is None else 1
    except KeyboardInterrupt:
        return 130


def status_main(argv: list[str]) -> int:
    return _guarded(_status, argv)


def checkpoint_now_main(argv: list[str]) -> int:
    return _guarded(_checkpoint_now, argv)


def stop_main(argv: list[str]) -> int:
    return _guarded(_stop, argv)


def scale_main(argv: list[str]) -> int:
    return _guarded(_scale, argv)


def kill_main(argv: list[str]) -> int:
    return _guarded(_kill, argv)
