"""Block quantization ([Note: block quantization]) without a process group: the per-element bound on
random and adversarial inputs, the wire format (sizes, int4 packing) and agreement with a reference
written here with Python loops and numbers (float64), not with the module's tensors."""
from __future__ import annotations

import math

import pytest
import torch

from rayzero.engine import quantize
from rayzero.engine.quantize import (
    FLUSH_BELOW,
    Layout,
    dequantize_blockwise,
    group_size_for,
    quantize_blockwise,
    quantize_into,
    wire_bytes,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(values: list[float], bits: int, group_size: int) -> tuple[list[int], list[float]]:
    """Codes (padded with zeros to whole groups) and scales, one group at a time in float64."""
    limit = 2 ** (bits - 1) - 1
    codes, scales = [], []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        group = group + [0.0] * (group_size - len(group))
        absmax = max(abs(v) for v in group)
        scale = absmax / limit
        scales.append(scale)
        codes += [round(v / scale) if scale else 0 for v in group]  # round(): ties to even
    return codes, scales


def packed_reference(codes: list[int]) -> list[int]:
    """Two's-complement nibbles, the even element in the high one (DeepSpeed's PackedInt4)."""
    return [((codes[i] & 0xF) << 4) | (codes[i + 1] & 0xF) for i in range(0, len(codes), 2)]


def unpacked(q: quantize.Quantized) -> list[int]:
    if q.bits == 8:
        return q.payload.tolist()
    codes = []
    for byte in q.payload.tolist():
        for nibble in (byte >> 4, byte & 0xF):
            codes.append(nibble - 16 if nibble >= 8 else nibble)
    return codes


def group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each element's group absmax, from x alone (not from the scales under test)."""
    flat = x.float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % group_size))
    return padded.view(-1, group_size).abs().amax(dim=1).repeat_interleave(group_size)[:flat.numel()]


def assert_within_bound(x: torch.Tensor, bits: int, group_size: int | None = None) -> quantize.Quantized:
    q = quantize_blockwise(x, bits, group_size)
    back = dequantize_blockwise(q, torch.float32)
    absmax = group_absmax(x, q.group_size)
    bound = absmax / (2 * (2 ** (bits - 1) - 1)) + absmax * 2.0 ** -22  # scale/2, fp32 rounding
    error = (x.float().reshape(-1) - back).abs()
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (
        f"element {worst}: |{float(x.reshape(-1)[worst])} - {float(back[worst])}| > {float(bound[worst])}")
    return q


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,group_size", [(1, None), (7, None), (8000, None), (8001, None), (12345, None),
                                              (100_003, None), (1000, 6), (1001, 10), (4096, 2)])
def test_random_inputs_come_back_within_half_a_step_of_their_group(bits, dtype, numel, group_size):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    q = assert_within_bound(x.to(dtype), bits, group_size)
    assert q.numel == numel


