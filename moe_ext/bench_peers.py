"""The peers `moe_ext.bench` times moe_ext against, on the same routing.

- `grouped_mm_moe`: the bf16 MoE a user writes today with PyTorch alone (sort slots by expert, gather rows,
  `torch._grouped_mm`, SwiGLU, grouped GEMM2, router weight, `index_add_`).
- `TritonKernelsMxfp4`: triton_kernels' `matmul_ogs` with MXFP4 weights and bf16 activations (the gpt-oss path
  of vLLM and transformers), used only where `import triton_kernels` works.

Both are capture-safe (no host synchronisation, fixed shapes per T), so the benchmark times them by CUDA-graph
replay exactly like moe_ext. The routing helpers below are also what the benchmark counts bytes and FLOPs from,
so the peers and the byte model see one definition of "slot routed to a local expert".
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .activation import Activation
from .quant.formats import FLT_MAX


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (library missing, shape it cannot express): the point is skipped, not failed."""


def route_buckets(ids: torch.Tensor, num_local: int, local_offset: int) -> torch.Tensor:
    """Flat int64 [T*K]: each slot's local expert, or `num_local` for a slot routed to another rank's expert.

    Routing non-local slots into one extra bucket keeps every shape fixed (no boolean masking), which is what
    lets the composite be captured in a CUDA graph.
    """
    local = ids.reshape(-1).to(torch.int64) - local_offset
    is_local = (local >= 0) & (local < num_local)
    return torch.where(is_local, local, torch.full_like(local, num_local))


def bucket_counts(buckets: torch.Tensor, num_local: int) -> torch.Tensor:
    """int64 [num_local + 1]: slots per bucket (the last bucket holds the non-local slots).

    scatter_add_ rather than torch.bincount: bincount reads the input's maximum back to the host, which a CUDA
    graph capture forbids.
    """
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=buckets.device)
    return counts.scatter_add_(0, buckets, torch.ones_like(buckets))


