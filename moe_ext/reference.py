"""Readable PyTorch reference of the fused MoE forward (semantics §2), on any device.

The data flow is the kernels' flow, one stage per function: route the (token, slot) pairs to local experts,
GEMM1 on the decoded operands with alpha (and the per-token scale) applied to the fp32 accumulator, the
activation on the de-interleaved up/gate columns, the mode's FC2-input quantize-dequantize, GEMM2, and the
finalize with its bf16 rounding points. Products of decoded operands are exact; sums are fp32 in torch's order.
The reference groups rows per expert on the host, so it synchronises and is not meant for graph capture.
"""
from __future__ import annotations

import torch

from .problem import MoEProblem, WeightSet
from .quant.block import (
    mxfp4_dequantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize_fc2_input,
    nvfp4_quantize_per_token,
    sf_block,
)
from .quant.interleave import split_up_gate
from .quant.swizzle import swizzle_offsets, swizzled_size
from .routing import Routing, compute_routing

def dequantize_input(p: MoEProblem) -> torch.Tensor:
    """x decoded to fp32 [T, H] (no global scale: it lives in w1_alpha)."""
    if p.quant_mode == "w4a4":
        return nvfp4_dequantize(p.x, p.x_sf)
    if p.quant_mode == "w4a8":
        return mxfp8_dequantize(p.x, p.x_sf)
    return p.x.float()


def dequantize_expert(packed: torch.Tensor, sf_flat: torch.Tensor, expert: int, quant_mode: str) -> torch.Tensor:
    """One expert's weight [R, C] decoded to fp32, its scales read from the swizzled buffer (semantics §1.4)."""
    num_experts, rows, half_cols = packed.shape
    block = sf_block(quant_mode)
    sf_cols = 2 * half_cols // block
    per_expert = swizzled_size(1, rows, sf_cols)
    scales = sf_flat[expert * per_expert + swizzle_offsets(1, rows, sf_cols, packed.device)[0]]
    decode = mxfp4_dequantize if quant_mode == "w4a8" else nvfp4_dequantize
    return decode(packed[expert], scales)


def _weight_sets(p: MoEProblem) -> list[WeightSet]:
    # Localized shards split FC1 rows and FC2 output rows in halves; concatenating their results gives the
    # full-width result, so the full-width tensors are never read when shards are given.
    return p.shards if p.shards is not None else [p.weights]


def gemm1(p: MoEProblem, x_rows: torch.Tensor, expert: int) -> torch.Tensor:
    """fp32 [n, N1] accumulator of x_rows @ W1[e]^T, in the physical (interleaved) column order."""
    return torch.cat([x_rows @ dequantize_expert(ws.w1, ws.w1_sf_bytes(), expert, p.quant_mode).T
                      for ws in _weight_sets(p)], dim=-1)


def gemm2(p: MoEProblem, h_rows: torch.Tensor, expert: int) -> torch.Tensor:
    """fp32 [n, H] accumulator of h_rows @ W2[e]^T."""
    return torch.cat([h_rows @ dequantize_expert(ws.w2, ws.w2_sf_bytes(), expert, p.quant_mode).T
                      for ws in _weight_sets(p)], dim=-1)


def activate(p: MoEProblem, acc1: torch.Tensor) -> torch.Tensor:
    if p.activation.gated:
        up, gate = split_up_gate(acc1)
        return p.activation.apply(up, gate)
    return p.activation.apply(None, acc1)


def quantize_fc2_input(p: MoEProblem, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Semantics §2.4: the values GEMM2 consumes (fp32) and, in per-token mode, the row scale pts2."""
    if p.quant_mode == "w4a16":
        return h.to(torch.bfloat16).float(), None
    if p.quant_mode == "w4a8":
        q = mxfp8_quantize(h)
        return mxfp8_dequantize(q.data, q.scale), None
    if p.per_token_scale is not None:
        q = nvfp4_quantize_per_token(h.to(torch.bfloat16).float(), float(p.fc2_input_scale[0]))
        return nvfp4_dequantize(q.data, q.scale), q.row_scale
    q = nvfp4_quantize_fc2_input(h, p.fc2_input_scale)
    return nvfp4_dequantize(q.data, q.scale), None


def expert_outputs(p: MoEProblem, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot bf16 expert outputs y [T, K, H] (router weight folded in for fused finalize) and a valid mask."""
    T, K, H = p.num_tokens, p.top_k, p.hidden_size
    x = dequantize_input(p)
    y = torch.zeros(T * K, H, dtype=torch.bfloat16, device=p.device)
    valid = (routing.expanded_to_permuted >= 0).reshape(-1)
    starts = routing.expert_offsets.tolist()
    for expert, count in enumerate(routing.expert_counts.tolist()):
        if count == 0:
            continue
        expanded = routing.permuted_to_expanded[starts[expert]:starts[expert] + count].long()
        tokens = expanded // K
        s1 = p.w1_alpha[expert].expand(count)
        if p.per_token_scale is not None:
            s1 = s1 * p.per_token_scale[tokens]
        h = activate(p, s1[:, None] * gemm1(p, x[tokens], expert))
        h_q, pts2 = quantize_fc2_input(p, h)
        acc2 = gemm2(p, h_q, expert)
        a = p.w2_alpha[expert]
        if p.use_fused_finalize:
            r = p.token_final_scales.reshape(-1)[expanded]
            scale = a * (r * pts2 if pts2 is not None else r)
        else:
            scale = a * pts2 if pts2 is not None else a.expand(count)
        y[expanded] = (scale[:, None] * acc2).to(torch.bfloat16)
    return y.reshape(T, K, H), valid.reshape(T, K)


def finalize(p: MoEProblem, y: torch.Tensor, valid: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Semantics §2.6. Fused: bf16 running sum of bf16 contributions (slot order here; any order on the GPU).
    Deterministic: fp32 sum over ascending k of bf16 outputs times router weights, rounded once to bf16."""
    if p.use_fused_finalize:
        acc = torch.zeros(out.shape, dtype=torch.bfloat16, device=out.device)
        for k in range(p.top_k):
            acc = torch.where(valid[:, k, None], (acc.float() + y[:, k].float()).to(torch.bfloat16), acc)
        out.copy_(acc)
    else:
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for k in range(p.top_k):
            contribution = y[:, k].float() * p.token_final_scales[:, k, None]
            acc = torch.where(valid[:, k, None], acc + contribution, acc)
        out.copy_(acc.to(out.dtype))
    return out


def reference_moe(p: MoEProblem, routing: Routing | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full forward of a validated problem; writes into `out` (or p.moe_output, or a new tensor)."""
    if routing is None:
        routing = compute_routing(p.token_selected_experts, p.num_local_experts, p.local_expert_offset,
                                  p.tile_size)
    if out is None:
        out = p.moe_output[:p.num_tokens] if p.moe_output is not None else torch.empty(
            p.num_tokens, p.hidden_size, dtype=p.output_dtype, device=p.device)
    if p.num_tokens == 0:
        return out
    y, valid = expert_outputs(p, routing)
    return finalize(p, y, valid, out)
