"""The kernels' in-register number formats against moe_ext.quant's, value for value, on the GPU: the hardware e4m3
rounding behind the FC2 input's MXFP8 quantization (w4a8), the whole MXFP8 quantize-and-decode of a 32-value
block, the software e4m3 encoder of the NVFP4 block scales and the e4m3 decoder.

Each helper runs inside a small kernel JIT-compiled with CuTe-DSL, one thread per group of inputs. Skipped without
CuTe-DSL or without an sm_90 GPU (on the H200: `gpu_check.sh formats`, which unpacks the offline CuTe-DSL)."""

import pytest
import torch
from conftest import gpu

from moe_ext.quant.block import mxfp8_dequantize, mxfp8_quantize
from moe_ext.quant.formats import E4M3_MAX, e4m3_decode, e4m3_encode

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

pytestmark = [
    pytest.mark.gpu, gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs an sm_90 GPU"),
]


def run_per_group(fn, inputs: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """fn (a list of `group` kernel scalars -> a list of scalars) applied by one thread to each consecutive group of
    the 1-D `inputs`; the results, concatenated in group order."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_fake_stream

    from moe_ext.kernels.sm90.fake_args import vector

    dtypes = {torch.float32: cutlass.Float32, torch.int32: Int32}
    outputs = []  # the result count, learnt while tracing

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, groups: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        g = block * 128 + tid
        if g < groups:
            results = fn([x[g * group + j] for j in range(group)])
            outputs.append(len(results))
            for j in cutlass.range_constexpr(len(results)):
                out[g * len(results) + j] = results[j]

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, groups: Int32, stream):
        kernel(x, out, groups).launch(grid=((groups + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    compiled = cute.compile(launch, vector(dtypes[inputs.dtype]), vector(dtypes[out_dtype]), Int32(1),
                            make_fake_stream(use_tvm_ffi_env_stream=True),
                            options="--gpu-arch sm_90a --enable-tvm-ffi")
    groups = inputs.numel() // group
    out = torch.empty(groups * outputs[0], dtype=out_dtype, device="cuda")
    compiled(inputs.cuda().contiguous(), out, groups)
    torch.cuda.synchronize()
    return out.cpu()


def e4m3_edge_values() -> torch.Tensor:
    """Every finite e4m3 value with both signs, the midpoints between neighbours (ties: RN-even decides) and one
    fp32 ulp either side of each, values past 448 (saturation) and the infinities."""
    grid = e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = (grid[1:] + grid[:-1]) / 2
    big = torch.tensor([448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 1e4, float("inf")])
    values = torch.cat([grid, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                        torch.nextafter(mids, torch.full_like(mids, 1e9)), big])
    return torch.cat([values, -values])


def random_fp32(n: int, seed: int, low_exp: int = -14, high_exp: int = 10) -> torch.Tensor:
    """fp32 values with random sign, mantissa bits and an exponent uniform in [low_exp, high_exp]."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int64)
    exponent = torch.randint(low_exp + 127, high_exp + 128, (n,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=g).bool()
    values = ((exponent << 23) | mantissa).to(torch.int32).view(torch.float32)
    return torch.where(sign, -values, values)


def test_hardware_e4m3_rounding_matches_the_reference_encoder():
    from moe_ext.kernels.sm90 import ptx

    x = torch.cat([e4m3_edge_values(), random_fp32(1 << 18, seed=0)])
    x = torch.cat([x, x[:1]]) if x.numel() % 2 else x
    got = run_per_group(lambda v: ptx.e4m3_rounded_pair(v[0], v[1]), x, 2, torch.float32)
    expected = e4m3_decode(e4m3_encode(x))
    assert expected.abs().max() == E4M3_MAX
    mismatch = (got != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [(x[i].item(), got[i].item(), expected[i].item()) for i in mismatch[:8]]


def test_software_e4m3_encoder_matches_the_reference_encoder():
    from moe_ext.kernels.sm90 import fp4

    x = torch.cat([e4m3_edge_values(), random_fp32(1 << 18, seed=1)])
    got = run_per_group(lambda v: [fp4.e4m3_code(v[0])], x, 1, torch.int32)
    expected = e4m3_encode(x).to(torch.int32)
    mismatch = (got != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [(x[i].item(), got[i].item(), expected[i].item()) for i in mismatch[:8]]


def test_e4m3_decoder_reads_every_finite_code():
    from moe_ext.kernels.sm90 import fp4

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.int32)  # 0x7F, 0xFF: NaN
    got = run_per_group(lambda v: [fp4.e4m3_to_f32(v[0])], codes, 1, torch.float32)
    assert torch.equal(got.view(torch.int32), e4m3_decode(codes.to(torch.uint8)).view(torch.int32))  # -0 too


def test_mxfp8_quantize_and_decode_of_a_block_matches_the_reference():
    """32-value blocks at scales from 2^-30 to 2^30 (each block's ue8m0 code differs), blocks with zeros and an
    all-zero block: the kernel's bf16 words equal the reference quantizer's codes times their scale."""
    from moe_ext.kernels.sm90 import quantize

    g = torch.Generator().manual_seed(2)
    blocks = 4096
    x = torch.randn(blocks, 32, generator=g) * torch.exp2(torch.randint(-30, 31, (blocks, 1), generator=g).float())
    x[::7, ::5] = 0.0
    x[3] = 0.0
    top = e4m3_decode(torch.arange(0x6F, 0x7F, dtype=torch.uint8))
    x[5] = torch.cat([top, (top[1:] + top[:-1]) / 2, -top[-1:]])  # 448 the amax: code 127, ties at the top
    got = run_per_group(quantize.dequantized_mxfp8, x.flatten(), 32, torch.int32).view(torch.bfloat16)
    q = mxfp8_quantize(x)
    expected = mxfp8_dequantize(q.data, q.scale).flatten()
    assert torch.equal(expected.bfloat16().float(), expected)  # the decoded values are exact in bf16
    mismatch = (got.float() != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [(i.item(), got[i].item(), expected[i].item()) for i in mismatch[:8]]
