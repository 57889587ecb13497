"""One shard file: the safetensors layout, written streaming and checksummed in the same pass.

We write the safetensors format ourselves (8-byte little-endian header length, JSON header, raw
bytes) instead of calling `safetensors.torch.save_file`, for two reasons: the file is written tensor
by tensor straight from each tensor's memory (no second in-memory copy of the whole shard), and
the xxh3-128 checksum is computed over exactly the bytes written, in the same pass. The result is
a standard safetensors file: `safetensors.safe_open` reads it, and loading it never runs code.

Why xxh3-128 (the `xxhash` package): it runs at ~24 GB/s on one core here, far above disk
bandwidth, so checksumming costs nothing visible; blake2b (~0.8 GB/s) or crc32 (~3.5 GB/s) would
cap or eat into the save bandwidth. The checksum guards against torn writes and bit rot, not an
adversary, which a non-cryptographic 128-bit hash does well.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import xxhash

from rayzero.checkpoint.direct_io import BLOCK, DirectWriter, read_file, stream_file
from rayzero.checkpoint.types import LazyPiece
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError

# safetensors dtype codes <-> torch dtypes
_TO_CODE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_FROM_CODE = {code: dtype for dtype, code in _TO_CODE.items()}
_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned
_CHUNK = 64 << 20  # bytes per write/read call: large enough for full disk bandwidth
_ALIGN_AT_BYTES = 1 << 20  # tensors this large start on a block boundary in shard files
PAD_PREFIX = "__pad__/"  # padding tensors (zeros); never part of the checkpoint's state


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`: the manifest's spelling."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RayZeroValueError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


@dataclass(frozen=True)
class WrittenFile:
    """What the manifest records about one file."""

    name: str
    size: int
    checksum: str


class SafetensorsWriter:
    """Streams a safetensors file whose tensor names, dtypes and shapes are known up front.

    The header is written first, then each tensor in the declared order, so at most one tensor
    needs to be in memory (what `consolidate` relies on). Bytes go to `path + ".tmp"`, which
    `close()` fsyncs and renames into place: a reader sees nothing or the whole file.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], fsync: bool = True,
                 align_large: bool = False) -> None:
        self.path, self.fsync = path, fsync
        header: dict[str, object] = {}
        self.order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            numel = 1
            for dim in shape:
                numel *= dim
            size = numel * dtype.itemsize
            gap = -offset % BLOCK
            if align_large and size >= _ALIGN_AT_BYTES and gap:
                # [Note: direct I/O]: a padding tensor puts this one on a block boundary of the file,
                # so it can be written straight from (page-aligned) memory with no copy.
                pad = f"{PAD_PREFIX}{len(self.order)}"
                header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
                self.order.append((pad, gap))
                offset += gap
            header[name] = {"dtype": _TO_CODE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.order.append((name, size))
            offset += size
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        any_large = align_large and any(size >= _ALIGN_AT_BYTES for _, size in self.order)
        header_bytes += b" " * (-(8 + len(header_bytes)) % (BLOCK if any_large else _ALIGN))
        self.size = 8 + len(header_bytes) + offset
        self.digest = xxhash.xxh3_128()
        self.out = DirectWriter(path + ".tmp", fsync)  # [Note: direct I/O]
        self._emit(memoryview(struct.pack("<Q", len(header_bytes)) + header_bytes))

    def _emit(self, data: memoryview, address: int | None = None) -> None:
        for start in range(0, len(data), _CHUNK):
            chunk = data[start:start + _CHUNK]
            self.digest.update(chunk)
            self.out.write(chunk, None if address is None else address + start)

    def write(self, name: str, tensor: torch.Tensor, keep: bool = True) -> None:
        """`keep`: the caller keeps `tensor` unchanged until close() (then aligned bulk is written
        from it with no copy); False copies it through the staging buffers."""
        while self.order and self.order[0][0].startswith(PAD_PREFIX):
            self._emit(memoryview(bytes(self.order.pop(0)[1])))
        expected_name, expected_size = self.order.pop(0)
        tensor = tensor.detach().contiguous()
        data = tensor_bytes(tensor)
        if name != expected_name or len(data) != expected_size:
            raise RayZeroValueError(f"safetensors writer: got {name!r} ({len(data)} bytes), expected "
                             f"{expected_name!r} ({expected_size} bytes)")
        self._emit(data, tensor.data_ptr() if tensor.numel() and keep else None)

    def abort(self) -> None:
        """Give up: the temporary file is removed, the target never appears."""
        self.out.abort()

    def close(self) -> WrittenFile:
        if self.order:
            raise RayZeroValueError(f"safetensors writer closed before {self.order[0][0]!r} was written")
        self.out.close()
        os.replace(self.path + ".tmp", self.path)
        return WrittenFile(os.path.basename(self.path), self.size, self.digest.hexdigest())


def write_shard_file(path: str, tensors: Iterable[tuple[str, torch.Tensor]], fsync: bool = True) -> WrittenFile:
    """Write 1-D pieces (CPU tensors, or LazyPieces read one at a time) as a safetensors shard
    file at `path`, atomically."""
    items = [(name, tensor if isinstance(tensor, LazyPiece) else tensor.detach().reshape(-1))
             for name, tensor in tensors]
    for name, tensor in items:
        if not isinstance(tensor, LazyPiece) and tensor.device.type != "cpu":
            raise RayZeroValueError(f"shard tensor {name!r} is on {tensor.device}; snapshot it to CPU first")
    # Widest dtypes first: every tensor then starts at a multiple of its element size, so the
    # reader can view it in place (safetensors forbids padding between tensors).
    items.sort(key=lambda item: -item[1].element_size())
    writer = SafetensorsWriter(path, [(name, tensor.dtype, (tensor.numel(),)) for name, tensor in items], fsync,
                               align_large=True)
    try:
        for name, tensor in items:
            if isinstance(tensor, LazyPiece):  # copied into the writer's staging: the piece is freed now
                writer.write(name, tensor.materialize(), keep=False)
            else:
                writer.write(name, tensor)
        return writer.close()
    except BaseException:
        writer.abort()  # a full disk or a failed read: no temporary left behind
        raise


def file_checksum(path: str) -> str:
    """xxh3-128 of a whole file, read in large chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ShardMismatchError(RayZeroValueError):
    """A shard file whose header does not describe what its manifest (or its own size) says."""

    def __init__(self, path: str, detail: str) -> None:
        self.path, self.detail = path, detail
        super().__init__(f"checkpoint file {path} does not match its manifest: {detail}")

    def __reduce__(self):
        return (type(self), (self.path, self.detail))


def parse_header(path: str, header_bytes: bytes, data_size: int) -> dict[str, dict]:
    """A safetensors header, every entry checked against the file: a known dtype, a shape of
    non-negative integers, and data offsets inside the data whose length matches the shape.
    Raises ShardMismatchError naming the file and the entry."""
    try:
        header = json.loads(header_bytes)
    except ValueError as error:
        raise ShardMismatchError(path, f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ShardMismatchError(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        try:
            dtype = _FROM_CODE[entry["dtype"]]
            shape, (begin, end) = entry["shape"], entry["data_offsets"]
            numel = 1
            for dim in shape:
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                    raise TypeError(dim)
                numel *= dim
            valid = (all(isinstance(x, int) and not isinstance(x, bool) for x in (begin, end))
                     and 0 <= begin <= end <= data_size and end - begin == numel * dtype.itemsize)
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise ShardMismatchError(path, f"header entry {name!r} = {str(entry)[:120]} is not a tensor inside the file")
    return header


def _split_header(path: str, prefix: bytes, file_size: int) -> int:
    """The header length from a file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise ShardMismatchError(path, f"it is {file_size} bytes long, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > file_size - 8:
        raise ShardMismatchError(path, f"its header claims {length} bytes, the file has {file_size - 8} after the length")
    return length


class LoadedShardFile:
    """A shard file read whole into memory and checksummed; tensors are views into its bytes.

    Reading the file whole is what lets the checksum be verified before any of its tensors reach
    the engine: a corrupted file is rejected, never half-loaded.
    """

    def __init__(self, name: str, data: torch.Tensor) -> None:
        self.name = name
        self.data = data  # uint8, the whole file
        header_len = _split_header(name, data[:8].numpy().tobytes(), data.numel())
        self.data_start = 8 + header_len
        self.header = parse_header(name, data[8:8 + header_len].numpy().tobytes(), data.numel() - self.data_start)

    @classmethod
    def read(cls, path: str, expected_checksum: str | None = None) -> LoadedShardFile:
        """Read `path`; raise `CorruptShardError` when its checksum differs from the manifest's."""
        digest = xxhash.xxh3_128()
        try:
            data = read_file(path, digest.update)  # [Note: direct I/O]
        except OSError as error:
            raise CorruptShardError(path, expected_checksum, f"unreadable ({error})") from error
        if expected_checksum is not None and digest.hexdigest() != expected_checksum:
            raise CorruptShardError(path, expected_checksum, digest.hexdigest())
        return cls(os.path.basename(path), data)

    @classmethod
    def from_bytes(cls, name: str, data: torch.Tensor, expected_checksum: str | None) -> LoadedShardFile:
        """A file received from a peer rank: checksum it before trusting it."""
        actual = xxhash.xxh3_128_hexdigest(tensor_bytes(data))
        if expected_checksum is not None and actual != expected_checksum:
            raise CorruptShardError(name, expected_checksum, actual)
        return cls(name, data)

    def tensor(self, name: str, dtype: torch.dtype | None = None, numel: int | None = None) -> torch.Tensor:
        """The 1-D tensor stored under `name` (a view into the file's bytes); ShardMismatchError when
        the file lacks it or it is not of the `dtype` / `numel` the manifest says."""
        entry = self.header.get(name)
        if entry is None:
            raise ShardMismatchError(self.name, f"it holds no tensor {name!r}")
        stored = _FROM_CODE[entry["dtype"]]
        count = (entry["data_offsets"][1] - entry["data_offsets"][0]) // stored.itemsize
        if (dtype is not None and stored != dtype) or (numel is not None and count != numel):
            raise ShardMismatchError(self.name, f"tensor {name!r} is {count} x {dtype_name(stored)}, the manifest "
                                                f"says {numel} x {dtype_name(dtype) if dtype else '?'}")
        begin, end = entry["data_offsets"]
        raw = self.data[self.data_start + begin:self.data_start + end]
        dtype = _FROM_CODE[entry["dtype"]]
        if (self.data_start + begin) % dtype.itemsize:  # written by another tool, unaligned
            raw = raw.clone()
        return raw.view(dtype)


class CorruptShardError(RayZeroRuntimeError):
    """A shard file's bytes do not match the checksum its manifest recorded."""

    def __init__(self, path: str, expected: str | None, actual: str) -> None:
        self.path, self.expected, self.actual = path, expected, actual
        super().__init__(f"checkpoint file {path} is corrupt: checksum {actual}, manifest says {expected}")

    def __reduce__(self):
        return (type(self), (self.path, self.expected, self.actual))


def read_header(path: str) -> tuple[dict, int]:
    """A shard file's safetensors header (padding entries included, every entry checked against the
    file) and where its data starts."""
    size = os.path.getsize(path)
    with open(path, "rb") as source:
        length = _split_header(path, source.read(8), size)
        header = parse_header(path, source.read(length), size - 8 - length)
    return header, 8 + length


def scatter_file(path: str, expected_checksum: str | None,
                 requests: list[tuple[str, int, int, torch.Tensor]]) -> None:
    """Stream `path` once, checksumming every byte and copying elements [start, end) of each stored
    tensor `name` into its `destination` (1-D, contiguous, the stored dtype) as the bytes pass.

    Memory stays bounded by two read buffers. The destinations are written before the checksum is
    known: on CorruptShardError their contents are garbage and the caller must load them again.
    """
    try:
        header, data_start = read_header(path)
    except OSError as error:
        raise CorruptShardError(path, expected_checksum, f"unreadable ({error})") from error
    spans = []
    for name, start, end, destination in requests:
        entry = header.get(name)
        if entry is None or _FROM_CODE[entry["dtype"]] != destination.dtype:
            raise ShardMismatchError(path, f"it holds no {destination.dtype} tensor {name!r}")
        size = _FROM_CODE[entry["dtype"]].itemsize
        if not 0 <= start <= end <= (entry["data_offsets"][1] - entry["data_offsets"][0]) // size:
            raise ShardMismatchError(path, f"tensor {name!r} has no elements [{start}, {end})")
        base = data_start + entry["data_offsets"][0]
        spans.append((base + start * size, base + end * size, destination.view(torch.uint8)))
    spans.sort(key=lambda span: span[0])
    digest = xxhash.xxh3_128()

    def on_chunk(offset: int, chunk: torch.Tensor) -> None:
        digest.update(tensor_bytes(chunk))
        end = offset + chunk.numel()
        for first, last, destination in spans:
            if first >= end:
                break
            low, high = max(first, offset), min(last, end)
            if low < high:
                destination[low - first:high - first].copy_(chunk[low - offset:high - offset])

    try:
        stream_file(path, on_chunk)
    except OSError as error:
        raise CorruptShardError(path, expected_checksum, f"unreadable ({error})") from error
    if expected_checksum is not None and digest.hexdigest() != expected_checksum:
        raise CorruptShardError(path, expected_checksum, digest.hexdigest())
