"""Quickstart: a small random MoE layer in bf16, quantized for each quant mode and run through the fused MoE.

Routing is DeepSeek-V3 style (sigmoid scores, group-limited top-k, renormalised, routed scaling). Prints the error
of each mode against the bf16 layer and the time per forward. Runs on the GPU when one is present, else on CPU
(the reference path: correct, not fast).
"""
import argparse
import time

import torch

import moe_ext
from moe_ext import ActivationType


def deepseek_routing(hidden, gate_w, bias, top_k, n_group, topk_group, routed_scale):
    scores = torch.sigmoid(hidden.float() @ gate_w.t())
    biased = scores + bias
    group_scores = biased.view(len(hidden), n_group, -1).topk(2, dim=-1).values.sum(-1)
    groups = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
    mask = mask.repeat_interleave(scores.shape[1] // n_group, dim=1)
    ids = biased.masked_fill(mask == 0, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * routed_scale
    return ids.to(torch.int32), weights.float()


def bf16_moe(x, ids, weights, w1, w2):
    """The layer in bf16 with fp32 accumulation: silu(gate) * up, down projection, weighted sum."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = x[rows].float() @ w1[e].float().t()
        up, gate = h[:, :inter], h[:, inter:]
        act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
        out.index_add_(0, rows, weights[rows, slots, None] * (act @ w2[e].float().t()))
    return out.to(torch.bfloat16)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    E, K, H, I = (64, 8, 2048, 768) if on_gpu else (32, 4, 512, 256)
    T = args.tokens or (256 if on_gpu else 32)
    torch.manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, device=device) * H ** -0.5).bfloat16()  # rows [up; gate]
    w2 = (torch.randn(E, H, I, device=device) * I ** -0.5).bfloat16()
    x = torch.randn(T, H, device=device).bfloat16()
    gate_w = torch.randn(E, H, device=device) * H ** -0.5
    bias = torch.randn(E, device=device) * 0.1
    ids, weights = deepseek_routing(x, gate_w, bias, K, n_group=8, topk_group=4, routed_scale=2.5)
    reference = bf16_moe(x, ids, weights, w1, w2).float()

    print(f"moe_ext {moe_ext.__version__} on {device} (torch {torch.__version__}); E={E} top_k={K} H={H} I={I} T={T}")
    print(f"{'mode':<12} {'rel. error vs bf16':>18} {'ms / forward':>13}")
    for mode, per_token in (("w4a16", False), ("w4a4", False), ("w4a4", True), ("w4a8", False)):
        gs_x = 2688.0 / float(x.float().abs().amax())
        prepared = moe_ext.prepare_moe_weights(w1.float(), w2.float(), mode, ActivationType.Swiglu,
                                               x_global_scale=gs_x, per_token_activation=per_token)
        act = moe_ext.quantize_activation(x.float(), mode, global_scale=gs_x, per_token=per_token)

        def forward():
            return moe_ext.cute_dsl_fused_moe(**act.kwargs(), token_selected_experts=ids, token_final_scales=weights,
                                              num_experts=E, top_k=K, **prepared.kwargs())

        out = forward()
        reps = 5
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            out = forward()
        if on_gpu:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / reps * 1e3
        err = float((out.float() - reference).norm() / reference.norm())
        name = mode + ("-token" if per_token else "")
        print(f"{name:<12} {err:>18.4f} {ms:>13.2f}")
        if not torch.isfinite(out).all() or err > 0.25:
            raise SystemExit(f"{name}: unexpected error {err}")


if __name__ == "__main__":
    main()
