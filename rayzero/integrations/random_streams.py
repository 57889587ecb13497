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

Two places where the streams are not DDP's, on purpose:
- A rayzero checkpoint holds each rank's random state, and `engine.load_checkpoint` restores it, so
  a restarted rayzero run goes on drawing as if it had never stopped (DeepSpeed's checkpoints hold
  none). RayZeroStrategy restores it only on such a restart; `trainer.fit(ckpt_path=...)` keeps the
  streams where they are, as Lightning under DDP does (it restores no random state on resume).
  HF's Trainer and Accelerate restore their own saved states after the engine's load.
- A Hugging Face model that transformers builds under ZeRO-3 (`from_config` / `from_pretrained`
  once a stage-3 DeepSpeed config is set) is constructed drawing nothing and initialised on rank 0
  only (transformers' `initialize_weights_zero3`), so after the build the streams are neither a
  plain build's nor equal across ranks. That is transformers' path, and DeepSpeed 0.19.8 leaves
  the streams and the initial weights exactly where rayzero does (tested against it, rank by
  rank). HF's Trainer seeds again when it is made, so its training draws as under DDP.
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
