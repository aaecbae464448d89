"""Expert parallelism across processes on torch.distributed (NCCL on GPUs, gloo on CPU).

Each of the W ranks holds E / W consecutive experts (rank r: [r*E/W, (r+1)*E/W)). A forward:
1. all-gathers every rank's tokens (activations in the quant mode's format, routing ids and weights), padded to
   the largest per-rank token count (padding rows route nowhere, so they contribute zero);
2. runs the fused MoE on the whole gathered batch with num_local_experts = E/W and local_expert_offset = r*E/W,
   so each rank adds exactly its own experts' contributions (semantics §2.7);
3. sums the partial outputs across ranks and hands each rank back the rows of its own tokens (reduce-scatter
   where the backend has it, all-reduce and a slice on gloo).

All-gather + reduce-scatter keeps every buffer's size a function of the largest per-rank T only, so a step can be
captured in a CUDA graph, and at decode sizes it moves a few rows per rank. All-to-all exchanges only the routed
rows and wins at large T; which to use where is to be decided by measurement on GPUs (issue 5).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .api import cute_dsl_fused_moe
from .quant.prepare import PreparedWeights, QuantizedActivation


# torch >= 2.13 renames the tensor collectives; 2.11 (the GPU machines) only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExpertParallelMoE(torch.nn.Module):
    """One rank's share of an expert-parallel MoE layer. `weights` are this rank's experts
    (`moe_ext.quant.slice_experts(full, rank * E // W, E // W)`); `activation_kwargs` are the fused-MoE activation
    arguments (activation_type, swiglu_*, situ_*)."""

    def __init__(self, weights: PreparedWeights, num_experts: int, top_k: int, group=None,
                 use_fused_finalize: bool = True, **activation_kwargs) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs an initialised torch.distributed process group")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"world size {self.world} must divide num_experts={num_experts}")
        self.num_local = num_experts // self.world
        if weights.w1_weight.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} must hold {self.num_local} experts (num_experts / world size), "
                             f"its weights have {weights.w1_weight.shape[0]}")
        self.weights = weights
        self.num_experts = num_experts
        self.top_k = top_k
        self.use_fused_finalize = use_fused_finalize
        self.activation_kwargs = {"activation_type": weights.activation_type, **activation_kwargs}

    def _gather(self, t: torch.Tensor | None, rows: int, fill) -> torch.Tensor | None:
        """All ranks' [rows_r, ...] tensors, each padded to `rows` with `fill`, stacked into [W * rows, ...]."""
        if t is None:
            return None
        fp8 = t.dtype == torch.float8_e4m3fn  # collectives move fp8 activations as their bytes
        send = t.view(torch.uint8) if fp8 else t
        padded = send.new_full((rows, *send.shape[1:]), fill)
        padded[:t.shape[0]] = send
        out = padded.new_empty((self.world * rows, *send.shape[1:]))
        _all_gather(out, padded, group=self.group)
        return out.view(torch.float8_e4m3fn) if fp8 else out

    def forward(self, activation: QuantizedActivation, token_selected_experts: torch.Tensor,
                token_final_scales: torch.Tensor) -> torch.Tensor:
        num_tokens = token_selected_experts.shape[0]
        counts = torch.tensor([num_tokens], dtype=torch.int64, device=token_selected_experts.device)
        all_counts = counts.new_empty(self.world)
        _all_gather(all_counts, counts, group=self.group)
        rows = int(all_counts.max())
        ids = self._gather(token_selected_experts.to(torch.int32), rows, -1)
        scales = self._gather(token_final_scales, rows, 0.0)
        x = self._gather(activation.x, rows, 0)
        x_sf = self._gather(activation.x_sf, rows, 0)
        per_token_scale = self._gather(activation.per_token_scale, rows, 0.0)
        w = self.weights
        partial = cute_dsl_fused_moe(
            x, x_sf, ids, scales, w.w1_weight, w.w1_weight_sf, w.w1_alpha, w.fc2_input_scale, w.w2_weight,
            w.w2_weight_sf, w.w2_alpha, self.num_experts, self.top_k, self.num_local, self.rank * self.num_local,
            use_fused_finalize=self.use_fused_finalize, quant_mode=w.quant_mode, per_token_scale=per_token_scale,
            **self.activation_kwargs)
        # Partial sums are added in fp32 across ranks, then rounded once.
        partial = partial.float()
        if dist.get_backend(self.group) == "nccl":
            mine = partial.new_empty((rows, partial.shape[1]))
            _reduce_scatter(mine, partial, group=self.group)
        else:
            dist.all_reduce(partial, group=self.group)
            mine = partial[self.rank * rows:(self.rank + 1) * rows]
        return mine[:num_tokens].to(torch.bfloat16)
