"""Symmetric block-wise quantization (int8, int4) for ZeRO++'s quantized collectives: pure torch, so
the same code runs on CPU (gloo) and on a GPU (NCCL). The collectives are in quantized_comm.py.

[Note: block quantization]
A tensor is cut into groups of `group_size` consecutive elements (the last group padded with zeros,
so any length works). Each group g keeps one fp32 scale and `bits`-bit signed integers:
    scale_g = absmax_g / qmax,   qmax = 2^(bits-1) - 1   (127 for 8 bits, 7 for 4 bits)
    q_i     = round(x_i / scale_g)                        (to nearest, ties to even; |q_i| <= qmax)
    x'_i    = q_i * scale_g
computed in fp32 whatever the input dtype (fp32, bf16, fp16 are all exact in fp32).
Bound, per element:  |x_i - x'_i| <= scale_g / 2 = absmax_g / (2 qmax)
  (absmax/254 at 8 bits, absmax/14 at 4 bits), up to fp32 rounding (relative 2^-22 of absmax_g);
  dequantized into bf16/fp16, that dtype's rounding of x'_i comes on top.
Edge cases: a group of zeros has scale 0 and comes back as zeros (no NaN). A group whose absmax is
below FLUSH_BELOW (2^-100) is flushed to zeros too (scale 0): its reciprocal would overflow fp32;
the error is then below 2^-100 instead of scale/2. A group holding inf or NaN gets a non-finite scale
and comes back all NaN/inf, so an fp16 overflow check after the collective still sees the overflow.

Wire bytes (`wire_bytes`: what one rank's piece is in the collectives): groups * group_size * bits/8
bytes of payload (padding included), rounded up to 4, plus 4 bytes of scale per group. Per element,
at the group sizes used here (`group_size_for`, ~8000 elements per group for qwZ, ~4096 for qgZ):
    8 bits, 8000 per group:  1 + 4/8000 = 1.0005 B   -> 0.5003 of bf16, 0.2501 of fp32
    4 bits, 4096 per group:  0.5 + 4/4096 = 0.5010 B -> 0.2505 of bf16, 0.1252 of fp32
    4 bits, 8000 per group:  0.5005 B                  -> 0.2503 of bf16, 0.1251 of fp32
(plus at most group_size - 1 padding elements per quantized piece, and 3 alignment bytes).

Where this follows DeepSpeed 0.19.8 and where not:
  - Symmetric, per-group fp32 scales, round to nearest (its kernels' __float2int_rn), int4 packed two
    per byte with the even element in the high nibble as its PackedInt4 (two's-complement nibbles).
  - The scale. DeepSpeed's symmetric kernel (csrc/includes/quantization_utils.h) uses
    absmax / 2^(bits-1) and clamps to [-2^(bits-1), 2^(bits-1) - 1]: the group's largest positive
    value lands on 2^(bits-1), is clamped, and loses a whole step (absmax/128 at 8 bits, absmax/8 =
    12.5% at 4 bits). Here absmax / (2^(bits-1) - 1): nothing is clamped and every element is within
    half a step; the cost is one unused code (-2^(bits-1)).
  - Group size (`group_size_for`): DeepSpeed's CUDAQuantizer adaptive rule (target 8000: the
    smallest number of groups >= numel/8000 that divides numel/8) wherever numel is a multiple of 8
    and that rule gives groups of at least target/8 = 1000 elements (scales at most 0.4% of an int8
    payload). DeepSpeed asserts when numel is not a multiple of 8, and its rule can settle on small
    groups: for numel = 8 x a prime above 1000, groups of 8 elements (4 bytes of scale per 8 bytes
    of payload); of the multiples of 8 below 40,000, 21% get groups under 1000 elements. Those sizes
    get ceil(numel/target) groups of equal size rounded up to a multiple of 8 instead, the last one
    padded (fewer than 8 padding elements per group).
  - Input dtype: DeepSpeed's CUDA kernel reads fp16 (CUDAQuantizer casts bf16 to fp16 first, which
    overflows above 65504); here the scale and the rounding are computed from the value in fp32.
  - qgZ's groups: DeepSpeed derives them from a gradient's shape (numel / max(rows, cols, world):
    ~hidden-size elements); a flat gradient bucket has no shape, so quantized_comm targets 4096.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEEPSPEED_TARGET_GROUP_SIZE = 8000
"""CUDAQuantizer.target_group_size in DeepSpeed 0.19.8 (qwZ's adaptive group size aims below it)."""

FLUSH_BELOW = 2.0 ** -100
"""Groups whose absmax is below this come back as zeros: [Note: block quantization]."""

CPU_CHUNK_ELEMENTS = 1 << 20
"""On CPU the work goes through fp32 temporaries of about this many elements, reused chunk after
chunk, so no full-size temporary is allocated. bench/quantize.py, 16M fp32 elements, one thread,
CPU time (2026-11-28, the shared 2-core machine): 8-bit quantize 44 ms with chunks of 2^20 (46 with
2^18) against 119 ms in whole-tensor ops, dequantize 20 against 89 (a fresh 64 MB temporary is
page-faulted in on every call). More, smaller chunks mean more parallel regions per call, which
cost most where cores are oversubscribed. On a GPU one chunk covers the whole tensor."""

_BITS = (4, 8)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


@dataclass(frozen=True)
class Layout:
    """How `numel` elements are stored quantized, and the one wire format every collective uses:
    a piece is `payload_bytes` of integers, zeros up to `scales_offset` (4-byte alignment for the
    fp32 scales), then `groups` fp32 scales: `piece_bytes` in all."""

    numel: int
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in _BITS:
            raise ValueError(f"bits={self.bits} is not supported: use 8 (int8) or 4 (int4)")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} must be a positive integer (or None for "
                             f"group_size_for's choice)")
        if self.bits == 4 and self.group_size % 2:
            raise ValueError(f"group_size={self.group_size} is odd: 4-bit values are packed two per byte "
                             f"within a group, so use an even group size (or None)")
        if self.numel < 1:
            raise ValueError(f"cannot quantize {self.numel} elements: the tensor is empty")

    @property
    def groups(self) -> int:
        return _ceil_div(self.numel, self.group_size)

    @property
    def padded_numel(self) -> int:
        return self.groups * self.group_size

    @property
    def payload_bytes(self) -> int:
        return self.padded_numel * self.bits // 8

    @property
    def scales_offset(self) -> int:
        return _ceil_div(self.payload_bytes, 4) * 4

    @property
    def piece_bytes(self) -> int:
        return self.scales_offset + 4 * self.groups

    def split(self, pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload uint8 (..., payload_bytes), scales fp32 (..., groups)): views into `pieces`,
        a uint8 tensor (..., piece_bytes) whose last dimension is contiguous."""
        payload = pieces[..., :self.payload_bytes]
        scales = pieces[..., self.scales_offset:].view(torch.float32)
        return payload, scales


def group_size_for(numel: int, target: int = DEEPSPEED_TARGET_GROUP_SIZE) -> int:
    """Elements per group for a tensor of `numel`: DeepSpeed's adaptive choice where it gives groups
    of at least target/8, otherwise ~target with padding ([Note: block quantization]). Always a
    multiple of 8, at most max(target, 8) rounded up to 8."""
    if numel < 1:
        raise ValueError(f"cannot choose a group size for {numel} elements: the tensor is empty")
    if target < 8:
        raise ValueError(f"target={target} must be at least 8 elements per group")
    if numel % 8 == 0:
        size = _deepspeed_group_size(numel, target)
        if size >= min(numel, target // 8):
            return size
    groups = _ceil_div(numel, target)
    return _ceil_div(_ceil_div(numel, groups), 8) * 8


def _deepspeed_group_size(numel: int, target: int) -> int:
    """CUDAQuantizer.quantize's search, for numel a multiple of 8: groups = the smallest count
    >= ceil(numel/target) with numel % (8 * groups) == 0 (its doubling loop that follows never
    runs: numel/groups <= target already). Written as a search over the group size numel/groups =
    8k, k a divisor of numel/8 with k <= numel / (8 ceil(numel/target)) <= target/8, largest first:
    at most target/8 steps, where DeepSpeed's loop can take numel/8."""
    eighths = numel // 8
    minimum_groups = _ceil_div(numel, target)
    for k in range(eighths // minimum_groups, 0, -1):
        if eighths % k == 0:
            return 8 * k
    raise AssertionError("unreachable: k = 1 divides everything")


def wire_bytes(numel: int, bits: int, group_size: int | None = None) -> int:
    """Bytes of one quantized piece of `numel` elements on the wire: payload (padding included),
    alignment, fp32 scales. `group_size` None: `group_size_for(numel)`."""
    return Layout(numel, bits, group_size_for(numel) if group_size is None else group_size).piece_bytes


@dataclass(frozen=True)
class Quantized:
    """A block-quantized flat tensor ([Note: block quantization])."""

    payload: torch.Tensor
    """int8, one value per element (8 bits); uint8, two values per byte, even element high (4 bits).
    Covers the padded length: ceil(numel / group_size) * group_size values."""
    scales: torch.Tensor
    """fp32, one per group: the group's absmax / (2^(bits-1) - 1)."""
    numel: int
    bits: int
    group_size: int

    @property
    def layout(self) -> Layout:
        return Layout(self.numel, self.bits, self.group_size)


@torch.no_grad()
def quantize_blockwise(x: torch.Tensor, bits: int = 8, group_size: int | None = None) -> Quantized:
    """Quantize `x` (fp32, bf16 or fp16; flattened; any length) in groups of `group_size`
    (None: `group_size_for(x.numel())`)."""
    _check_float("x", x)
    layout = Layout(x.numel(), bits, group_size_for(x.numel()) if group_size is None else group_size)
    payload = torch.empty(layout.payload_bytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(layout.groups, dtype=torch.float32, device=x.device)
    quantize_into(x.reshape(-1), layout, payload, scales)
    return Quantized(payload.view(torch.int8) if bits == 8 else payload, scales, layout.numel, bits,
                     layout.group_size)


@torch.no_grad()
def dequantize_blockwise(q: Quantized, dtype: torch.dtype = torch.float32,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat tensor `q` stands for, in `dtype`; written into `out` (numel elements, contiguous,
    of `dtype`) when given, so no second full-size tensor is made."""
    if out is None:
        out = torch.empty(q.numel, dtype=dtype, device=q.payload.device)
    elif out.dtype != dtype or out.numel() != q.numel or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {q.numel} elements, got "
                         f"{out.dtype} with {out.numel()} elements (contiguous={out.is_contiguous()})")
    dequantize_into(q.payload.view(torch.uint8), q.scales, q.layout, out.view(-1))
    return out


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} has dtype {tensor.dtype}: quantization takes fp32, bf16 or fp16")


# ---- the kernels, over any leading dimensions --------------------------------------------------
# Every function below takes tensors of shape (*lead, n): one quantized piece per index of the
# leading dimensions (a rank's shard, or a destination rank's chunk), the last dimension contiguous,
# the leading ones strided at will, so the collectives quantize straight from a swizzled view of
# their input into their send buffer with no copy of either.

def _chunk_groups(layout: Layout, lead: int, device: torch.device) -> int:
    """Groups per chunk: [CPU_CHUNK_ELEMENTS]."""
    full = layout.numel // layout.group_size
    if device.type != "cpu":
        return max(full, 1)
    return max(1, min(full, CPU_CHUNK_ELEMENTS // (lead * layout.group_size)))


def _pieces(layout: Layout, values: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor):
    """(values, codes, scales, work) for each chunk of whole groups: values (..., g, size) of
    `values` (*lead, numel), codes (..., g, size*bits/8) of `payload`, scales (..., g), and an fp32
    scratch (..., g, size). Then, if the last group is partial, the same for it with values None:
    the caller pads it in the scratch."""
    size = layout.group_size
    full = layout.numel // size
    group_bytes = size * layout.bits // 8
    lead = values.shape[:-1]
    chunk = _chunk_groups(layout, math.prod(lead), values.device)
    work = torch.empty(*lead, chunk, size, dtype=torch.float32, device=values.device)
    if full:
        groups = values[..., :full * size].unflatten(-1, (full, size))
        codes = payload[..., :full * group_bytes].unflatten(-1, (full, group_bytes))
        for start in range(0, full, chunk):
            stop = min(start + chunk, full)
            yield groups[..., start:stop, :], codes[..., start:stop, :], scales[..., start:stop], work[..., :stop - start, :]
    if layout.numel > full * size:
        yield None, payload[..., full * group_bytes:].unsqueeze(-2), scales[..., full:], work[..., :1, :]


def quantize_into(x: torch.Tensor, layout: Layout, payload: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize x (*lead, numel) into payload (*lead, payload_bytes) uint8 and scales (*lead, groups)."""
    tail_start = layout.numel // layout.group_size * layout.group_size
    for values, codes, group_scales, work in _pieces(layout, x, payload, scales):
        if values is None:  # the last group, padded with zeros
            tail = layout.numel - tail_start
            work[..., 0, tail:] = 0
            work[..., 0, :tail] = x[..., tail_start:]
            values = work
        _quantize_chunk(values, layout.bits, codes, group_scales, work)


def _quantize_chunk(x: torch.Tensor, bits: int, codes: torch.Tensor, scales: torch.Tensor,
                    work: torch.Tensor) -> None:
    """x (..., groups, size) -> codes (..., groups, size*bits/8) uint8, scales (..., groups) fp32.
    `work` is an fp32 (..., groups, size) scratch; it may be x itself."""
    if x.dtype != torch.float32:
        # one cast first: torch's mixed-dtype elementwise ops take a slow path (bf16 * fp32: 5x
        # slower than the cast plus an fp32 multiply on this CPU)
        work.copy_(x)
        x = work
    # amax and amin, not abs().amax() or aminmax(): no temporary as large as x, and the fast kernels
    absmax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg())
    limit = qmax(bits)
    flushed = absmax < FLUSH_BELOW  # false for NaN: a NaN scale marks the group
    scales.copy_(torch.where(flushed, 0.0, absmax / limit))
    inverse = torch.where(flushed, 0.0, limit / absmax)  # inf absmax -> 0: with its inf scale, NaN out
    torch.mul(x, inverse.unsqueeze(-1), out=work)
    work.round_()
    if bits == 8:
        codes.view(torch.int8).copy_(work)
        return
    values = work.to(torch.int8).unflatten(-1, (-1, 2))  # [-7, 7]; even element high, as DeepSpeed
    # high * 16 + (low & 15) is (high << 4) | (low & 15) and stays within int8: [-112, 127]
    torch.add(values[..., 1].bitwise_and(15), values[..., 0], alpha=16, out=codes.view(torch.int8))


def dequantize_into(payload: torch.Tensor, scales: torch.Tensor, layout: Layout, out: torch.Tensor,
                    accumulate: bool = False) -> None:
    """out (*lead, numel) = (or, `accumulate`, +=) the values of payload (*lead, payload_bytes) uint8
    with scales (*lead, groups); `out` of any floating dtype, computed in fp32."""
    tail_start = layout.numel // layout.group_size * layout.group_size
    for values, codes, group_scales, work in _pieces(layout, out, payload, scales):
        if values is not None:
            _dequantize_chunk(codes, group_scales, layout.bits, work, values, accumulate)
            continue
        _dequantize_chunk(codes, group_scales, layout.bits, work, work, False)  # the padded last group
        rest = out[..., tail_start:]
        if accumulate:
            rest.add_(work[..., 0, :rest.shape[-1]])
        else:
            rest.copy_(work[..., 0, :rest.shape[-1]])


def _dequantize_chunk(codes: torch.Tensor, scales: torch.Tensor, bits: int, work: torch.Tensor,
                      out: torch.Tensor, accumulate: bool) -> None:
    """codes (..., groups, size*bits/8) uint8 and scales (..., groups) into out (..., groups, size)
    through the fp32 scratch `work` (which may be out itself). Every op here has one dtype
    throughout but the int -> fp32 casts: see _quantize_chunk."""
    if bits == 8:
        work.copy_(codes.view(torch.int8))
    else:
        packed = codes.view(torch.int8)
        pairs = work.unflatten(-1, (-1, 2))
        pairs[..., 0].copy_(packed >> 4)  # arithmetic shift: the high nibble, sign-extended
        pairs[..., 1].copy_(packed.bitwise_and(15).bitwise_xor_(8).sub_(8))  # the low one
    scale = scales.unsqueeze(-1)
    if accumulate:
        out.addcmul_(work, scale)
    elif out.dtype == torch.float32:
        torch.mul(work, scale, out=out)
    else:
        work.mul_(scale)
        out.copy_(work)  # the one rounding to bf16/fp16
