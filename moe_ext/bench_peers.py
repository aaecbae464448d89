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


def triton_kernels_unavailable() -> str | None:
    """Why triton_kernels' matmul_ogs cannot be used here, or None when it imports."""
    try:
        import triton_kernels.matmul_ogs  # noqa: F401
        import triton_kernels.routing  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any import failure means: skip this peer)
        return f"import triton_kernels failed: {type(exc).__name__}: {exc}"
    return None


class TritonKernelsMxfp4:
    """triton_kernels' fused MoE: routing from the router logits, `matmul_ogs` GEMM1 with the SwiGLU fused and
    the gather of token rows, `matmul_ogs` GEMM2 with the scatter and router weights; MXFP4 weights (e2m1 +
    ue8m0 per 32 along K) in the Hopper swizzled layout, bf16 activations.

    triton_kernels changes its API between releases; this follows the matmul_ogs / routing API of Triton 3.4-3.5
    (the one vLLM pins) and tolerates the renamed fields of later ones. It has not been run here (no GPU, no
    triton_kernels); any failure is recorded by the benchmark as that point's error. Its SwiGLU is gpt-oss's form
    (`(up + 1)`), used for plain-SwiGLU shapes too: the cost is the same.
    """

    def __init__(self, w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 top_k: int, activation: Activation) -> None:
        """w1 [E, H/2, 2I] and w2 [E, I/2, H] packed e2m1 (K-major, as triton_kernels takes W[K, N]); scales
        [E, H/32, 2I] and [E, I/32, H] ue8m0 codes."""
        reason = triton_kernels_unavailable()
        if reason:
            raise PeerUnavailable(reason)
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.swiglu import swiglu_fn

        self._matmul_ogs, self._routing, self.top_k = matmul_ogs, routing, top_k
        self.w1, scale1 = self._hopper_layout(w1, w1_scale)
        self.w2, scale2 = self._hopper_layout(w2, w2_scale)
        scale_field = "weight_scale" if "weight_scale" in PrecisionConfig.__dataclass_fields__ else "b_mx_scale"
        flex = FlexCtx(rhs_data=InFlexData())
        self.pc1 = PrecisionConfig(flex_ctx=flex, **{scale_field: scale1})
        self.pc2 = PrecisionConfig(flex_ctx=flex, **{scale_field: scale2})
        limit = activation.swiglu_limit if activation.swiglu_limit < FLT_MAX else None
        args = (activation.swiglu_alpha, limit)
        try:  # Triton 3.4-3.5: reduction_n on FusedActivation
            self.act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), args, 2)
        except TypeError:  # later: reduction_n on FnSpecs
            self.act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2), args)

    @staticmethod
    def _hopper_layout(packed: torch.Tensor, scale: torch.Tensor):
        """Wrap packed weights and scales in the swizzled layouts triton_kernels' Hopper MXFP4 kernels read."""
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        return (convert_layout(wrap_torch_tensor(packed, dtype=FP4), value_layout, **value_opts),
                convert_layout(wrap_torch_tensor(scale), scale_layout, **scale_opts))

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, logits [T, E] fp32 -> [T, H] bf16. triton_kernels' routing takes the top-k of the
        logits and softmaxes them, which is the renormalised top-k softmax the other impls are given."""
        routing_data, gather, scatter = self._routing(logits, self.top_k)[:3]
        h = self._matmul_ogs(x, self.w1, None, routing_data, gather_indx=gather, precision_config=self.pc1,
                             fused_activation=self.act)
        return self._matmul_ogs(h, self.w2, None, routing_data, scatter_indx=scatter, precision_config=self.pc2,
                                gammas=routing_data.gate_scal)
