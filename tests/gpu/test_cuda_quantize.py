"""Block quantization ([Note: block quantization]) on CUDA gives the CPU's codes, scales and values
bit for bit: the same IEEE fp32 ops, one chunk on the GPU where the CPU goes chunk by chunk. The
collectives' arithmetic is these kernels; their routing is tested on gloo (tests/dist)."""
from __future__ import annotations

import pytest
import torch

from rayzero.engine.quantize import dequantize_blockwise, quantize_blockwise
from rayzero.engine.quantized_comm import quantized_all_gather

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False): run tests/gpu on a GPU machine")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel,group_size", [(7, None), (12345, None), (3 * 2**20 + 5, None), (1001, 100)])
def test_cuda_matches_the_cpu_bit_for_bit(bits, dtype, numel, group_size):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).mul_(3).to(dtype)
    x[::1013] = 0
    on_cpu, on_gpu = quantize_blockwise(x, bits, group_size), quantize_blockwise(x.cuda(), bits, group_size)
    assert on_gpu.payload.is_cuda
    assert torch.equal(on_gpu.payload.cpu(), on_cpu.payload)
    assert torch.equal(on_gpu.scales.cpu(), on_cpu.scales)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_blockwise(on_gpu, out_dtype).cpu(), dequantize_blockwise(on_cpu, out_dtype))


def test_cuda_all_gather_of_one_rank_without_a_group():
    shard = torch.randn(5000, device="cuda")
    output = torch.empty(5000, dtype=torch.bfloat16, device="cuda")
    quantized_all_gather(output, shard, async_op=True).wait()
    expected = dequantize_blockwise(quantize_blockwise(shard.cpu(), 8), torch.bfloat16)
    assert torch.equal(output.cpu(), expected)
