"""Routing launch time on the GPU: CUDA-graph replays of one launch, median over replays, random routing.

    python3 benchmarks/bench_routing.py [--tokens 1,8,...] [--out FILE.json]

Two launches a point: `moe_routing` (the maps alone, as the streaming forwards run it) and
`moe_routing_decode_bf16` (the maps, and x copied into the wgmma GEMMs' token K order: the w4a16 forwards on the
wgmma tactics, T >= ~256), on the tile the heuristic takes there. In the second, one CTA routes while the others
copy x, so its time is the longer of the two.
"""
import argparse
import json
import statistics

import torch

from moe_ext import launcher

SHAPES = {  # (num_experts, top_k, num_local, offset, hidden)
    "deepseek-v3": (256, 8, 256, 0, 7168), "deepseek-v3-ep8": (256, 8, 32, 96, 7168),
    "qwen3-30b-a3b": (128, 8, 128, 0, 2048), "mixtral-8x7b": (8, 2, 8, 0, 4096),
}


def time_graph(fn, replays=200, warmup=20):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    for _ in range(warmup):
        graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / 10)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name, (num_experts, top_k, num_local, offset, hidden) in SHAPES.items():
        for T in map(int, args.tokens.split(",")):
            logits = torch.randn(T, num_experts, device="cuda")
            ids = logits.topk(top_k, dim=-1).indices.int().contiguous()
            x = torch.randn(T, hidden, device="cuda").to(torch.bfloat16)
            for kernel, tile in (("moe_routing", 128), ("moe_routing_decode_bf16", 144 if T * top_k >= 8192 else 64)):
                out = launcher.allocate_routing(T, top_k, num_local, tile, "cuda")
                decode = None
                if kernel != "moe_routing":
                    x_out = torch.empty_like(x)
                    decode = ("bf16", x.view(-1).view(torch.uint8), torch.empty(16, dtype=torch.uint8,
                                                                                 device="cuda"), x_out.view(-1))
                run = lambda: launcher.route(ids, num_local, offset, out, decode=decode,  # noqa: E731
                                             k_permuted=decode is not None)
                run()
                us = time_graph(run)
                rows.append(dict(kernel=kernel, shape=name, T=T, tile=tile, us=round(us, 2)))
                print(f"{kernel:<24} {name:<16} T={T:<6} {us:8.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
