"""`cute_dsl_fused_moe`: FlashInfer's functional fused-MoE API, parameter for parameter."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .backends import backend_for, select_tactic
from .problem import build_problem


def _check_stream(name: str, stream) -> None:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"{name} must be a torch.cuda.Stream or None, got {type(stream).__name__}")


def cute_dsl_fused_moe(
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
    output_dtype: torch.dtype = torch.bfloat16,
    use_fused_finalize: bool = True,
    moe_output: Optional[torch.Tensor] = None,
    aux_stream: Optional[torch.cuda.Stream] = None,
    enable_pdl: bool = True,
    activation_type: int = 3,
    swiglu_alpha: float = 1.0,
    swiglu_beta: float = 0.0,
    swiglu_limit: float = 3.4028234663852886e38,
    situ_beta: Optional[float] = None,
    situ_linear_beta: Optional[float] = None,
    *,
    quant_mode: str = "w4a4",
    per_token_scale: Optional[torch.Tensor] = None,
    tactic: Optional[Tuple] = None,
    localized_weights: Optional[list] = None,
    localized_streams: Optional[list] = None,
    localized_sm_count: Optional[int] = None,
    localized_memset_stream: Optional[torch.cuda.Stream] = None,
    localized_allow_nonlocalized: bool = False,
    autotune_use_cuda_graph: bool = False,
) -> torch.Tensor:
    """Fused MoE forward with 4-bit block-scaled weights (FlashInfer's `cute_dsl_fused_moe` contract).

    quant_mode "w4a4": NVFP4 x (uint8 [T, H/2]) with linear e4m3 x_sf [T, H/16]; "w4a8": MXFP8 x
    (float8_e4m3fn [T, H]) with ue8m0 x_sf [T, H/32]; "w4a16": bf16 x and x_sf=None. Weights are packed e2m1
    [E, N1, H/2] / [E, H, I/2] with 128x4-swizzled scales (NVFP4 for w4a4/w4a16, MXFP4 for w4a8); gated w1 rows
    are interleaved in 64-row up/gate groups. Returns [num_tokens, hidden_size] (a view of moe_output if given).
    Every argument is validated before any work; see README for the formats and the semantics spec.
    """
    problem = build_problem(
        x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale,
        w2_weight, w2_weight_sf, w2_alpha, num_experts, top_k, num_local_experts, local_expert_offset,
        output_dtype, use_fused_finalize, moe_output, activation_type, swiglu_alpha, swiglu_beta, swiglu_limit,
        situ_beta, situ_linear_beta, quant_mode=quant_mode, per_token_scale=per_token_scale,
        localized_weights=localized_weights, localized_streams=localized_streams,
        localized_sm_count=localized_sm_count, localized_memset_stream=localized_memset_stream,
        localized_allow_nonlocalized=localized_allow_nonlocalized,
    )
    _check_stream("aux_stream", aux_stream)
    if not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be a bool, got {type(enable_pdl).__name__}")
    if not isinstance(autotune_use_cuda_graph, bool):
        raise TypeError(f"autotune_use_cuda_graph must be a bool, got {type(autotune_use_cuda_graph).__name__}")
    if tactic is not None and not isinstance(tactic, (tuple, list)):
        raise TypeError(f"tactic must be a tuple or None, got {type(tactic).__name__}")
    problem.enable_pdl = enable_pdl
    problem.aux_stream = aux_stream
    out = (problem.moe_output[:problem.num_tokens] if problem.moe_output is not None else
           torch.empty(problem.num_tokens, problem.hidden_size, dtype=problem.output_dtype, device=problem.device))
    backend = backend_for(problem)
    chosen = select_tactic(problem, backend, tactic, "cute_dsl_fused_moe", out, None, autotune_use_cuda_graph)
    return backend.run(problem, chosen, out)