def _adversarial(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    normal = torch.randn(4096, generator=generator)
    outliers = normal.clone()
    outliers[::997] = 1e4  # one outlier per group of ~1000 squeezes the rest into a few codes
    largest = torch.finfo(dtype).max if dtype != torch.float32 else 1e38
    steps = torch.arange(-127, 128, dtype=torch.float32)
    return {
        "outliers": outliers,
        "zeros": torch.zeros(1000),
        "one value": torch.full((999,), -2.5),
        "alternating signs": torch.tensor([1.0, -1.0] * 501),
        "midpoints between codes": torch.cat([torch.tensor([127.0]), steps[:-1] + 0.5]),
        "dtype's largest": torch.tensor([largest, -largest, largest / 3, 1.0] * 25),
        "tiny but above the flush": torch.full((64,), 2.0 ** -90) * torch.randn(64, generator=generator),
        "mixed scales per group": torch.cat([normal[:1000] * 1e-6, normal[1000:2000] * 1e6, normal[2000:3001]]),
    }


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_adversarial(torch.float32)))
def test_adversarial_inputs_come_back_within_half_a_step_of_their_group(bits, dtype, name):
    x = _adversarial(dtype)[name].to(dtype)
    if dtype == torch.float16 and name in ("mixed scales per group", "tiny but above the flush"):
        x = x.clamp(-60000, 60000)  # fp16 flushes 2^-90 to zero already; 1e6 overflows it
    q = assert_within_bound(x, bits, 1000)
    assert torch.isfinite(q.scales).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_agrees_with_a_loop_reference_code_for_code(bits):
    for numel, group_size in ((37, 8), (64, 64), (250, 40), (9, 4)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        q = quantize_blockwise(x, bits, group_size)
        codes, scales = reference(x.tolist(), bits, group_size)
        assert unpacked(q) == codes
        assert q.scales.tolist() == pytest.approx(scales, rel=1e-6)
        if bits == 4:
            assert q.payload.tolist() == packed_reference(codes)
        back = dequantize_blockwise(q).tolist()
        expected = [code * scales[i // group_size] for i, code in enumerate(codes[:numel])]
        assert back == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_int4_packing_by_hand():
    # scale 1/7: codes 7, -7, 3.5 -> 4 (ties to even), -4; then 1, 2, 3, 0 on scale 3/7
    x = torch.tensor([1.0, -1.0, 0.5, -0.5, 3 / 7, 6 / 7, 3.0, 0.0])
    q = quantize_blockwise(x, 4, 4)
    assert q.payload.dtype == torch.uint8
    assert q.payload.tolist() == [0x79, 0x4C, 0x12, 0x70]
    assert q.scales.tolist() == pytest.approx([1 / 7, 3 / 7])


@pytest.mark.parametrize("numel,bits,group_size,payload,groups,wire", [
    (8000, 8, None, 8000, 1, 8004),
    (8000, 4, 4096, 4096, 2, 4104),  # 8192 padded values, half a byte each
    (10, 4, 6, 6, 2, 8 + 8),  # 6 payload bytes aligned to 8 for the scales
    (3, 8, None, 8, 1, 12),  # group_size_for(3) = 8: padded to one group of 8
    (12345, 4, None, 6176, 2, 6176 + 8),  # group_size_for(12345) = 6176: 2 groups, 7 padded values
])
def test_payload_and_wire_sizes(numel, bits, group_size, payload, groups, wire):
    q = quantize_blockwise(torch.ones(numel), bits, group_size)
    assert q.payload.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert (q.payload.numel(), q.scales.numel(), q.scales.dtype) == (payload, groups, torch.float32)
    assert wire_bytes(numel, bits, group_size) == wire


def test_wire_bytes_at_the_group_sizes_of_the_note():
    assert wire_bytes(16 * 2**20, 8) == 16 * 2**20 + 4 * 4096  # 4096 groups of 4096
    assert wire_bytes(8000 * 1000, 8) / (2 * 8000 * 1000) == pytest.approx(0.50025)  # of bf16
    assert wire_bytes(4096 * 1000, 4, 4096) / (2 * 4096 * 1000) == pytest.approx(0.2505, abs=1e-4)


def test_zero_tiny_and_non_finite_groups():
    tiny = FLUSH_BELOW / 4
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, tiny, -tiny, 0.0, tiny,
                      1.0, float("inf"), 2.0, 3.0, 1.0, float("nan"), 2.0, 3.0, 1.0, -2.0, 3.0, 0.5])
    for bits in (8, 4):
        back = dequantize_blockwise(quantize_blockwise(x, bits, 4))
        assert back[:8].tolist() == [0.0] * 8, "zero and flushed groups: zeros, no NaN"
        assert not torch.isfinite(back[8:16]).any(), "a non-finite value poisons its group (overflow checks)"
        assert torch.isfinite(back[16:]).all() and back[16:].tolist() == pytest.approx([1.0, -2.0, 3.0, 0.5], abs=0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dequantize_into_out_rounds_once_to_the_output_dtype(dtype):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    q = quantize_blockwise(x, 8, 1000)
    out = torch.full((50, 100), float("nan"), dtype=dtype)
    returned = dequantize_blockwise(q, dtype, out=out)
    assert returned is out
    assert torch.equal(out.view(-1), dequantize_blockwise(q, torch.float32).to(dtype))


def test_the_cpu_chunk_size_changes_nothing(monkeypatch):
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    results = []
    for chunk in (1, 1000, 1 << 16, 1 << 30):
        monkeypatch.setattr(quantize, "CPU_CHUNK_ELEMENTS", chunk)
        for bits in (8, 4):
            q = quantize_blockwise(x, bits, 998)
            results.append((bits, q.payload.clone(), q.scales.clone(), dequantize_blockwise(q)))
    for bits, payload, scales, back in results[2:]:
        first = results[0] if bits == 8 else results[1]
        assert torch.equal(payload, first[1]) and torch.equal(scales, first[2]) and torch.equal(back, first[3])


def test_a_strided_batch_quantizes_as_its_pieces_one_by_one():
    """The collectives quantize (nodes, local, chunk) views transposed in place (the swizzle)."""
    source = torch.randn(3, 2, 1001, generator=torch.Generator().manual_seed(9))
    swizzled = source.transpose(0, 1)  # (2, 3, 1001), not contiguous
    layout = Layout(1001, 4, 100)
    pieces = torch.empty(2, 3, layout.piece_bytes, dtype=torch.uint8)
    payload, scales = layout.split(pieces)
    quantize_into(swizzled, layout, payload, scales)
    for i in range(2):
        for j in range(3):
            one = quantize_blockwise(swizzled[i, j], 4, 100)
            assert torch.equal(payload[i, j], one.payload) and torch.equal(scales[i, j], one.scales)


def test_parameters_that_require_grad_quantize():
    parameter = torch.nn.Parameter(torch.randn(100))
    assert_within_bound(parameter, 8)


def deepspeed_groups(numel: int, target: int = 8000) -> int:
    """CUDAQuantizer.quantize's adaptive grouping, transcribed line by line (DeepSpeed 0.19.8,
    runtime/zero/partition_parameters.py), asserts included."""
    groups = math.ceil(numel / target)
    while groups < numel:
        if numel % (8 * groups) == 0:
            break
        groups += 1
    while True:
        if numel % (8 * groups * 2) == 0 and numel / groups > target:
            groups *= 2
        else:
            break
    assert numel % (8 * groups) == 0
    assert numel / groups < 16000
    assert numel > groups
    return groups


def test_group_size_is_deepspeeds_wherever_its_groups_are_not_tiny():
    followed = diverged = 0
    sizes = list(range(8, 40_000, 8)) + [4096 * 4096, 4096 * 11008, 50257 * 768, 768, 3 * 2**20]
    for numel in sizes:
        theirs = numel // deepspeed_groups(numel)
        ours = group_size_for(numel)
        if theirs >= min(numel, 1000):
            assert ours == theirs, numel
            followed += 1
        else:  # e.g. 8 x 1009 (a prime): DeepSpeed's groups hold 8 elements
            assert ours != theirs and ours >= 1000, numel
            diverged += 1
    assert followed > 0.75 * len(sizes) and diverged > 0
    assert group_size_for(4096 * 4096) == 4096 and group_size_for(50257 * 768) == 7424


@pytest.mark.parametrize("numel", [1, 7, 8 * 1009, 8001, 12345, 10**7 + 1, 2**31 - 1])
def test_group_size_otherwise_pads_little(numel):
    size = group_size_for(numel)
    groups = math.ceil(numel / size)
    assert size % 8 == 0 and size <= 8000
    assert groups == math.ceil(numel / 8000)
    assert groups * size - numel < 8 * groups, "padding: under 8 elements per group"


@pytest.mark.parametrize("call,match", [
    (lambda: quantize_blockwise(torch.ones(4), bits=3), "bits=3"),
    (lambda: quantize_blockwise(torch.ones(4), 8, group_size=0), "group_size=0"),
    (lambda: quantize_blockwise(torch.ones(4), 4, group_size=5), "group_size=5 is odd"),
    (lambda: quantize_blockwise(torch.ones(0)), "empty"),
    (lambda: quantize_blockwise(torch.ones(4, dtype=torch.int32)), "dtype torch.int32"),
    (lambda: dequantize_blockwise(quantize_blockwise(torch.ones(4)), torch.float32, out=torch.empty(5)),
     "4 elements"),
    (lambda: group_size_for(0), "empty"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_collectives_without_a_process_group_are_a_world_of_one():
    from rayzero.engine.quantized_comm import quantized_all_gather, quantized_reduce_scatter

    x = torch.randn(1001, generator=torch.Generator().manual_seed(11))
    gathered = torch.empty(1001, dtype=torch.bfloat16)
    assert quantized_all_gather(gathered, x) is None  # sync
    assert torch.equal(gathered, dequantize_blockwise(quantize_blockwise(x, 8), torch.bfloat16))
    handle = quantized_all_gather(gathered, x, bits=4, async_op=True)
    handle.wait()
    assert torch.equal(gathered, dequantize_blockwise(quantize_blockwise(x, 4), torch.bfloat16))
    summed = torch.empty(1001)
    quantized_reduce_scatter(summed, x, None, None)
    assert torch.equal(summed, x), "one rank: nothing crosses a link, nothing is quantized"


def test_sent_bytes_of_one_node_and_of_one_rank_per_node():
    from rayzero.engine.quantized_comm import SentBytes, all_gather_sent_bytes, reduce_scatter_sent_bytes

    piece = wire_bytes(5000, 4, group_size_for(5000, 4096))  # qgZ's target: 5 groups of 1000
    assert reduce_scatter_sent_bytes(5000, 1, 8) == SentBytes(7 * piece, 0)  # one node: stage 1 only
    assert reduce_scatter_sent_bytes(5000, 8, 1) == SentBytes(0, 7 * piece)  # one rank per node: stage 2 only
    assert reduce_scatter_sent_bytes(5000, 1, 1) == SentBytes(0, 0)
    assert all_gather_sent_bytes(5000, 8) == SentBytes(7 * wire_bytes(5000, 8), 0)  # hpZ: inside the node
    with pytest.raises(ValueError, match="local_size=3 does not divide world_size=8"):
        all_gather_sent_bytes(5000, 8, 3)
