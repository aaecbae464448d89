"""Device-side format helpers for the sm_90a kernels (inlined at trace time, so branch-free): exact decodes of e2m1 codes and
e4m3 scale bytes to fp32 by building the float's bits, and the 128x4-swizzled scale offset of semantics §1.4.

Hopper has no fp4 conversion instruction; an e2m1 value times an e4m3 scale is exact in bf16 (semantics §2.1).
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32


def e2m1_to_f32(code: Int32) -> Float32:
    """e2m1 code (low 4 bits) -> fp32: 0.5 is 0x3F000000; codes with exponent e>0 are 2^(e-1) * (1 + m/2)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = Int32(cutlass.select_(exponent == 0, mantissa * Int32(0x3F000000), normal))
    return (bits | ((code & 8) << 28)).bitcast(Float32)


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
