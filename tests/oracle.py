"""An independent float64 implementation of the fused-MoE semantics, for checking moe_ext.reference.

It shares no code with moe_ext: formats are decoded from their bit fields, the swizzle is read through a reshape
of the 512-byte atoms rather than the offset formula, roundings search the enumerated code tables, and the math
is float64 with exact transcendental functions. bf16 rounding points follow semantics §2.6.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def e2m1_value(nibble: torch.Tensor) -> torch.Tensor:
    sign = torch.where((nibble >> 3) & 1 == 1, -1.0, 1.0).to(F64)
    exp = ((nibble >> 1) & 3).to(F64)
    man = (nibble & 1).to(F64)
    mag = torch.where(exp == 0, man * 0.5, torch.pow(2.0, exp - 1) * (1 + man / 2))
    return sign * mag


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    out = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.int64)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    b = byte.to(torch.int64)
    sign = torch.where((b >> 7) == 1, -1.0, 1.0).to(F64)
    exp = ((b >> 3) & 0xF).to(F64)
    man = (b & 7).to(F64)
    mag = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.pow(2.0, exp - 7))
    return sign * mag


def ue8m0_value(byte: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, byte.to(F64) - 127)


def read_swizzled(flat: torch.Tensor, groups: int, rows: int, cols: int) -> torch.Tensor:
    """Swizzled scale bytes -> [groups, rows, cols] through the atom view (groups, mt, kt, r%32, r/32%4, c%4)."""
    mt, kt = -(-rows // 128), -(-cols // 4)
    atoms = flat.reshape(groups, mt, kt, 32, 4, 4)
    r = torch.arange(rows)
    c = torch.arange(cols)
    return atoms[:, (r // 128)[:, None], (c // 4)[None, :], (r % 32)[:, None], ((r // 32) % 4)[:, None],
                 (c % 4)[None, :]]


def _table_round(x: torch.Tensor, table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Nearest table value; ties to the even code; |x| beyond the table saturates."""
    d = (x[..., None] - table).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    # Prefer even codes among ties.
    score = cand.to(torch.int64) * 2 + ((codes % 2) == 0).to(torch.int64) * cand.to(torch.int64)
    return table[score.argmax(dim=-1)]


_E2M1_CODES = torch.arange(16)
_E2M1_TABLE = e2m1_value(_E2M1_CODES)
_E4M3_CODES = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F])
_E4M3_TABLE = e4m3_value(_E4M3_CODES)


def round_e2m1(x):
    return _table_round(x, _E2M1_TABLE, _E2M1_CODES)


def round_e4m3(x):
    return _table_round(x.clamp(-448, 448), _E4M3_TABLE, _E4M3_CODES)


def bf16(x):
    return x.to(torch.float32).to(torch.bfloat16).to(F64)


def blockwise(x, block):
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def activation(kind, params, up, gate):
    if kind == "relu2":
        return torch.clamp(gate, min=0) ** 2
    if kind == "swiglu":
        alpha, beta, limit = params
        g = torch.clamp(gate, max=limit)
        u = torch.clamp(up, -limit, limit)
        return torch.sigmoid(alpha * g) * g * (u + beta)
    if kind == "situ":
        b, c = params
        sg = b * torch.tanh(gate / b) * torch.sigmoid(gate)
        if c is not None:
            up = c * torch.tanh(up / c)
        return up * sg
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)
    return up * 0.5 * gate * (1 + torch.tanh(inner))


