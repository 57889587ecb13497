"""Pure partition math for writing and resharding (see [Note: flat-range partitioning] in types.py).

No process group and no files here: which rank writes which range, what the manifest records, and
which stored pieces assemble a requested range. Unit-tested on their own.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rayzero.checkpoint.collector import collector_paused
from rayzero.checkpoint.manifest import Piece, TensorEntry, shard_file_name
from rayzero.checkpoint.shard_file import dtype_name
from rayzero.checkpoint.types import ShardSpec
from rayzero.config.errors import RayZeroValueError


def choose_writers(specs_by_rank: Sequence[Sequence[ShardSpec]]) -> list[set[str]]:
    """For each rank, the names of the ranges it writes.

    A range held identically by several ranks (a replicated tensor, or stage-0 parameters) is
    written once, by the lowest such rank; every distinct range is written by someone.
    """
    seen: set[tuple[str, int, int]] = set()
    writers: list[set[str]] = []
    for specs in specs_by_rank:
        mine = set()
        for spec in specs:
            key = (spec.name, spec.flat_start, spec.flat_end)
            if key not in seen and spec.flat_end > spec.flat_start:
                seen.add(key)
                mine.add(spec.name)
        writers.append(mine)
    return writers


def build_tensor_entries(specs_by_rank: Sequence[Sequence[ShardSpec]],
                         writers: Sequence[set[str]]) -> dict[str, TensorEntry]:
    """The manifest's tensor table: global shape, dtype and the stored pieces of every tensor.

    Raises ValueError when ranks disagree on a tensor's shape or dtype, or when the written ranges
    leave a hole: such a checkpoint could not be read back, so it must not be committed.
    """
    with collector_paused():  # N ranks' pieces, no cycles ([see rayzero/checkpoint/collector.py])
        return _tensor_entries(specs_by_rank, writers)


def _tensor_entries(specs_by_rank: Sequence[Sequence[ShardSpec]],
                    writers: Sequence[set[str]]) -> dict[str, TensorEntry]:
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    pieces: dict[str, list[Piece]] = {}
    for rank, specs in enumerate(specs_by_rank):
        for spec in specs:
            described = (tuple(spec.global_shape), dtype_name(spec.dtype))
            if shapes.setdefault(spec.name, described) != described:
                raise RayZeroValueError(
                    f"rank {rank} describes state tensor {spec.name!r} as shape/dtype {described}, another "
                    f"rank as {shapes[spec.name]}: every rank must report the same global tensor")
            if spec.name in writers[rank] and spec.flat_end > spec.flat_start:
                pieces.setdefault(spec.name, []).append(Piece(shard_file_name(rank), spec.flat_start, spec.flat_end))
    entries = {}
    for name, (shape, dtype) in shapes.items():
        entry = TensorEntry(shape, dtype, tuple(sorted(pieces.get(name, []), key=lambda piece: piece.start)))
        plan_read(name, entry, 0, entry.numel)  # raises on a hole
        entries[name] = entry
    return entries


@dataclass(frozen=True)
class ReadStep:
    """Copy elements [source_start, source_end) of `piece` to [target_start, ...) of the request."""

    piece: Piece
    source_start: int
    source_end: int
    target_start: int


def plan_read(name: str, entry: TensorEntry, start: int, end: int) -> list[ReadStep]:
    """The stored pieces that assemble elements [start, end) of `name`, in order.

    Pieces may overlap (a range saved by two ranks); at every position the piece reaching
    furthest is taken, so the number of steps is minimal.
    """
    if not 0 <= start <= end <= entry.numel:
        raise RayZeroValueError(f"requested range [{start}, {end}) of {name!r} lies outside its {entry.numel} elements")
    # One sweep over the pieces in start order (a no-op sort for a manifest, which stores them so):
    # the piece reaching furthest among those starting at or before the position is the one the
    # scan over every piece used to find, without rescanning all of them per step, which made a
    # tensor split over N ranks cost O(N^2) to plan (minutes at 4,096 ranks, for every tensor).
    pieces = sorted(entry.pieces, key=lambda piece: piece.start)
    steps: list[ReadStep] = []
    position, next_piece, best = start, 0, None
    while position < end:
        while next_piece < len(pieces) and pieces[next_piece].start <= position:
            if best is None or pieces[next_piece].end > best.end:
                best = pieces[next_piece]
            next_piece += 1
        if best is None or best.end <= position:
            raise RayZeroValueError(f"checkpoint holds no data for elements [{position}, {end}) of {name!r}")
        stop = min(end, best.end)
        steps.append(ReadStep(best, position - best.start, stop - best.start, position - start))
        position = stop
    return steps


def files_for(tensors: dict[str, TensorEntry], specs: Iterable[ShardSpec]) -> set[str]:
    """The shard files a rank must read to serve `specs` (names absent from the checkpoint are skipped;
    the caller decides whether that is an error)."""
    needed = set()
    for spec in specs:
        entry = tensors.get(spec.name)
        if entry is not None:
            needed.update(step.piece.file for step in plan_read(spec.name, entry, spec.flat_start, spec.flat_end))
    return needed
