"""FC2-input quantizers of the GEMM1 epilogue and the per-token kernel (semantics §2.4), on fp32 registers.

Straight-line helpers, inlined at trace time: each takes one block of fp32 values as a Python list and stores
its packed codes and its scale byte. The scale goes to the 128x4-swizzled layout of the intermediate (one group,
rows = all permuted rows), which GEMM2 reads back.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .fp4 import e2m1_code, e4m3_code, e4m3_to_f32, ue8m0_ceil_code, ue8m0_reciprocal

FLT_MAX = 3.4028234663852886e38


def _amax(values):
    amax = cute.math.abs(values[0])
    for v in values[1:]:
        amax = cute.math.max(amax, cute.math.abs(v))
    return amax


def _store_e2m1_pairs(values, mult, out_q, q_index):
    for j in range(len(values) // 2):
        lo = e2m1_code(values[2 * j] * mult)
        hi = e2m1_code(values[2 * j + 1] * mult)
        out_q[q_index + j] = cutlass.Uint8(lo | (hi << 4))


def store_nvfp4_per_tensor(values, gs2: Float32, out_q, q_index, out_sf, sf_index):
    """16 values: SF = e4m3((amax * 1/6) * gs2); q = e2m1(h * min(gs2 * rcp(SF), FLT_MAX)) (semantics §2.4a)."""
    sf = e4m3_code((_amax(values) * Float32(1.0 / 6.0)) * gs2)
    mult = cute.math.min(gs2 * cute.arch.rcp_approx(e4m3_to_f32(sf)), Float32(FLT_MAX))
    out_sf[sf_index] = cutlass.Uint8(sf)
    _store_e2m1_pairs(values, mult, out_q, q_index)


def store_nvfp4_per_token(values, enc: Float32, out_q, q_index, out_sf, sf_index):
    """16 values of a row with encode scale enc = 1/pts2 (semantics §2.4b)."""
    sf = e4m3_code(enc * (_amax(values) * cute.arch.rcp_approx(Float32(6.0))))
    sf_value = e4m3_to_f32(sf)
    mult = cute.arch.rcp_approx(sf_value * cute.arch.rcp_approx(enc))
    mult = Float32(cutlass.select_(sf_value == Float32(0.0), Float32(0.0), mult))
    out_sf[sf_index] = cutlass.Uint8(sf)
    _store_e2m1_pairs(values, mult, out_q, q_index)


def store_mxfp8(values, out_q, q_index, out_sf, sf_index):
    """32 values: code = ceil-exponent of amax/448, q = e4m3(h * 2^(127-code)) (semantics §2.4c)."""
    code = ue8m0_ceil_code(_amax(values) * Float32(1.0 / 448.0))
    inv = ue8m0_reciprocal(code)
    out_sf[sf_index] = cutlass.Uint8(code)
    for j in range(len(values)):
        out_q[q_index + j] = cutlass.Uint8(e4m3_code(values[j] * inv))


