"""Generate the Python stubs of `rayzero/control_api/v1/control.proto` (checked in, like docs/config.md).

    python -m rayzero.control_api.generate --write   # after editing the proto
    python -m rayzero.control_api.generate --check   # exit 1 when the checked-in stubs are stale

Needs grpcio-tools (the `dev` extra pins the version the checked-in stubs were made with: the
generated code embeds it, so another version shows as stale).
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding `rayzero/`
PROTO = Path("rayzero/control_api/v1/control.proto")
GENERATED = ("control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the proto into `out_dir` (mirroring the package path); returns the files."""
    from grpc_tools import protoc  # dev-only dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    code = protoc.main([
        "grpc_tools.protoc", f"-I{PACKAGE_ROOT}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO),
    ])
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
    return [out_dir / PROTO.parent / name for name in GENERATED]


def stale(root: Path = PACKAGE_ROOT) -> list[str]:
    """Names of the checked-in stubs that differ from freshly generated ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [path.name for path in fresh
                if not (root / PROTO.parent / path.name).is_file()
                or not filecmp.cmp(path, root / PROTO.parent / path.name, shallow=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayzero.control_api.generate", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in stubs")
    mode.add_argument("--check", action="store_true", help="exit 1 when the checked-in stubs are stale")
    args = parser.parse_args(argv)
    if args.write:
        for path in generate(PACKAGE_ROOT):
            print(f"wrote {path.relative_to(PACKAGE_ROOT)}")
        return 0
    different = stale()
    if different:
        print(f"stale: {', '.join(different)} differ from {PROTO}; run `python -m rayzero.control_api.generate --write`",
              file=sys.stderr)
        return 1
    print(f"{PROTO} stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
