"""Every entry of the long tier ([Note: the long tier]) names a test file that exists and, where it
names a test, a test function of that file: a renamed test cannot drop out of the list unseen (it
would then run in `make test` again, and its time with it), and a deleted one cannot stay listed."""
from __future__ import annotations

import ast
import pathlib

from tests.long_tier import LONG

REPO = pathlib.Path(__file__).resolve().parents[2]


def _test_names(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def test_every_long_entry_names_an_existing_file_and_test_and_says_what_covers_it() -> None:
    for prefix, covered_by in LONG.items():
        file, _, test = prefix.partition("::")
        path = REPO / file
        assert path.is_file(), f"{prefix}: no such file"
        if test:
            name = test.split("[")[0]
            assert any(found.startswith(name) for found in _test_names(path)), f"{prefix}: no such test in {file}"
        assert covered_by.strip(), f"{prefix}: say which test in make test covers its capability"
