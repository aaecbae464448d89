"""GPU check of moe_ext.bench_peers.TritonKernelsMxfp4 (triton_kernels' matmul_ogs, MXFP4 weights, bf16
activations) against a plain torch MoE on the same MXFP4-dequantized weights and the same routing.

Run from the repo root on the H200 (no network needed):

    PYTHONPATH=$PWD:$PWD/.offline/triton_kernels_v3.6 python3 benchmarks/check_triton_kernels_peer.py

Each case is built exactly as moe_ext.bench.run_triton_kernels builds it (peer_point, random_mxfp4_kn_weights,
random_activations, random_routing's logits, TritonKernelsMxfp4(*weights, top_k, act)). It prints the relative L2
error of the eager output against the reference, and the largest difference of a CUDA-graph replay from the eager
output (the benchmark times graph replays). Exit status 1 if a case fails.
"""
from __future__ import annotations

import sys
import traceback

import torch

from moe_ext import bench
from moe_ext.bench_peers import TritonKernelsMxfp4, triton_kernels_unavailable
from moe_ext.quant.block import mxfp4_dequantize
from moe_ext.quant.formats import FLT_MAX

REL_TOL = 1e-2  # bf16 output + bf16 SwiGLU output; fp32 accumulation on both sides

# (name, H, I, E, top_k, T, activation, num_tokens hint passed to the class)
CASES = [
    ("small", 512, 256, 8, 2, 64, "swiglu", None),
    ("small-oai", 512, 256, 8, 2, 64, "swiglu_oai", None),
    ("small-oai-4warps", 512, 256, 8, 2, 64, "swiglu_oai", 64),
    ("T=1", 512, 256, 8, 2, 1, "swiglu", None),
    ("T=3 top4", 1024, 768, 16, 4, 3, "swiglu", None),
    ("gpt-oss dims (H=I=2880: Hopper layouts pad)", 2880, 2880, 8, 4, 48, "swiglu_oai", None),
]


def dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, K/2, N] e2m1 pairs (even K in the low nibble) and [E, K/32, N] ue8m0 -> [E, K, N] fp32: moe_ext's MXFP4
    decode along K."""
    return mxfp4_dequantize(packed.transpose(1, 2), scale.transpose(1, 2)).transpose(1, 2)


def reference(x, logits, w1, w2, top_k, act) -> torch.Tensor:
    """Renormalised top-k softmax routing; per expert h = x W1 (columns interleaved [gate, up], as triton_kernels'
    fused SwiGLU reads them), a = gate * sigmoid(alpha gate) * (up + 1) with the clamps, rounded to bf16 like
    GEMM1's output; y = a W2 times the router weight, summed over the k experts of a token."""
    probs, ids = torch.softmax(logits.float(), -1).topk(top_k, -1)
    weights = probs / probs.sum(-1, keepdim=True)
    limit = act.swiglu_limit if act.swiglu_limit < FLT_MAX else None
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(w1.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xf[tok] @ w1[e]
        gate, up = h[:, 0::2], h[:, 1::2]
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        a = (gate * torch.sigmoid(act.swiglu_alpha * gate) * (up + 1)).to(torch.bfloat16).float()
        out.index_add_(0, tok, (a @ w2[e]) * weights[tok, slot, None])
    return out


def run_case(name, hidden, inter, experts, top_k, tokens, activation, hint, device) -> bool:
    shape = bench.Shape(f"check-{name}", hidden, inter, experts, top_k, experts, activation)
    point = bench.peer_point(shape, tokens, "triton_kernels_mxfp4")
    weights = bench.random_mxfp4_kn_weights(point, device, torch.Generator(device=device).manual_seed(1234))
    routing = bench.random_routing(tokens, shape, seed=7, device=device)
    x = bench.random_activations(tokens, hidden, 7, device)
    moe = TritonKernelsMxfp4(*weights, shape.top_k, shape.act, num_tokens=hint)

    out = moe(x, routing.logits)
    torch.cuda.synchronize()
    w1, s1, w2, s2 = weights
    ref = reference(x, routing.logits, dequant(w1, s1), dequant(w2, s2), top_k, shape.act)
    rel = ((out.float() - ref).norm() / ref.norm()).item()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x, routing.logits)
    graph.replay()
    torch.cuda.synchronize()
    replay_diff = (captured.float() - out.float()).abs().max().item()

    ok = out.shape == (tokens, hidden) and out.dtype == torch.bfloat16 and rel < REL_TOL and replay_diff == 0.0
    scale_layout = moe.pc1.weight_scale.storage.layout
    layouts = f"{type(moe.w1.storage.layout).__name__}/{type(scale_layout).__name__}"
    if hasattr(scale_layout, "num_warps"):
        layouts += f"(num_warps={scale_layout.num_warps})"
    print(f"{'OK  ' if ok else 'FAIL'} {name:45s} H={hidden} I={inter} E={experts} k={top_k} T={tokens} "
          f"{activation:10s} rel_l2={rel:.3e} graph_replay_maxdiff={replay_diff:.3e} layouts={layouts}", flush=True)
    return ok


def dequant_agrees_with_triton_kernels(device) -> bool:
    """moe_ext's reading of the packed bytes (nibble order, scale bias) against triton_kernels' own."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    gen = torch.Generator(device=device).manual_seed(5)
    packed = torch.randint(0, 256, (2, 64, 96), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.randint(115, 130, (2, 4, 96), dtype=torch.uint8, device=device, generator=gen)
    theirs = upcast_from_mxfp_torch(packed, scale, torch.float32, axis=1)
    same = torch.equal(theirs, dequant(packed, scale))
    print(f"{'OK  ' if same else 'FAIL'} dequant (moe_ext formats) == triton_kernels upcast_from_mxfp_torch",
          flush=True)
    return same


def main() -> int:
    reason = triton_kernels_unavailable()
    if reason:
        print(reason)
        return 1
    import triton
    import triton_kernels
    print(f"torch {torch.__version__}, triton {triton.__version__}, triton_kernels from {triton_kernels.__path__[0]}, "
          f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}", flush=True)
    device = torch.device("cuda")
    ok = dequant_agrees_with_triton_kernels(device)
    for case in CASES:
        try:
            ok &= run_case(*case, device=device)
        except Exception:  # noqa: BLE001  (report every case)
            print(f"FAIL {case[0]}: exception", flush=True)
            traceback.print_exc()
            ok = False
    print("ALL OK" if ok else "SOME CASES FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
