"""Expert parallelism over torch.distributed: each rank holds num_experts / world experts and its own tokens.

    torchrun --nproc_per_node=2 examples/expert_parallel.py [--quant-mode w4a4] [--tokens 64] [--exchange all_to_all]

NCCL with one GPU per rank when there are enough GPUs, gloo on CPU otherwise (a one-GPU machine runs the CPU path). Rank 0 checks the combined result against
the single-process layer and prints the time per forward.
"""
import argparse
import time

import torch
import torch.distributed as dist

import moe_ext
from moe_ext.distributed import ExpertParallelMoE, init_from_torchrun


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant-mode", default="w4a16", choices=["w4a16", "w4a4", "w4a8"])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--exchange", default="all_gather", choices=ExpertParallelMoE.EXCHANGES)
    args = parser.parse_args()
    rank, world, device = init_from_torchrun()
    cuda = device.type == "cuda"

    # Every rank builds the same layer and batch from one seed, then keeps its experts and its tokens.
    E, H, I, K, T = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    x = torch.randn(world * T, H, generator=g)
    weights, ids = torch.softmax(torch.randn(world * T, E, generator=g), -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    gs = 2688.0 / float(x.abs().max())
    full = moe_ext.prepare_moe_weights(w1, w2, args.quant_mode, x_global_scale=gs)
    act = moe_ext.quantize_activation(x, args.quant_mode, global_scale=gs)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    local = moe_ext.quant.slice_experts(full, rank * (E // world), E // world).to(device)
    rows = slice(rank * T, (rank + 1) * T)
    mine = moe_ext.quant.QuantizedActivation(to(act.x[rows]), to(None if act.x_sf is None else act.x_sf[rows]))
    layer = ExpertParallelMoE(local, num_experts=E, top_k=K, use_fused_finalize=False, exchange=args.exchange)
    out = layer(mine, to(ids[rows].int()), to(weights[rows]))
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)

    reps = 5
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        layer(mine, to(ids[rows].int()), to(weights[rows]))
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / reps * 1e3
    if rank == 0:
        expected = moe_ext.cute_dsl_fused_moe(**act.kwargs(), token_selected_experts=ids.int(),
                                              token_final_scales=weights, num_experts=E, top_k=K,
                                              use_fused_finalize=False, **full.kwargs())
        combined = torch.cat(gathered).cpu().float()
        err = float((combined - expected.float()).norm() / expected.float().norm())
        print(f"{world} ranks x {E // world} experts, {T} tokens per rank, {args.quant_mode}: "
              f"rel. error vs one process {err:.2e}, {ms:.2f} ms per forward")
        if err > 1e-2:
            raise SystemExit("expert-parallel result differs from the single-process layer")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
