"""Scalar element formats used by the 4-bit MoE API, bit-exact to semantics §1.2, §2.1 and §2.4.

Every encoder takes float32 and returns integer codes; every decoder returns float32. The rounding rules are the
ones the Blackwell kernels use (round-to-nearest-even, saturate to the largest finite value), so a Hopper kernel
that follows this module reproduces FlashInfer's bytes.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = 3.4028234663852886e38

# e2m1 code (sign in bit 3) -> value. Codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32)
# Midpoints between neighbouring magnitudes. At a tie the even code wins, so a midpoint whose upper neighbour has an
# odd code belongs to the lower code (strict '>'), and one whose upper neighbour is even belongs to it ('>=').
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8 in 0..15): RN-even onto the e2m1 grid, saturating at ±6, sign kept (-0 -> 8)."""
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, inclusive in _E2M1_MIDPOINTS:
        code += (mag >= mid if inclusive else mag > mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, low 4 bits used) -> float32 values."""
    return E2M1_TABLE.to(codes.device)[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes -> [..., C/2] uint8 bytes; the even element goes in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension must be even, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] uint8 bytes -> [..., C] codes (uint8), inverse of pack_e2m1."""
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn bytes (uint8): RN-even, saturating to ±448 (cvt.rn.satfinite.e4m3x2.f32); NaN stays NaN."""
    x = x.float()
    clamped = torch.where(torch.isnan(x), x, x.clamp(-E4M3_MAX, E4M3_MAX))
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8 or float8_e4m3fn) -> float32."""
    if codes.dtype != torch.float8_e4m3fn:
        codes = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.float()


def ue8m0_encode_ceil(x: torch.Tensor) -> torch.Tensor:
    """float32 -> UE8M0 exponent codes (uint8), rounding toward +inf (semantics §2.4c).

    The code is the biased exponent of x, bumped by one when the mantissa is non-zero, except for denormals whose
    mantissa is at most half the range (they round up to 2^-127 = code 0 already). Codes are clamped to 254 and
    x <= 0 gives 0.
    """
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = (exponent + bump.to(torch.int32)).clamp(max=254)
    code = torch.where(x.float() > 0, code, torch.zeros_like(code))
    return code.to(torch.uint8)


def ue8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes -> 2^(code - 127) as float32 (code 0 is 2^-127, a float32 denormal)."""
    return torch.exp2(codes.to(torch.int32).float() - 127.0)


def ue8m0_reciprocal(codes: torch.Tensor) -> torch.Tensor:
    """2^(127 - code) built from its bits as the kernels do: 0 where code is 0 or the result would be denormal."""
    codes = codes.to(torch.int32)
    exponent = 254 - codes
    inv = (exponent.clamp(min=0) << 23).view(torch.float32)
    return torch.where((codes == 0) | (exponent <= 0), torch.zeros_like(inv), inv)
