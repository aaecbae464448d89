"""`torch.ops.moe.fused`: the fused MoE as a torch.library custom op, usable inside torch.compile graphs.

The op is functional (it returns a new [T, H] tensor); the fake implementation only derives the output shape,
so the compiler traces through it without running it. Tactics are flat int lists; localized shards are passed
as a flat list of 8 tensors (w1, w1_sf, w2, w2_sf of shard 0, then of shard 1).
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import cute_dsl_fused_moe
from .problem import LOCALIZED_KEYS


SCHEMA = (
    "(Tensor x, Tensor? x_sf, Tensor token_selected_experts, Tensor token_final_scales, Tensor w1_weight, "
    "Tensor w1_weight_sf, Tensor w1_alpha, Tensor? fc2_input_scale, Tensor w2_weight, Tensor w2_weight_sf, "
    "Tensor w2_alpha, int num_experts, int top_k, int? num_local_experts=None, int local_expert_offset=0, "
    "bool use_fused_finalize=True, bool enable_pdl=True, int activation_type=3, float swiglu_alpha=1., "
    "float swiglu_beta=0., float swiglu_limit=3.4028234663852886e+38, float? situ_beta=None, "
    "float? situ_linear_beta=None, str quant_mode=\"w4a4\", Tensor? per_token_scale=None, int[]? tactic=None, "
    "Tensor[]? localized_weights=None) -> Tensor"
)


@torch.library.custom_op("moe::fused", mutates_args=(), device_types=("cpu", "cuda"), schema=SCHEMA)
def fused(
    x: torch.Tensor,
    x_sf: Optional[torch.Tensor],
    token_selected_experts: torch.Tensor,
    token_final_scales: torch.Tensor,
    w1_weight: torch.Tensor,
    w1_weight_sf: torch.Tensor,
    w1_alpha: torch.Tensor,
    fc2_input_scale: Optional[torch.Tensor],
    w2_weight: torch.Tensor,
    w2_weight_sf: torch.Tensor,
    w2_alpha: torch.Tensor,
    num_experts: int,
    top_k: int,
    num_local_experts: Optional[int] = None,
    local_expert_offset: int = 0,
    use_fused_finalize: bool = True,
    enable_pdl: bool = True,
    activation_type: int = 3,
    swiglu_alpha: float = 1.0,
    swiglu_beta: float = 0.0,
    swiglu_limit: float = 3.4028234663852886e38,
    situ_beta: Optional[float] = None,
    situ_linear_beta: Optional[float] = None,
    quant_mode: str = "w4a4",
    per_token_scale: Optional[torch.Tensor] = None,
    tactic: Optional[list[int]] = None,
    localized_weights: Optional[list[torch.Tensor]] = None,
) -> torch.Tensor:
    shards = None
    if localized_weights is not None:
        if len(localized_weights) != 2 * len(LOCALIZED_KEYS):
            raise ValueError(f"localized_weights must hold {2 * len(LOCALIZED_KEYS)} tensors (4 per shard)")
        shards = [dict(zip(LOCALIZED_KEYS, localized_weights[i:i + 4])) for i in (0, 4)]
    return cute_dsl_fused_moe(
        x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale,
        w2_weight, w2_weight_sf, w2_alpha, num_experts, top_k, num_local_experts, local_expert_offset,
        use_fused_finalize=use_fused_finalize, enable_pdl=enable_pdl, activation_type=activation_type,
        swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit, situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta, quant_mode=quant_mode, per_token_scale=per_token_scale,
        tactic=None if tactic is None else tuple(tactic), localized_weights=shards,
    )


@fused.register_fake
def _(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale,
      w2_weight, w2_weight_sf, w2_alpha, num_experts, top_k, num_local_experts=None, local_expert_offset=0,
      use_fused_finalize=True, enable_pdl=True, activation_type=3, swiglu_alpha=1.0, swiglu_beta=0.0,
      swiglu_limit=3.4028234663852886e38, situ_beta=None, situ_linear_beta=None, quant_mode="w4a4",
      per_token_scale=None, tactic=None, localized_weights=None):
    # H is w2's output rows: x of w4a4 packs two values per byte, so x.shape[1] is not H in every mode.
    return x.new_empty((x.shape[0], w2_weight.shape[1]), dtype=torch.bfloat16)
