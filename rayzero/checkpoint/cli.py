"""`rayzero checkpoint ls|verify|consolidate`: inspect and convert checkpoints with no cluster.

Each takes a save directory (its newest committed checkpoint, via `latest`), one tag directory, or
a run directory (`<storage>/<name>`, what `rayzero.fit` reports as `Result.path`, file:// or a plain
path: its `checkpoints/` is used); `ls` lists every checkpoint of a save directory.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from rayzero.checkpoint.manifest import committed_tags, read_latest, read_manifest, resolve_tag_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ls = commands.add_parser("ls", help="list the checkpoints of a save directory")
    ls.add_argument("path", help="save directory (or one tag directory)")
    verify = commands.add_parser("verify", help="check every file's size and checksum; exit 1 on any problem")
    verify.add_argument("path", help="save directory (newest committed checkpoint) or tag directory")
    verify.add_argument("--all", action="store_true", help="verify every committed checkpoint of the save directory")
    consolidate = commands.add_parser("consolidate", help="write one full state dict keyed by module names")
    consolidate.add_argument("checkpoint", help="save directory (newest committed checkpoint) or tag directory")
    consolidate.add_argument("output", help="output file")
    consolidate.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"],
                             help="cast every tensor (default: keep the stored dtype; fp32 masters where saved)")
    consolidate.add_argument("--format", default="safetensors", choices=["safetensors", "torch"],
                             help="safetensors, or torch (a plain dict for torch.load(weights_only=True))")
    return parser


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
    return str(size)


def _ls(path: str) -> int:
    if os.path.isfile(os.path.join(path, "manifest.json")):
        path, only = os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    else:
        only = None
    latest = read_latest(path)
    rows = [tag for _, tag in committed_tags(path) if only in (None, tag)]
    if not rows:
        print(f"no committed checkpoint under {path}", file=sys.stderr)
        return 1
    print(f"{'tag':<24} {'step':>8} {'world':>5} {'stage':>5} {'size':>11} {'files':>9}  created")
    for tag in rows:
        manifest = read_manifest(os.path.join(path, tag))
        present = sum(os.path.isfile(os.path.join(path, tag, name)) for name in manifest.files)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest.created_unix))
        marker = "  <- latest" if tag == latest else ""
        print(f"{tag:<24} {manifest.step:>8} {manifest.world_size:>5} {manifest.stage:>5} "
              f"{_human(manifest.total_bytes):>11} {present:>4}/{len(manifest.files):<4}  {created}{marker}")
    return 0


def _verify_one(tag_dir: str) -> int:
    from rayzero.checkpoint.shard_file import file_checksum

    manifest = read_manifest(tag_dir)
    if manifest is None:
        print(f"{tag_dir}: no readable manifest.json: not a committed checkpoint", file=sys.stderr)
        return 1
    problems = 0
    for name, entry in sorted(manifest.files.items()):
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path):
            status = "MISSING"
        elif os.path.getsize(path) != entry.size:
            status = f"SIZE MISMATCH ({os.path.getsize(path)} bytes, manifest says {entry.size})"
        elif file_checksum(path) != entry.checksum:
            status = "CHECKSUM MISMATCH"
        else:
            status = "ok"
        problems += status != "ok"
        print(f"{os.path.join(os.path.basename(tag_dir), name)}: {status}")
    verdict = "OK" if not problems else f"{problems} problem(s)"
    print(f"{tag_dir}: {len(manifest.files)} file(s), {verdict}")
    return 1 if problems else 0


def _verify(path: str, every: bool) -> int:
    if every and not os.path.isfile(os.path.join(path, "manifest.json")):
        tags = committed_tags(path)
        if not tags:
            print(f"no committed checkpoint under {path}", file=sys.stderr)
            return 1
        return max(_verify_one(os.path.join(path, tag)) for _, tag in tags)
    return _verify_one(resolve_tag_dir(path))


def save_dir(location: str) -> str:
    """The local save or tag directory `location` names (a run directory means its checkpoints/)."""
    from urllib.parse import unquote, urlparse

    if location.startswith("file://"):
        location = unquote(urlparse(location).path)
    elif "://" in location:
        raise ValueError(f"{location}: only local paths and file:// URIs are read here; copy the "
                         "checkpoint to local disk first (e.g. `aws s3 sync`)")
    marked = any(os.path.exists(os.path.join(location, marker)) for marker in ("manifest.json", "latest"))
    run_checkpoints = os.path.join(location, "checkpoints")
    if not marked and os.path.isdir(run_checkpoints):
        return run_checkpoints
    return location


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for attribute in ("path", "checkpoint"):
            if hasattr(args, attribute):
                setattr(args, attribute, save_dir(getattr(args, attribute)))
        if args.command == "ls":
            return _ls(args.path)
        if args.command == "verify":
            return _verify(args.path, args.all)
        import torch

        from rayzero.checkpoint.consolidate import consolidate

        dtype = getattr(torch, args.dtype) if args.dtype else None
        count = consolidate(args.checkpoint, args.output, dtype, args.format)
        print(f"wrote {count} tensors to {args.output} ({args.format})")
        return 0
    except (FileNotFoundError, ValueError) as error:
        print(f"rayzero checkpoint {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
