"""Swap Hugging Face transformers MoE blocks for the fused 4-bit MoE (transformers 5.x block layout).

transformers 5 stores a block's experts as 3-D tensors: `experts.gate_up_proj` [E, 2I, H] (gate rows first, then
up) and `experts.down_proj` [E, H, I], with a router `gate(hidden) -> (logits, weights, indices)`; DeepSeek-V3 adds
`shared_experts`. This covers Mixtral, Qwen3-MoE and DeepSeek-V3 (SiLU-gated experts). GPT-OSS experts carry
biases, which this API cannot express: converting one raises instead of dropping them.

The block keeps the model's own router and runs `torch.ops.moe.fused` on the quantized experts; activations are
quantized per call (w4a4: per-token NVFP4, which needs no calibration; w4a8: MXFP8; w4a16: bf16).
"""
from __future__ import annotations

import torch
from torch import nn

from ..activation import ActivationType
from ..quant.prepare import prepare_moe_weights, quantize_activation
from ..quant.swizzle import sf_bytes


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
            and (hasattr(module, "gate") or hasattr(module, "router")))


class FusedMoEBlock(nn.Module):
    """Drop-in replacement of one transformers MoE block: same router, experts through the fused 4-bit MoE."""

    def __init__(self, block: nn.Module, quant_mode: str = "w4a16", use_fused_finalize: bool = True) -> None:
        super().__init__()
        experts = block.experts
        biases = [n for n, _ in experts.named_parameters() if "bias" in n]
        if biases:
            raise ValueError(f"{type(block).__name__}: expert biases ({', '.join(biases)}) cannot be expressed by "
                             "cute_dsl_fused_moe (GPT-OSS style experts are not supported)")
        act = getattr(experts, "act_fn", None)
        if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"{type(block).__name__}: experts use {type(act).__name__}; only SiLU-gated experts "
                             "map onto ActivationType.Swiglu")
        self.router = block.gate if hasattr(block, "gate") else block.router
        self.shared_experts = getattr(block, "shared_experts", None)
        gate_up = experts.gate_up_proj.detach().float()
        inter = gate_up.shape[1] // 2
        # The API's FC1 is [up; gate]; transformers stores [gate; up].
        w1 = torch.cat((gate_up[:, inter:], gate_up[:, :inter]), dim=1)
        w2 = experts.down_proj.detach().float()
        self.quant_mode = quant_mode
        self.per_token = quant_mode == "w4a4"
        prepared = prepare_moe_weights(w1, w2, quant_mode, ActivationType.Swiglu, per_token_activation=self.per_token)
        self.num_experts = w1.shape[0]
        self.top_k = self.router.top_k
        self.use_fused_finalize = use_fused_finalize
        for name in ("w1_weight", "w1_alpha", "w2_weight", "w2_alpha"):
            self.register_buffer(name, getattr(prepared, name))
        for name in ("w1_weight_sf", "w2_weight_sf"):
            view = getattr(prepared, name)
            self.register_buffer(name, sf_bytes(view, view.numel()).clone())
        self.register_buffer("fc2_input_scale", prepared.fc2_input_scale)

    # Per-expert alphas and the FC2 input scale stay fp32 (the kernels read fp32 scales): `model.to(bfloat16)`
    # moves them to the new device but must not round them.
    _FP32_BUFFERS = ("w1_alpha", "w2_alpha", "fc2_input_scale")

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self._FP32_BUFFERS if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            setattr(self, name, value.to(getattr(self, name).device))
        return self

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.router(flat)
        act = quantize_activation(flat.float(), self.quant_mode, per_token=self.per_token)
        out = torch.ops.moe.fused(
            act.x, act.x_sf, ids.to(torch.int32), weights.float(), self.w1_weight, self.w1_weight_sf, self.w1_alpha,
            self.fc2_input_scale, self.w2_weight, self.w2_weight_sf, self.w2_alpha, self.num_experts, self.top_k,
            use_fused_finalize=self.use_fused_finalize, quant_mode=self.quant_mode,
            per_token_scale=act.per_token_scale)
        out = out.to(hidden_states.dtype).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def swap_moe_blocks(model: nn.Module, quant_mode: str = "w4a16", use_fused_finalize: bool = True) -> int:
    """Replace every transformers MoE block of `model` in place; returns how many were swapped."""
    targets = [(name, module) for name, module in model.named_modules() if _is_moe_block(module)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FusedMoEBlock(module, quant_mode, use_fused_finalize))
    return len(targets)