def fc2_input(mode, h, fc2_scale, per_token):
    """(dequantized FC2 input, row scale) in float64, semantics §2.4."""
    if mode == "w4a16":
        return bf16(h), 1.0
    if mode == "w4a8":
        b = blockwise(h, 32)
        amax = b.abs().amax(-1, keepdim=True) / 448
        code = torch.where(amax > 0, 127 + torch.ceil(torch.log2(amax)), torch.zeros_like(amax)).clamp(0, 254)
        q = round_e4m3(b * torch.pow(2.0, 127 - code))
        return (q * torch.pow(2.0, code - 127)).reshape(h.shape), 1.0
    if per_token:
        # bf16 inputs put many values exactly on e2m1 rounding ties, so the scale arithmetic follows the spec's
        # fp32 op sequence (semantics §2.4b): enc = 1/pts2, mult = 1/(SF * (1/enc)), each rounded to fp32.
        f32 = lambda v: v.to(torch.float32).to(F64)  # noqa: E731
        hb = bf16(h)
        pts2 = f32(hb.abs().max() * f32(torch.tensor(fc2_scale, dtype=F64)))
        enc = f32(1 / pts2) if pts2 > 0 else torch.tensor(3.4028234663852886e38, dtype=F64)
        b = blockwise(hb, 16)
        sf = round_e4m3(f32(enc * f32(b.abs().amax(-1, keepdim=True) * f32(torch.tensor(1 / 6, dtype=F64)))))
        mult = torch.where(sf > 0, f32(1 / f32(sf * f32(1 / enc))), torch.zeros_like(sf))
        q = round_e2m1(f32(b * mult))
        return (q * sf).reshape(h.shape), pts2
    b = blockwise(h, 16)
    sf = round_e4m3(b.abs().amax(-1, keepdim=True) / 6 * fc2_scale)
    mult = torch.where(sf > 0, fc2_scale / sf, torch.full_like(sf, 3.4028234663852886e38))
    q = round_e2m1(torch.clamp(b * mult, -1e30, 1e30))
    return (q * sf).reshape(h.shape), 1.0


def decode_input(mode, x, x_sf):
    if mode == "w4a16":
        return x.to(F64)
    if mode == "w4a8":
        vals = e4m3_value(x.view(torch.uint8))
        return (blockwise(vals, 32) * ue8m0_value(x_sf.view(torch.uint8).reshape(x.shape[0], -1))[..., None]
                ).reshape(vals.shape)
    vals = e2m1_value(unpack_fp4(x))
    return (blockwise(vals, 16) * e4m3_value(x_sf.view(torch.uint8).reshape(x.shape[0], -1))[..., None]
            ).reshape(vals.shape)


def decode_weight(mode, packed, sf_flat, e):
    _, rows, half = packed.shape
    block = 32 if mode == "w4a8" else 16
    scales = read_swizzled(sf_flat, packed.shape[0], rows, 2 * half // block)[e]
    decode = ue8m0_value if mode == "w4a8" else e4m3_value
    vals = e2m1_value(unpack_fp4(packed[e]))
    return (blockwise(vals, block) * decode(scales)[..., None]).reshape(vals.shape)


def oracle_moe(mode, x, x_sf, ids, scales, w1, w1_sf_flat, w1_alpha, fc2_scale, w2, w2_sf_flat, w2_alpha,
               num_local, offset, kind, params, fused, per_token_scale=None):
    """float64 forward straight from the API tensors (per token, per slot)."""
    T, K = ids.shape
    H = w2.shape[1]
    gated = kind != "relu2"
    xd = decode_input(mode, x, x_sf)
    out = torch.zeros(T, H, dtype=F64)
    for t in range(T):
        acc = torch.zeros(H, dtype=F64)
        for k in range(K):
            e = int(ids[t, k]) - offset
            if not 0 <= e < num_local:
                continue
            s1 = float(w1_alpha[e]) * (float(per_token_scale[t]) if per_token_scale is not None else 1.0)
            g1 = s1 * (decode_weight(mode, w1, w1_sf_flat, e) @ xd[t])
            if gated:
                pairs = g1.reshape(-1, 2, 64)
                up, gate = pairs[:, 0].reshape(-1), pairs[:, 1].reshape(-1)
                h = activation(kind, params, up, gate)
            else:
                h = activation(kind, params, None, g1)
            hq, pts2 = fc2_input(mode, h, float(fc2_scale) if fc2_scale is not None else None,
                                 per_token_scale is not None)
            acc2 = decode_weight(mode, w2, w2_sf_flat, e) @ hq
            r = float(scales[t, k])
            a = float(w2_alpha[e])
            if fused:
                acc = bf16(acc + bf16(a * r * pts2 * acc2))
            else:
                acc = acc + bf16(a * pts2 * acc2) * r
        out[t] = acc if fused else bf16(acc)
    return out
