"""Device-side format helpers for the sm_90a kernels (inlined at trace time, so branch-free): exact decodes of e4m3 and
ue8m0 scale bytes to fp32 by building the float's bits, and the 128x4-swizzled scale offset of semantics §1.4.

Hopper has no fp4 conversion instruction; an e2m1 value times an e4m3 scale is exact in bf16 (semantics §2.1).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def e4m3_to_f32(byte: Int32) -> Float32:
    """e4m3fn byte -> fp32 (normals rebias 7 -> 127; subnormals are m * 2^-9)."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (Float32(mantissa) * Float32(0.001953125)).bitcast(Int32)
    bits = Int32(cutlass.select_(exponent == 0, subnormal, normal))
    return (bits | ((byte & 0x80) << 24)).bitcast(Float32)


def swizzled_sf_offset(expert: Int32, row: Int32, block: Int32, rows_per_expert: Int32,
                       blocks_per_row: Int32) -> Int32:
    """Byte offset of scale (expert, row, K-block) in the 128x4 layout (rows padded to 128, blocks to 4)."""
    m_tiles = (rows_per_expert + 127) // 128
    k_tiles = (blocks_per_row + 3) // 4
    return (expert * (m_tiles * k_tiles * 512) + (row // 128) * (k_tiles * 512) + (block // 4) * 512
            + (row % 32) * 16 + ((row % 128) // 32) * 4 + block % 4)


def _flag(cond) -> Int32:
    return Int32(cutlass.select_(cond, Int32(1), Int32(0)))


def ue8m0_to_f32(code: Int32) -> Float32:
    """UE8M0 scale code -> 2^(code-127); code 0 (2^-127, a denormal) reads as 0 under the kernels' FTZ math."""
    return (code << 23).bitcast(Float32)


# Round-to-nearest-even midpoints on the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}; `True` where a tie goes up
# (the upper neighbour's code is even).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_code(value: Float32) -> Int32:
    """fp32 -> e2m1 code: RN-even onto the grid, saturating at 6, sign kept (cvt.rn.satfinite.e2m1x2 in software)."""
    magnitude = cute.math.abs(value)
    code = Int32(0)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code = code + _flag(magnitude >= Float32(mid) if tie_up else magnitude > Float32(mid))
    sign = (value.bitcast(Int32) >> 31) & 1
    return code | (sign << 3)


def e4m3_code(value: Float32) -> Int32:
    """fp32 -> e4m3fn byte: RN-even, saturating to 448 (cvt.rn.satfinite.e4m3x2.f32 in software)."""
    sign = (value.bitcast(Int32) >> 24) & 0x80
    magnitude = cute.math.min(cute.math.abs(value), Float32(448.0))
    bits = magnitude.bitcast(Int32)
    mantissa = bits & 0x7FFFFF
    kept = mantissa >> 20
    rest = mantissa & 0xFFFFF
    round_up = _flag(rest > 0x80000) | (_flag(rest == 0x80000) & kept)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) + kept + round_up
    # Below 2^-6 the grid is uniform with step 2^-9: round magnitude * 512 to an integer (RN-even).
    subnormal = Int32((magnitude * Float32(512.0) + Float32(8388608.0)) - Float32(8388608.0))
    code = Int32(cutlass.select_(magnitude < Float32(0.015625), subnormal, normal))
    return cute.math.min(code, Int32(0x7E)) | sign


def ue8m0_ceil_code(x: Float32) -> Int32:
    """fp32 >= 0 -> UE8M0 code rounding up (semantics §2.4c), clamped to 254; x <= 0 gives 0."""
    bits = x.bitcast(Int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    small_denormal = _flag(exponent == 0) & _flag(mantissa <= 0x400000)
    bump = _flag(mantissa != 0) & (Int32(1) - small_denormal)
    code = cute.math.min(exponent + bump, Int32(254))
    return Int32(cutlass.select_(x > Float32(0.0), code, Int32(0)))


def ue8m0_reciprocal(code: Int32) -> Float32:
    """2^(127 - code) from its bits; 0 where code is 0 or the result would be denormal (as the kernels build it)."""
    exponent = Int32(254) - code
    bits = Int32(cutlass.select_(exponent > 0, exponent << 23, Int32(0)))
    bits = Int32(cutlass.select_(code == 0, Int32(0), bits))
    return bits.bitcast(Float32)
