"""Expert parallelism across processes on torch.distributed (NCCL on GPUs, gloo on CPU).

Each of the W ranks holds E / W consecutive experts (rank r: [r*E/W, (r+1)*E/W)). A forward:
1. all-gathers every rank's tokens (activations in the quant mode's format, routing ids and weights), padded to
   the largest per-rank token count (padding rows route nowhere, so they contribute zero);
2. runs the fused MoE on the whole gathered batch with num_local_experts = E/W and local_expert_offset = r*E/W,
   so each rank adds exactly its own experts' contributions (semantics §2.7);
3. sums the partial outputs across ranks and hands each rank back the rows of its own tokens (reduce-scatter
   where the backend has it, all-reduce and a slice on gloo).

`exchange="all_to_all"` instead sends each token only to the ranks that hold one of its experts (with the ids of
the other ranks' experts masked to -1), runs the local experts on what it received, and sends each row's partial
sum back, where the source rank adds the partial sums of its tokens in fp32 and rounds once. It moves
T x (ranks hit per token) rows instead of T x W, but its split sizes are exchanged on the host (a sync per step, no
graph capture).

All-gather + reduce-scatter keeps every buffer's size a function of the largest per-rank T only. Given
`max_tokens_per_rank`, the layer pads to it instead of all-gathering the per-rank counts (which reads them on the
host), so a step has no host sync and can be captured in a CUDA graph; at decode sizes it moves a few rows per rank.
The default is all-gather, the capturable one, and on 2 x H200 it was also the faster at every measured T
(benchmarks/results/h200x2_expert_parallel.json, commands in h200_session4_checks.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .api import cute_dsl_fused_moe
from .quant.prepare import PreparedWeights, QuantizedActivation


# torch >= 2.13 renames the tensor collectives; 2.11 (the GPU machines) only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_from_torchrun() -> tuple[int, int, torch.device]:
    """Join the process group of a torchrun launch: (rank, world size, device). NCCL with one GPU per rank where
    there are enough GPUs, else gloo on the CPU (a one-GPU machine runs the CPU path)."""
    import os

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return rank, world, torch.device("cuda" if cuda else "cpu")


class ExpertParallelMoE(torch.nn.Module):
    """One rank's share of an expert-parallel MoE layer. `weights` are this rank's experts
    (`moe_ext.quant.slice_experts(full, rank * E // W, E // W)`); `activation_kwargs` are the fused-MoE activation
    arguments (activation_type, swiglu_*, situ_*)."""

    EXCHANGES = ("all_gather", "all_to_all")

    def __init__(self, weights: PreparedWeights, num_experts: int, top_k: int, group=None,
                 use_fused_finalize: bool = True, exchange: str = "all_gather",
                 max_tokens_per_rank: int | None = None, **activation_kwargs) -> None:
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
        if exchange not in self.EXCHANGES:
            raise ValueError(f"exchange must be one of {self.EXCHANGES}, got {exchange!r}")
        if max_tokens_per_rank is not None and (isinstance(max_tokens_per_rank, bool) or
                                                not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1):
            raise ValueError(f"max_tokens_per_rank must be a positive int or None, got {max_tokens_per_rank!r}")
        if max_tokens_per_rank is not None and exchange != "all_gather":
            raise ValueError("max_tokens_per_rank applies to exchange='all_gather' only")
        self.exchange = exchange
        self.max_tokens_per_rank = max_tokens_per_rank
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

    def _moe(self, x, x_sf, ids, scales, per_token_scale) -> torch.Tensor:
        """This rank's experts over the given rows: each row's local slots combined, bf16 [rows, H]."""
        w = self.weights
        return cute_dsl_fused_moe(
            x, x_sf, ids, scales, w.w1_weight, w.w1_weight_sf, w.w1_alpha, w.fc2_input_scale, w.w2_weight,
            w.w2_weight_sf, w.w2_alpha, self.num_experts, self.top_k, self.num_local, self.rank * self.num_local,
            use_fused_finalize=self.use_fused_finalize, quant_mode=w.quant_mode, per_token_scale=per_token_scale,
            **self.activation_kwargs)

    def forward(self, activation: QuantizedActivation, token_selected_experts: torch.Tensor,
                token_final_scales: torch.Tensor) -> torch.Tensor:
        if self.exchange == "all_to_all":
            return self._forward_all_to_all(activation, token_selected_experts, token_final_scales)
        num_tokens = token_selected_experts.shape[0]
        rows = self.max_tokens_per_rank
        if rows is None:
            counts = torch.tensor([num_tokens], dtype=torch.int64, device=token_selected_experts.device)
            all_counts = counts.new_empty(self.world)
            _all_gather(all_counts, counts, group=self.group)
            rows = int(all_counts.max())  # host sync
        elif num_tokens > rows:
            raise ValueError(f"token_selected_experts has {num_tokens} rows, more than max_tokens_per_rank={rows}")
        ids = self._gather(token_selected_experts.to(torch.int32), rows, -1)
        scales = self._gather(token_final_scales, rows, 0.0)
        x = self._gather(activation.x, rows, 0)
        x_sf = self._gather(activation.x_sf, rows, 0)
        per_token_scale = self._gather(activation.per_token_scale, rows, 0.0)
        partial = self._moe(x, x_sf, ids, scales, per_token_scale)
        # Partial sums are added in fp32 across ranks, then rounded once.
        partial = partial.float()
        if dist.get_backend(self.group) == "nccl":
            mine = partial.new_empty((rows, partial.shape[1]))
            _reduce_scatter(mine, partial, group=self.group)
        else:
            dist.all_reduce(partial, group=self.group)
            mine = partial[self.rank * rows:(self.rank + 1) * rows]
        return mine[:num_tokens].to(torch.bfloat16)

    def _exchange_rows(self, t: torch.Tensor | None, send_counts: list, recv_counts: list):
        """all_to_all of row blocks: rows [sum(send_counts), ...] ordered by destination -> [sum(recv_counts), ...]."""
        if t is None:
            return None
        fp8 = t.dtype == torch.float8_e4m3fn
        send = (t.view(torch.uint8) if fp8 else t).contiguous()
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, recv_counts, send_counts, group=self.group)
        return out.view(torch.float8_e4m3fn) if fp8 else out

    def _forward_all_to_all(self, activation: QuantizedActivation, token_selected_experts: torch.Tensor,
                            token_final_scales: torch.Tensor) -> torch.Tensor:
        ids = token_selected_experts.to(torch.int32)
        num_tokens, hidden = ids.shape[0], self.weights.w2_weight.shape[1]
        valid = (ids >= 0) & (ids < self.num_experts)
        owner = torch.where(valid, ids // self.num_local, -1)
        # One row per (token, destination rank holding one of its experts), grouped by destination.
        hit = torch.stack([(owner == r).any(dim=1) for r in range(self.world)])  # [W, T]
        dest, token = hit.nonzero(as_tuple=True)  # sorted by destination, then token
        send_counts = hit.sum(dim=1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()  # host sync: split sizes
        masked_ids = torch.where(owner[token] == dest[:, None], ids[token], -1)
        recv_ids = self._exchange_rows(masked_ids, send_counts, recv_counts)
        recv_scales = self._exchange_rows(token_final_scales[token], send_counts, recv_counts)
        recv_x = self._exchange_rows(activation.x[token], send_counts, recv_counts)
        recv_sf = self._exchange_rows(None if activation.x_sf is None else activation.x_sf[token], send_counts,
                                      recv_counts)
        recv_pts = self._exchange_rows(None if activation.per_token_scale is None else
                                       activation.per_token_scale[token], send_counts, recv_counts)
        if recv_ids.shape[0]:
            partial = self._moe(recv_x, recv_sf, recv_ids, recv_scales, recv_pts).float()
        else:
            partial = torch.empty((0, hidden), dtype=torch.float32, device=ids.device)
        back = self._exchange_rows(partial, recv_counts, send_counts)  # [rows sent, H], same order as `token`
        # Partial sums are added in fp32 in rank order, then rounded once (as the all-gather path does).
        out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=ids.device)
        out.index_add_(0, token, back)
        return out.to(torch.bfloat16)
