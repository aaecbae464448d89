"""First timing of the sm_90a kernels, every quant mode (version 1: no pipelining, SIMT decode;
docs/perf-notes.md).

CUDA-graph replay of CuteDslMoEWrapper.run, median over replays, random weights and routing, 4 rotating input
sets so activations are not reused. Weights of large layers stay L2-cold only because they exceed L2 (50 MB).
    python3 benchmarks/bench_kernels_v1.py [--out FILE.json] [--modes w4a16,w4a4,w4a8] [--tokens 1,64,1024]
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
    parser.add_argument("--modes", default="w4a16")
    args = parser.parse_args()
    rows = []
    for name, (H, I, num_experts, K, E) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        # Random packed weights and scales near 1/64 (a kernel's cost does not depend on the values).
        w1 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=g)
        w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=g)
        alpha = torch.ones(E, device="cuda")
        for mode in args.modes.split(","):
            block, sf_byte = (32, 121) if mode == "w4a8" else (16, 0x20)
            sf1 = torch.full((moe_ext.quant.swizzled_size(E, 2 * I, H // block),), sf_byte, dtype=torch.uint8,
                             device="cuda")
            sf2 = torch.full((moe_ext.quant.swizzled_size(E, H, I // block),), sf_byte, dtype=torch.uint8,
                             device="cuda")
            fc2_scale = torch.ones(1, device="cuda") if mode == "w4a4" else None
            for T in [int(t) for t in args.tokens.split(",")]:
                wrapper = moe_ext.CuteDslMoEWrapper(num_experts, K, H, I, use_cuda_graph=True, max_num_tokens=T,
                                                    num_local_experts=E, quant_mode=mode, device="cuda",
                                                    use_fused_finalize=False)
                sets, hit = [], []
                for _ in range(4):
                    ids = torch.rand(T, num_experts, device="cuda", generator=g).topk(K, dim=-1).indices.int()
                    act = moe_ext.quantize_activation(torch.randn(T, H, device="cuda", generator=g), mode,
                                                      global_scale=64.0)
                    hit.append(int(torch.unique(ids[ids < E]).numel()))  # local experts are ids 0..E-1
                    sets.append(dict(x=act.x, x_sf=act.x_sf, token_selected_experts=ids,
                                     token_final_scales=torch.full((T, K), 1.0 / K, device="cuda"), w1_weight=w1,
                                     w1_weight_sf=sf1, w1_alpha=alpha, fc2_input_scale=fc2_scale, w2_weight=w2,
                                     w2_weight_sf=sf2, w2_alpha=alpha))
                graphs = []
                for inputs in sets:
                    wrapper.run(**inputs)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        wrapper.run(**inputs)
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
                experts_hit = sum(hit) / len(hit)  # mean over the rotated sets: what each forward must read
                weight_bytes = experts_hit * (2 * I * H + H * I) * (0.5 + 1 / block)  # packed + 1 scale byte/block
                rows.append(dict(shape=name, T=T, quant_mode=mode, finalize="deterministic", impl="moe_ext-v1",
                                 experts_hit=experts_hit,
                                 us=round(us, 1), weight_tbps=round(weight_bytes / us / 1e6, 3)))
                print(f"{name:<16} {mode:<6} T={T:<6} {us:10.1f} us  experts {experts_hit:6.2f}  "
                      f"weights {weight_bytes / 1e6:8.1f} MB "
                      f"-> {weight_bytes / us / 1e6:6.3f} TB/s")
                del wrapper, graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
