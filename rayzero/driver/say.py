"""The driver's own lines on stdout, each written whole.

`print(text)` writes the text and the newline as two writes; Ray's log thread prints the workers'
lines into the same stdout in between, which glued a worker's `[rank 0] ...` to the end of a
progress line. One write per line keeps every line whole.
"""
from __future__ import annotations

import sys


def say(text: str) -> None:
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()
