"""First timing of the sm_90a w4a16 kernels (version 1: no pipelining, SIMT decode; docs/perf-notes.md).

CUDA-graph replay of CuteDslMoEWrapper.run, median over replays, random weights and routing, 4 rotating input
sets so activations are not reused. Weights of large layers stay L2-cold only because they exceed L2 (50 MB).
    python3 benchmarks/bench_w4a16.py [--out FILE.json]
"""
import argparse
import json
import statistics

import torch

import moe_ext

# name: (H, I, experts, top_k, local experts). Full DeepSeek-V3 (256 local) is left out: its w1 has more than
# 2^31 elements and the version-1 kernels index with int32 (docs/perf-notes.md).
SHAPES = {"deepseek-v3-ep8": (7168, 2048, 256, 8, 32), "qwen3-30b-a3b": (2048, 768, 128, 8, 128),
          "mixtral-8x7b": (4096, 14336, 8, 2, 8)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--tokens", default="1,64,1024")
    args = parser.parse_args()
    rows = []
    for name, (H, I, num_experts, K, E) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        # Random packed weights and scales around 1/64: the kernel's cost does not depend on the values.
        w1 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=g)
        w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=g)
        sf1 = torch.full((moe_ext.quant.swizzled_size(E, 2 * I, H // 16),), 0x20, dtype=torch.uint8, device="cuda")
        sf2 = torch.full((moe_ext.quant.swizzled_size(E, H, I // 16),), 0x20, dtype=torch.uint8, device="cuda")
        alpha = torch.ones(E, device="cuda")
        for T in [int(t) for t in args.tokens.split(",")]:
            wrapper = moe_ext.CuteDslMoEWrapper(num_experts, K, H, I, use_cuda_graph=True, max_num_tokens=T,
                                                num_local_experts=E,
                                                quant_mode="w4a16", device="cuda", use_fused_finalize=False)
            sets = []
            for _ in range(4):
                ids = torch.rand(T, num_experts, device="cuda", generator=g).topk(K, dim=-1).indices.int()
                sets.append(dict(x=torch.randn(T, H, device="cuda", generator=g).bfloat16(), x_sf=None,
                                 token_selected_experts=ids, token_final_scales=torch.full((T, K), 1.0 / K,
                                                                                           device="cuda"),
                                 w1_weight=w1, w1_weight_sf=sf1, w1_alpha=alpha, fc2_input_scale=None, w2_weight=w2,
                                 w2_weight_sf=sf2, w2_alpha=alpha))
            graphs = []
            for s in sets:
                wrapper.run(**s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    wrapper.run(**s)
                graphs.append(graph)
            for graph in graphs * 3:
                graph.replay()
            samples = []
            for i in range(40):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[i % 4].replay()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(samples)
            experts_hit = min(E, T * K)  # an upper bound on the experts (and weight bytes) a forward touches
            weight_bytes = experts_hit * (2 * I * H + H * I) // 2
            rows.append(dict(shape=name, T=T, quant_mode="w4a16", impl="moe_ext-v1", us=round(us, 1),
                             weight_tbps=round(weight_bytes / us / 1e6, 3)))
            print(f"{name:<14} T={T:<6} {us:10.1f} us  weights {weight_bytes / 1e6:8.1f} MB "
                  f"-> {weight_bytes / us / 1e6:6.3f} TB/s")
            del wrapper, graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
