"""`rayzero checkpoint ls|verify|consolidate|import-deepspeed`: inspect and convert checkpoints, no cluster.

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
from rayzero.config.errors import RayZeroError


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
    consolidate.add_argument("output", nargs="?", default=None, help="output file (not with --hf)")
    consolidate.add_argument("--hf", metavar="OUT_DIR", default=None,
                             help="write a Hugging Face model directory (config.json + safetensors, sharded with "
                                  "an index past --max-shard-size) that from_pretrained loads")
    consolidate.add_argument("--hf-config", default=None,
                             help="config.json (or a directory holding it) when the checkpoint records none")
    consolidate.add_argument("--max-shard-size", default="5GB",
                             help="largest weights file with --hf, e.g. 5GB, 500MB (default 5GB, as save_pretrained)")
    consolidate.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"],
                             help="cast every tensor (default: keep the stored dtype; fp32 masters where saved)")
    consolidate.add_argument("--format", default="safetensors", choices=["safetensors", "torch"],
                             help="safetensors, or torch (a plain dict for torch.load(weights_only=True))")
    imported = commands.add_parser(
        "import-deepspeed", help="convert a DeepSpeed ZeRO 1-3 checkpoint (weights, optimizer, scheduler, step)")
    imported.add_argument("deepspeed_checkpoint", help="DeepSpeed save dir (with `latest`) or a global_stepN dir")
    imported.add_argument("output", help="rayzero save dir to write (engine.load_checkpoint(OUT) resumes from it)")
    imported.add_argument("--tag", default=None, help="the DeepSpeed tag to convert (default: `latest`)")
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


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / a byte count -> bytes (save_pretrained's max_shard_size forms)."""
    upper = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if upper.endswith(unit):
            number = upper.removesuffix(unit).strip()
            break
    else:
        unit, number = "B", upper
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"--max-shard-size {text!r}: give a size like 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise ValueError(f"--max-shard-size {text!r}: must be positive")
    return int(value)


def _consolidate_hf(args: argparse.Namespace, dtype: object) -> int:
    import json

    from rayzero.checkpoint.consolidate import consolidate_hf

    hf_config = None
    if args.hf_config:
        path = os.path.join(args.hf_config, "config.json") if os.path.isdir(args.hf_config) else args.hf_config
        with open(path) as handle:
            hf_config = json.load(handle)
    written = consolidate_hf(args.checkpoint, args.hf, dtype, parse_size(args.max_shard_size), hf_config)
    print(f"wrote {', '.join(written)} to {args.hf} (load with from_pretrained({args.hf!r}))")
    return 0


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
        if args.command == "import-deepspeed":
            from rayzero.checkpoint.deepspeed_import import import_deepspeed

            written = import_deepspeed(args.deepspeed_checkpoint, args.output, args.tag)
            print(f"wrote {written}; resume with engine.load_checkpoint({args.output!r}) at any world size and stage")
            return 0
        import torch

        from rayzero.checkpoint.consolidate import consolidate

        dtype = getattr(torch, args.dtype) if args.dtype else None
        if args.hf is not None:
            return _consolidate_hf(args, dtype)
        if args.output is None:
            raise ValueError("give an output file, or --hf OUT_DIR for a Hugging Face model directory")
        count = consolidate(args.checkpoint, args.output, dtype, args.format)
        print(f"wrote {count} tensors to {args.output} ({args.format})")
        return 0
    except (RayZeroError, OSError, ValueError) as error:  # a checkpoint that cannot be read says why, no traceback
        print(f"rayzero checkpoint {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
