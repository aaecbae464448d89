"""Block-scaled quantizers and dequantizers (NVFP4, MXFP4, MXFP8), scale factors in the linear row-major layout.

Shapes: a [R, C] float input gives codes [R, C] (packed to [R, C/2] for fp4) and scale bytes [R, C / block].
The swizzled layout of the weights is a separate step (`swizzle.py`). Formulas follow semantics §2.4 and the
caller-side `fp4_quantize` / `mxfp8_quantize` of FlashInfer. The NVFP4 scales are formed with the CUDA quantizers'
`rcp.approx.ftz` reciprocal (`fast_math.rcp_approx`: the instruction itself on CUDA tensors, exact on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    FLT_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_e2m1,
    ue8m0_decode,
    ue8m0_encode_ceil,
    ue8m0_reciprocal,
    unpack_e2m1,
)
from .fast_math import rcp_approx

NVFP4_BLOCK = 16
MX_BLOCK = 32


def sf_block(quant_mode: str) -> int:
    """Scale-factor block along K of a quant mode's weights: 32 for the MX formats of w4a8, 16 for NVFP4."""
    return MX_BLOCK if quant_mode == "w4a8" else NVFP4_BLOCK


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the scale block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


@dataclass
class BlockQuantized:
    """Quantized values with linear scale factors; `row_scale` is set by the per-token NVFP4 quantizer only."""

    data: torch.Tensor  # packed e2m1 uint8 [..., C/2] or e4m3 float8 [..., C]
    scale: torch.Tensor  # uint8 [..., C/block]: e4m3 bytes (NVFP4) or ue8m0 codes (MX)
    row_scale: torch.Tensor | None = None  # float32 [...]: per-row multiplier (per-token NVFP4)


def nvfp4_quantize(x: torch.Tensor, global_scale: float | torch.Tensor = 1.0) -> BlockQuantized:
    """NVFP4 with a global encode scale gs (FlashInfer `fp4_quantize`, sf_vec 16, e4m3 scales).

    SF = e4m3(gs * amax/6); q = e2m1(x * rcp(SF * rcp(gs))) (semantics §2.4a, "Caution"). Dequantized values are
    q * SF (the 1/gs lives in alpha).
    `global_scale` may be a tensor broadcastable against the leading dimensions (e.g. one per expert: [E, 1, 1]).
    """
    blocks = _blocks(x, NVFP4_BLOCK)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    gs = gs.reshape(gs.shape + (1,) * (blocks.dim() - gs.dim())) if gs.dim() else gs
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    sf = e4m3_encode(gs * (amax * (1.0 / E2M1_MAX)))
    sf_f = e4m3_decode(sf)
    mult = torch.where(sf_f == 0, torch.zeros_like(sf_f), rcp_approx(sf_f * rcp_approx(gs)))
    codes = e2m1_encode(blocks * mult).reshape(x.shape)
    return BlockQuantized(pack_e2m1(codes), sf.squeeze(-1))


def nvfp4_quantize_per_token(x: torch.Tensor, global_scale_inv: float) -> BlockQuantized:
    """Per-row NVFP4 (semantics §1.7, §2.4b): row_scale = rowamax * gsi and x ~= q * SF * row_scale; the scale
    arithmetic is FlashInfer's per-token quantizer's, op for op (enc = rcp(row_scale), mult = rcp(SF * rcp(enc)))."""
    blocks = _blocks(x, NVFP4_BLOCK)
    row_amax = blocks.abs().amax(dim=(-1, -2))
    row_scale = row_amax * torch.tensor(global_scale_inv, dtype=torch.float32)
    enc = torch.where(row_amax == 0, torch.full_like(row_scale, FLT_MAX), rcp_approx(row_scale))[..., None, None]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    sf = e4m3_encode(enc * (amax * rcp_approx(E2M1_MAX, x.device)))
    sf_f = e4m3_decode(sf)
    mult = torch.where(sf_f == 0, torch.zeros_like(sf_f), rcp_approx(sf_f * rcp_approx(enc)))
    codes = e2m1_encode(blocks * mult).reshape(x.shape)
    return BlockQuantized(pack_e2m1(codes), sf.squeeze(-1), row_scale)


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * SF in float32 (exact); scale is e4m3 bytes [..., C/16]."""
    values = e2m1_decode(unpack_e2m1(packed))
    return (_blocks(values, NVFP4_BLOCK) * e4m3_decode(scale)[..., None]).reshape(values.shape)


def mxfp4_quantize(x: torch.Tensor) -> BlockQuantized:
    """MXFP4 (e2m1 values, ue8m0 scale per 32): code = ceil-exponent of amax/6, q = e2m1(x * 2^(127-code))."""
    blocks = _blocks(x, MX_BLOCK)
    code = ue8m0_encode_ceil(blocks.abs().amax(dim=-1, keepdim=True) * (1.0 / E2M1_MAX))
    codes = e2m1_encode(blocks * ue8m0_reciprocal(code)).reshape(x.shape)
    return BlockQuantized(pack_e2m1(codes), code.squeeze(-1))


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = e2m1_decode(unpack_e2m1(packed))
    return (_blocks(values, MX_BLOCK) * ue8m0_decode(scale)[..., None]).reshape(values.shape)


def mxfp8_quantize(x: torch.Tensor) -> BlockQuantized:
    """MXFP8 (e4m3 values, ue8m0 scale per 32), semantics §2.4c: code = ceil-exponent of amax/448."""
    blocks = _blocks(x, MX_BLOCK)
    code = ue8m0_encode_ceil(blocks.abs().amax(dim=-1, keepdim=True) * (1.0 / E4M3_MAX))
    values = e4m3_encode(blocks * ue8m0_reciprocal(code)).view(torch.float8_e4m3fn).reshape(x.shape)
    return BlockQuantized(values, code.squeeze(-1))


def mxfp8_dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    decoded = e4m3_decode(values)
    return (_blocks(decoded, MX_BLOCK) * ue8m0_decode(scale)[..., None]).reshape(decoded.shape)


def nvfp4_quantize_fc2_input(h: torch.Tensor, gs2: torch.Tensor) -> BlockQuantized:
    """The per-tensor NVFP4 quantization inside the GEMM1 epilogue (semantics §2.4a), straight from fp32.

    SF = e4m3((amax * 1/6) * gs2); q = e2m1(h * min(gs2 * rcp(SF), FLT_MAX)). It differs from `nvfp4_quantize` in
    how the encode multiplier is formed, which can flip a rounding decision.
    """
    blocks = _blocks(h, NVFP4_BLOCK)
    gs2 = gs2.float().reshape(())
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    sf = e4m3_encode((amax * (1.0 / E2M1_MAX)) * gs2)
    mult = torch.clamp_max(gs2 * rcp_approx(e4m3_decode(sf)), FLT_MAX)
    codes = e2m1_encode(blocks * mult).reshape(h.shape)
    return BlockQuantized(pack_e2m1(codes), sf.squeeze(-1))
