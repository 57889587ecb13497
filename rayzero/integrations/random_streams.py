"""The program's random streams left where they were around what rayzero builds only to look at.

[Note: the user's random streams]
A training program seeds torch's, numpy's and Python's global generators and then draws from them
in its own order: initial weights, its dataset, shuffling, dropout. Under rayzero it must draw the
same numbers as the same program under DDP, so rayzero's setup may not move those streams. Where
rayzero itself needs something built that draws (a Lightning module's train dataloader, built once
more for its batch size; a model skeleton whose random initial values a checkpoint replaces),
`streams_kept()` puts every generator back as it was. A private `torch.Generator` is the fix where
rayzero makes the draw itself; this is for calls into the user's or a library's code that draw
from the global generators. tests/dist/test_random_streams.py and test_lightning_strategy.py
compare the streams with DDP's.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rayzero.checkpoint.rng import capture, restore


@contextmanager
def streams_kept() -> Iterator[None]:
    """torch's CPU and (current device, when initialised) CUDA generators and numpy's and Python's
    global ones are, on exit, as they were on entry, whatever the block drew."""
    state = capture()
    try:
        yield
    finally:
        restore([state], rank=0)
