"""FC2-input quantizers of the GEMM1 epilogue and the per-token kernel (semantics §2.4), on fp32 registers.

Straight-line helpers, inlined at trace time: each takes one block of fp32 values as a Python list and returns its
quantization decoded again, code * scale as bf16x2 words in order (exact: an e2m1 or e4m3 code times its scale has
at most 6 significant bits), which both GEMM2s read as their bf16 A operand. The codes and scales themselves are
never stored: nothing downstream reads them. Given `amax`, the block's absolute maximum, `values` may be one
thread's share of a block that several threads hold (decode_fused.py's GEMM1 epilogue, 2 or 4 values a thread).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx
from .fp4 import e2m1_code, e4m3_code, e4m3_to_f32, ue8m0_ceil_code, ue8m0_reciprocal, ue8m0_to_f32

FLT_MAX = 3.4028234663852886e38


def amax_of(values):
    amax = cute.math.abs(values[0])
    for v in values[1:]:
        amax = cute.math.max(amax, cute.math.abs(v))
    return amax


def _dequantized_e2m1(values, mult, sf) -> list:
    """bf16x2 words of e2m1(h * mult) * SF for an even number of values, in order."""
    s2 = ptx.pack_bf16x2(e4m3_to_f32(sf), e4m3_to_f32(sf))
    words = []
    for g in range(0, len(values), 8):
        part = values[g:g + 8]
        word = Int32(0)
        for j, v in enumerate(part):
            word = word | (e2m1_code(v * mult) << (4 * j))
        words += ptx.e2m1x8_to_bf16x8(word, s2)[:len(part) // 2]
    return words


def _nvfp4_per_tensor_scale(amax: Float32, gs2: Float32):
    """(SF code, multiplier): SF = e4m3((amax * 1/6) * gs2); mult = min(gs2 * rcp(SF), FLT_MAX) (semantics §2.4a)."""
    sf = e4m3_code((amax * Float32(1.0 / 6.0)) * gs2)
    return sf, cute.math.min(gs2 * cute.arch.rcp_approx(e4m3_to_f32(sf)), Float32(FLT_MAX))


def dequantized_nvfp4_per_tensor(values, gs2: Float32, amax=None) -> list:
    """16 values (or a share of them, with the block's `amax`) -> bf16x2 words: their NVFP4 quantization with the
    per-tensor scale gs2, decoded."""
    sf, mult = _nvfp4_per_tensor_scale(amax_of(values) if amax is None else amax, gs2)
    return _dequantized_e2m1(values, mult, sf)


def _nvfp4_per_token_scale(values, enc: Float32):
    """(SF code, multiplier) of 16 values of a row with encode scale enc = 1/pts2 (semantics §2.4b)."""
    sf = e4m3_code(enc * (amax_of(values) * cute.arch.rcp_approx(Float32(6.0))))
    sf_value = e4m3_to_f32(sf)
    mult = cute.arch.rcp_approx(sf_value * cute.arch.rcp_approx(enc))
    return sf, Float32(cutlass.select_(sf_value == Float32(0.0), Float32(0.0), mult))


def dequantized_nvfp4_per_token(values, enc: Float32) -> list:
    sf, mult = _nvfp4_per_token_scale(values, enc)
    return _dequantized_e2m1(values, mult, sf)


def _mxfp8_scale(amax: Float32):
    """(ue8m0 code, 2^(127-code)): code = ceil-exponent of amax/448 (semantics §2.4c)."""
    code = ue8m0_ceil_code(amax * Float32(1.0 / 448.0))
    return code, ue8m0_reciprocal(code)


def dequantized_mxfp8(values, amax=None) -> list:
    """32 values (or a share of them, with the block's `amax`) -> bf16x2 words: their MXFP8 quantization
    e4m3(h * 2^(127-code)), decoded as that code times 2^(code-127) (exact in bf16 while the product is an fp32
    normal)."""
    code, inv = _mxfp8_scale(amax_of(values) if amax is None else amax)
    scale = ue8m0_to_f32(code)
    words = []
    for j in range(len(values) // 2):
        lo, hi = ptx.e4m3_rounded_pair(values[2 * j] * inv, values[2 * j + 1] * inv)
        words.append(ptx.pack_bf16x2(lo * scale, hi * scale))
    return words


