"""Routing kernel time on the GPU: CUDA-graph replays of one launch, median over replays, random routing.

    python3 benchmarks/bench_routing.py [--out FILE.json]
"""
import argparse
import json
import statistics

import torch

from moe_ext import launcher

SHAPES = {"deepseek-v3": (256, 8, 256, 0), "deepseek-v3-ep8": (256, 8, 32, 96), "qwen3-30b-a3b": (128, 8, 128, 0)}


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
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name, (num_experts, top_k, num_local, offset) in SHAPES.items():
        for T in (1, 8, 64, 256, 1024, 4096, 16384):
            logits = torch.randn(T, num_experts, device="cuda")
            ids = logits.topk(top_k, dim=-1).indices.int().contiguous()
            out = launcher.allocate_routing(T, top_k, num_local, 128, "cuda")
            launcher.route(ids, num_local, offset, out)
            us = time_graph(lambda: launcher.route(ids, num_local, offset, out))
            rows.append(dict(kernel="moe_routing", shape=name, T=T, us=round(us, 2)))
            print(f"{name:<16} T={T:<6} {us:8.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