def peer_swiglu(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """SwiGLU as a model's own PyTorch code writes it, on GEMM1 output columns [up | gate].

    Plain SwiGLU is `silu(gate) * up` (two kernels); the gpt-oss variant clamps both halves and uses
    `gate * sigmoid(alpha * gate) * (up + beta)`. Written out here rather than through
    `Activation.apply` (the fp32 specification) so the peer pays what a user's code pays, no more.
    """
    if activation.kind != "swiglu":
        raise PeerUnavailable(f"the bf16 composite is written for SwiGLU, not {activation.kind}")
    inter = h.shape[-1] // 2
    up, gate = h[:, :inter], h[:, inter:]
    if activation.swiglu_limit < FLT_MAX:  # FLT_MAX is the API's "no limit"
        gate = gate.clamp(max=activation.swiglu_limit)
        up = up.clamp(-activation.swiglu_limit, activation.swiglu_limit)
    glu = F.silu(gate) if activation.swiglu_alpha == 1.0 else gate * torch.sigmoid(activation.swiglu_alpha * gate)
    return glu * (up + activation.swiglu_beta) if activation.swiglu_beta else glu * up


def grouped_mm_moe(x: torch.Tensor, ids: torch.Tensor, router_weights: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, local_offset: int, activation: Activation) -> torch.Tensor:
    """bf16 MoE forward with torch._grouped_mm: x [T, H] bf16, ids / router_weights [T, K], w1 [E, 2I, H] with
    rows [up; gate] and w2 [E, H, I] (the nn.Linear layout of a checkpoint). Returns [T, H] bf16.

    Slots are sorted by local expert (stable, so each expert's rows keep token order), non-local slots last.
    `_grouped_mm` leaves rows past the last offset unwritten, so those slots are added into a scratch row T
    that is dropped, instead of being masked (which would need their count on the host).
    """
    num_tokens, top_k = ids.shape
    num_local = w1.shape[0]
    buckets = route_buckets(ids, num_local, local_offset)
    order = torch.argsort(buckets, stable=True)
    offsets = torch.cumsum(bucket_counts(buckets, num_local)[:num_local], 0).to(torch.int32)
    token = order // top_k
    rows = x.index_select(0, token)
    h = torch._grouped_mm(rows, w1.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(peer_swiglu(h, activation), w2.transpose(1, 2), offs=offsets)
    y = y * router_weights.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    destination = torch.where(buckets[order] < num_local, token, torch.full_like(token, num_tokens))
    out = torch.zeros(num_tokens + 1, x.shape[1], dtype=y.dtype, device=x.device)
    return out.index_add_(0, destination, y)[:num_tokens]


def _triton_kernels_api() -> SimpleNamespace:
    """The triton_kernels names this peer calls, as the Triton 3.6 release spells them (routing through `topk` and
    ragged-tensor metadata; `triton_kernels.routing` is gone). Raises ImportError where one is missing."""
    from triton_kernels.matmul_ogs import (FnSpecs, FusedActivation, GatherIndx, PrecisionConfig, RoutingData,
                                           ScatterIndx, matmul_ogs)
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import FP4, convert_layout, make_ragged_tensor_metadata, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    from triton_kernels.topk import topk
    return SimpleNamespace(
        FnSpecs=FnSpecs, FusedActivation=FusedActivation, GatherIndx=GatherIndx, PrecisionConfig=PrecisionConfig,
        RoutingData=RoutingData, ScatterIndx=ScatterIndx, matmul_ogs=matmul_ogs, swiglu_fn=swiglu_fn, FP4=FP4,
        convert_layout=convert_layout, make_ragged_tensor_metadata=make_ragged_tensor_metadata,
        wrap_torch_tensor=wrap_torch_tensor, layout=layout, topk=topk)


def triton_kernels_unavailable() -> str | None:
    """Why triton_kernels' matmul_ogs cannot be used here, or None when it imports (with the API used below)."""
    try:
        _triton_kernels_api()
    except Exception as exc:  # noqa: BLE001  (any import failure means: skip this peer)
        return f"import triton_kernels failed: {type(exc).__name__}: {exc}"
    return None


class TritonKernelsMxfp4:
    """triton_kernels' fused MoE: routing from the router logits (`topk`), `matmul_ogs` GEMM1 with the SwiGLU fused
    and the gather of token rows, `matmul_ogs` GEMM2 with the scatter and router weights; MXFP4 weights (e2m1 +
    ue8m0 per 32 along K) in the swizzled layouts triton_kernels picks for the GPU (on Hopper: HopperMXValueLayout
    and HopperMXScaleLayout, the gpt-oss path), bf16 activations.

    triton_kernels changes its API between releases; this follows the one of Triton 3.6 (python/triton_kernels at
    the release/3.6.x branch point), the same calls as its own tests and bench_mlp.py. Its SwiGLU is gpt-oss's form
    (`(up + 1)`, on interleaved [gate, up] columns of GEMM1), used for plain-SwiGLU shapes too: the cost is the same.
    """

    def __init__(self, w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 top_k: int, activation: Activation, num_tokens: int | None = None) -> None:
        """w1 [E, H/2, 2I] and w2 [E, I/2, H] packed e2m1 along K (the even K element in the low nibble, as
        triton_kernels takes W[K, N]); scales [E, H/32, 2I] and [E, I/32, H] ue8m0 codes. `num_tokens`, where
        known, picks the warps the Hopper scale layout is swizzled for as bench_mlp.py does (4 up to 512 tokens,
        else 8, the value of its tests)."""
        reason = triton_kernels_unavailable()
        if reason:
            raise PeerUnavailable(reason)
        if activation.kind != "swiglu":
            raise PeerUnavailable(f"triton_kernels' fused activation is SwiGLU, not {activation.kind}")
        self._tk = tk = _triton_kernels_api()
        self.top_k = top_k
        num_warps = 4 if num_tokens is not None and num_tokens <= 512 else 8
        self.w1, scale1 = self._hopper_layout(tk, w1, w1_scale, num_warps)
        self.w2, scale2 = self._hopper_layout(tk, w2, w2_scale, num_warps)
        self.pc1 = tk.PrecisionConfig(weight_scale=scale1)  # out_dtype: that of x (bf16)
        self.pc2 = tk.PrecisionConfig(weight_scale=scale2)
        limit = activation.swiglu_limit if activation.swiglu_limit < FLT_MAX else None
        self.act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                      (activation.swiglu_alpha, limit))

    @staticmethod
    def _hopper_layout(tk: SimpleNamespace, packed: torch.Tensor, scale: torch.Tensor, num_warps: int):
        """K-major copies of packed weights [E, K/2, N] and scales [E, K/32, N] (matmul_ogs reads MXFP4 weights
        column-major, and `wrap_torch_tensor` doubles the contiguous dim of packed data), in the layouts
        triton_kernels picks for this GPU (on sm_90: HopperMXValueLayout, HopperMXScaleLayout, mx_axis 1)."""
        value_layout, value_opts = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)

        def k_major(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).contiguous().transpose(1, 2)

        return (tk.convert_layout(tk.wrap_torch_tensor(k_major(packed), dtype=tk.FP4), value_layout, **value_opts),
                tk.convert_layout(tk.wrap_torch_tensor(k_major(scale)), scale_layout, **scale_opts))

    def route(self, logits: torch.Tensor):
        """(RoutingData, GatherIndx, ScatterIndx) from logits [T, E], as triton_kernels' tests build them: `topk`
        takes the top-k of the logits and softmaxes them (the renormalised top-k softmax the other impls are
        given); its bitmatrix metadata sorts the T*K slots by expert, and the router weights follow that order."""
        tk = self._tk
        sparse = tk.topk(logits, self.top_k)
        dispatch = sparse.mask_metadata.row_sorted_indx  # slot (token * K + k) -> its row in expert order
        combine = sparse.mask_metadata.col_sorted_indx  # row in expert order -> slot
        ragged = tk.make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
        gammas = sparse.vals.flatten()[combine]
        routing_data = tk.RoutingData(gammas, ragged.slice_sizes, logits.shape[-1], self.top_k, ragged)
        return routing_data, tk.GatherIndx(combine, dispatch), tk.ScatterIndx(dispatch, combine)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, logits [T, E] fp32 -> [T, H] bf16."""
        routing_data, gather, scatter = self.route(logits)
        h = self._tk.matmul_ogs(x, self.w1, None, routing_data, gather_indx=gather, precision_config=self.pc1,
                                fused_activation=self.act)
        return self._tk.matmul_ogs(h, self.w2, None, routing_data, scatter_indx=scatter, precision_config=self.pc2,
                                   gammas=routing_data.gate_scal)
