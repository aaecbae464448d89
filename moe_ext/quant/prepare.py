"""From bf16 expert weights and activations to the exact tensors the fused-MoE API consumes (semantics §1.6).

Global-scale conventions: the kernels never divide by a global scale, so the alphas fold them in:
w4a4 w1_alpha = 1/(gs_x * gs_w1[e]) and w2_alpha = 1/(fc2_input_scale * gs_w2[e]); w4a4 with per-token
activations and w4a16 use 1/gs_w; w4a8 (MX formats) has no global scale and alphas of one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block import (E2M1_MAX, E4M3_MAX, mxfp4_quantize, mxfp8_quantize, nvfp4_quantize, nvfp4_quantize_per_token,
                    sf_block)
from .interleave import interleave_up_gate
from .swizzle import mma_view, sf_bytes, swizzle_sf, swizzled_size, unswizzle_sf

NVFP4_GLOBAL_RANGE = E4M3_MAX * E2M1_MAX  # 2688: gs = 2688 / amax maps the tensor max onto the NVFP4 range
PER_TOKEN_GLOBAL_SCALE_INV = 1.0 / NVFP4_GLOBAL_RANGE


def nvfp4_global_scale(t: torch.Tensor, dims=None) -> torch.Tensor:
    """gs = 2688 / amax (over `dims`, all when None); 1 where amax is 0."""
    amax = t.float().abs().amax(dim=dims) if dims is not None else t.float().abs().amax()
    return torch.where(amax > 0, NVFP4_GLOBAL_RANGE / amax, torch.ones_like(amax))


@dataclass
class PreparedWeights:
    """Kernel-ready weights of one layer; `kwargs()` gives the matching cute_dsl_fused_moe keyword arguments."""

    quant_mode: str
    w1_weight: torch.Tensor
    w1_weight_sf: torch.Tensor  # 6-D MMA view of the swizzled bytes
    w1_alpha: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_sf: torch.Tensor
    w2_alpha: torch.Tensor
    fc2_input_scale: torch.Tensor | None
    x_global_scale: float | None  # gs_x the activations must be quantized with (w4a4 per-tensor)
    per_token_activation: bool
    activation_type: int

    def to(self, device) -> "PreparedWeights":
        """A copy on `device`; the scale factors stay 6-D MMA views of their (moved) bytes."""
        import dataclasses

        block = sf_block(self.quant_mode)
        moved = {}
        for name in ("w1", "w2"):
            packed = getattr(self, f"{name}_weight")
            experts, rows, half_cols = packed.shape
            view = getattr(self, f"{name}_weight_sf")
            flat = sf_bytes(view, view.numel()).to(device)
            moved[f"{name}_weight"] = packed.to(device)
            moved[f"{name}_weight_sf"] = mma_view(flat, experts, rows, 2 * half_cols // block)
            moved[f"{name}_alpha"] = getattr(self, f"{name}_alpha").to(device)
        if self.fc2_input_scale is not None:
            moved["fc2_input_scale"] = self.fc2_input_scale.to(device)
        return dataclasses.replace(self, **moved)

    def kwargs(self) -> dict:
        return dict(w1_weight=self.w1_weight, w1_weight_sf=self.w1_weight_sf, w1_alpha=self.w1_alpha,
                    fc2_input_scale=self.fc2_input_scale, w2_weight=self.w2_weight, w2_weight_sf=self.w2_weight_sf,
                    w2_alpha=self.w2_alpha, quant_mode=self.quant_mode, activation_type=self.activation_type)


def _quantize_weight(w: torch.Tensor, quant_mode: str):
    """[E, R, C] float -> (packed [E, R, C/2], swizzled 6-D scale view, global scale [E] or None)."""
    num_experts, rows, cols = w.shape
    if quant_mode == "w4a8":
        q, gs = mxfp4_quantize(w), None
    else:
        gs = nvfp4_global_scale(w, dims=(1, 2))
        q = nvfp4_quantize(w, gs)
    view = mma_view(swizzle_sf(q.scale), num_experts, rows, cols // sf_block(quant_mode))
    return q.data, view, gs


def prepare_moe_weights(
    w1: torch.Tensor,
    w2: torch.Tensor,
    quant_mode: str = "w4a4",
    activation_type: int = 3,
    *,
    x_global_scale: float = 1.0,
    fc2_input_scale: float | None = None,
    per_token_activation: bool = False,
) -> PreparedWeights:
    """Quantize bf16 expert weights for `quant_mode`.

    w1: [E, 2I, H] with rows [up; gate] for gated activations (interleaved here), or [E, I, H] for Relu2.
    w2: [E, H, I]. activation_type: Swiglu (3, default), GegluTanh (8) or Relu2 (6). `x_global_scale` (gs_x) and `fc2_input_scale` are the w4a4 per-tensor encode scales the
    activations and the FC2 input are quantized with (use 2688/amax from calibration; 1.0 matches FlashInfer's
    tests; the default is 1.0). With `per_token_activation`, fc2_input_scale is the per-row global_scale_inv
    (default 1/2688).
    """
    # Imported here: the activation and problem modules import this package.
    from ..activation import ActivationType
    from ..problem import canonical_quant_mode

    quant_mode = canonical_quant_mode(quant_mode)
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 and w2 must be 3-D [E, N1, H] and [E, H, I], got {tuple(w1.shape)}, {tuple(w2.shape)}")
    gated = int(activation_type) != ActivationType.Relu2
    num_experts, n1, hidden = w1.shape
    inter = n1 // 2 if gated else n1
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must have shape {(num_experts, hidden, inter)} to match w1 {tuple(w1.shape)}, "
                         f"got {tuple(w2.shape)}")
    if per_token_activation and quant_mode != "w4a4":
        raise ValueError("per_token_activation is only defined for quant_mode='w4a4'")
    physical_w1 = interleave_up_gate(w1, dim=1) if gated else w1
    w1_q, w1_sf, gs_w1 = _quantize_weight(physical_w1, quant_mode)
    w2_q, w2_sf, gs_w2 = _quantize_weight(w2, quant_mode)
    device = w1.device
    fc2_scale = None
    x_gs = None
    if quant_mode == "w4a8":
        w1_alpha = torch.ones(num_experts, dtype=torch.float32, device=device)
        w2_alpha = torch.ones(num_experts, dtype=torch.float32, device=device)
    elif quant_mode == "w4a16" or per_token_activation:
        w1_alpha, w2_alpha = 1.0 / gs_w1, 1.0 / gs_w2
        if per_token_activation:
            if fc2_input_scale is None:
                fc2_input_scale = PER_TOKEN_GLOBAL_SCALE_INV
            fc2_scale = torch.tensor([fc2_input_scale], dtype=torch.float32, device=device)
    else:
        x_gs = float(x_global_scale)
        fc2_input_scale = 1.0 if fc2_input_scale is None else fc2_input_scale
        w1_alpha = 1.0 / (torch.tensor(x_gs, dtype=torch.float32, device=device) * gs_w1)
        fc2_scale = torch.tensor([fc2_input_scale], dtype=torch.float32, device=device)
        w2_alpha = 1.0 / (fc2_scale * gs_w2)
    return PreparedWeights(quant_mode, w1_q, w1_sf, w1_alpha.float(), w2_q, w2_sf, w2_alpha.float(), fc2_scale,
                           x_gs, per_token_activation, int(activation_type))


@dataclass
class QuantizedActivation:
    x: torch.Tensor
    x_sf: torch.Tensor | None  # linear [T, H/block]
    per_token_scale: torch.Tensor | None = None

    def kwargs(self) -> dict:
        out = dict(x=self.x, x_sf=self.x_sf)
        if self.per_token_scale is not None:
            out["per_token_scale"] = self.per_token_scale
        return out


def quantize_activation(x: torch.Tensor, quant_mode: str, *, global_scale: float = 1.0,
                        per_token: bool = False,
                        global_scale_inv: float = PER_TOKEN_GLOBAL_SCALE_INV) -> QuantizedActivation:
    """bf16 activations [T, H] -> the x / x_sf (/ per_token_scale) a quant mode takes.

    w4a4: NVFP4 with the per-tensor encode scale gs_x (`global_scale`), or per token with `global_scale_inv`;
    w4a8: MXFP8; w4a16: x unchanged (bf16).
    """
    from ..problem import canonical_quant_mode

    quant_mode = canonical_quant_mode(quant_mode)
    if quant_mode == "w4a16":
        return QuantizedActivation(x.to(torch.bfloat16).contiguous(), None)
    if quant_mode == "w4a8":
        q = mxfp8_quantize(x)
        return QuantizedActivation(q.data.contiguous(), q.scale.contiguous())
    if per_token:
        q = nvfp4_quantize_per_token(x, global_scale_inv)
        return QuantizedActivation(q.data.contiguous(), q.scale.contiguous(), q.row_scale.contiguous())
    q = nvfp4_quantize(x, global_scale)
    return QuantizedActivation(q.data.contiguous(), q.scale.contiguous())


def slice_experts(prepared: PreparedWeights, start: int, count: int) -> PreparedWeights:
    """The weights of experts [start, start + count): what one expert-parallel rank holds. Each expert's
    swizzled scales are a contiguous block, so the slice is a byte range of the scale buffer."""
    import dataclasses

    num_experts = prepared.w1_weight.shape[0]
    if not (0 <= start and count >= 1 and start + count <= num_experts):
        raise ValueError(f"experts [{start}, {start + count}) are not within the layer's {num_experts} experts")
    block = sf_block(prepared.quant_mode)
    sliced = {}
    for name in ("w1", "w2"):
        packed = getattr(prepared, f"{name}_weight")
        _, rows, half_cols = packed.shape
        sf_cols = 2 * half_cols // block
        per_expert = swizzled_size(1, rows, sf_cols)
        flat = sf_bytes(getattr(prepared, f"{name}_weight_sf"), num_experts * per_expert)
        sliced[f"{name}_weight"] = packed[start:start + count].contiguous()
        sliced[f"{name}_weight_sf"] = mma_view(flat[start * per_expert:(start + count) * per_expert].clone(), count,
                                               rows, sf_cols)
        sliced[f"{name}_alpha"] = getattr(prepared, f"{name}_alpha")[start:start + count].contiguous()
    return dataclasses.replace(prepared, **sliced)


def split_localized_shards(prepared: PreparedWeights, pools: list | None = None) -> list[dict]:
    """Split prepared weights into the two locality-domain shards of semantics §4.

    FC1: contiguous halves of the (interleaved) rows, i.e. intermediate columns [0, I/2) and [I/2, I).
    FC2: halves of the output (hidden) rows, full reduction dim. Scales are split unswizzled and re-swizzled.
    `pools`: one torch.cuda.MemPool per domain; shard d's tensors are allocated inside pools[d]
    (`moe_ext.streams.LocalityDomains` makes them).
    """
    import contextlib

    block = sf_block(prepared.quant_mode)
    shards: list[dict] = [{}, {}]
    for name in ("w1", "w2"):
        packed = getattr(prepared, f"{name}_weight")
        num_experts, rows, half_cols = packed.shape
        if rows % 256:
            raise ValueError(f"{name}_weight has {rows} rows; each localized shard needs a multiple of 128")
        sf_cols = 2 * half_cols // block
        linear_sf = unswizzle_sf(getattr(prepared, f"{name}_weight_sf"), num_experts, rows, sf_cols)
        half = rows // 2
        for d in range(2):
            with torch.cuda.use_mem_pool(pools[d]) if pools is not None else contextlib.nullcontext():
                shard_sf = linear_sf[:, d * half:(d + 1) * half].contiguous()
                shards[d][f"{name}_weight"] = packed[:, d * half:(d + 1) * half].contiguous()
                shards[d][f"{name}_weight_sf"] = mma_view(swizzle_sf(shard_sf), num_experts, half, sf_cols)
    return shards
