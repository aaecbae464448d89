"""Time per expert-parallel forward on W GPUs (NCCL), each rank with E / W experts and T tokens, for both exchanges.

    torchrun --nproc_per_node=1 benchmarks/bench_expert_parallel.py    # the one-GPU baseline (all experts local)
    torchrun --nproc_per_node=2 benchmarks/bench_expert_parallel.py [--tokens 64,1024,8192] [--shape deepseek-v3]
        [--quant-mode w4a4] [--out benchmarks/results/h200x2_expert_parallel.json]

Rank 0 appends one record per (T, exchange, timing) to --out: the median ms per forward over --iters forwards after
--warmup, the slowest rank's, and the tokens per second of all ranks together.
- timing "eager": CUDA events around each eager forward (all_to_all syncs on the host for its split sizes);
- timing "graph": the all-gather layer padded to max_tokens_per_rank = T, captured once and replayed (no host sync).
With one process the exchange is "none": the fused MoE of all experts on the rank's T tokens, the baseline.
Weights are random codes with realistic scales and the routing is a softmax top-k of random logits (moe_ext.bench);
on CPU (gloo) it runs the reference path, which only checks that the script works.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moe_ext import bench, cute_dsl_fused_moe
from moe_ext.distributed import ExpertParallelMoE, init_from_torchrun
from moe_ext.quant import PreparedWeights, QuantizedActivation
from moe_ext.quant.swizzle import mma_view


def local_weights(shape: bench.Shape, quant_mode: str, num_local: int, rank: int, device) -> PreparedWeights:
    local_shape = dataclasses.replace(shape, num_local=num_local)
    point = bench.Point(local_shape, 1, "moe_ext", quant_mode, "fused", shape.hidden, shape.inter)
    w = bench.random_moe_ext_weights(point, device, torch.Generator(device=device).manual_seed(1000 + rank))
    block = bench.SCALE_BLOCK[point.formats[0]]
    E, H, I = num_local, shape.hidden, shape.inter
    return PreparedWeights(quant_mode, w["w1_weight"], mma_view(w["w1_weight_sf"], E, 2 * I, H // block),
                           w["w1_alpha"], w["w2_weight"], mma_view(w["w2_weight_sf"], E, H, I // block),
                           w["w2_alpha"], w["fc2_input_scale"], bench.X_GLOBAL_SCALE, False,
                           shape.wrapper_kwargs()["activation_type"])


def variants(world: int, cuda: bool) -> list[tuple[str, str]]:
    """(exchange, timing) pairs to time: the one-process baseline, or both exchanges (+ the captured all-gather)."""
    if world == 1:
        return [("none", "eager")] + ([("none", "graph")] if cuda else [])
    return [(e, "eager") for e in ExpertParallelMoE.EXCHANGES] + ([("all_gather", "graph")] if cuda else [])


def time_forward(forward, timing: str, warmup: int, iters: int, cuda: bool) -> list[float]:
    """ms of each of `iters` forwards (eager, or replays of one captured forward), each after a barrier. The graph
    dies with this call: a live graph holding NCCL work makes destroy_process_group hang (pytorch/pytorch#115388)."""
    for _ in range(warmup):
        forward()
    if timing == "graph":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        forward = graph.replay
        forward()
    samples = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def one_process_moe(weights: PreparedWeights, shape: bench.Shape, act_kwargs: dict, activation, ids, scales):
    """All experts on this process: the fused MoE with no exchange."""
    return cute_dsl_fused_moe(**activation.kwargs(), token_selected_experts=ids, token_final_scales=scales,
                              num_experts=shape.num_experts, top_k=shape.top_k, num_local_experts=shape.num_experts,
                              local_expert_offset=0, **weights.kwargs(), **act_kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=sorted(bench.SHAPES))
    parser.add_argument("--hidden", type=int, help="override the shape's H (small CPU smoke runs)")
    parser.add_argument("--inter", type=int, help="override the shape's I")
    parser.add_argument("--tokens", default="64,1024,8192", help="tokens per rank")
    parser.add_argument("--quant-mode", default="w4a4", choices=["w4a16", "w4a4", "w4a8"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/h200_expert_parallel.json")
    args = parser.parse_args()
    rank, world, device = init_from_torchrun()
    command = "torchrun --nproc_per_node=%d benchmarks/bench_expert_parallel.py %s" % (world, " ".join(sys.argv[1:]))
    cuda = device.type == "cuda"
    shape = bench.SHAPES[args.shape]
    shape = dataclasses.replace(shape, hidden=args.hidden or shape.hidden, inter=args.inter or shape.inter,
                                num_local=shape.num_experts)
    num_local = shape.num_experts // world
    weights = local_weights(shape, args.quant_mode, num_local, rank, device)
    act_kwargs = {k: v for k, v in shape.wrapper_kwargs().items() if k != "activation_type"}
    records = []
    for T in (int(t) for t in args.tokens.split(",")):
        routing = bench.random_routing(T, shape, bench.point_seed(rank, shape, T, 0), device)
        inputs = bench.moe_ext_inputs(routing, shape.hidden, args.quant_mode, device)
        activation = QuantizedActivation(inputs["x"], inputs["x_sf"])
        for exchange, timing in variants(world, cuda):
            if exchange == "none":
                layer = functools.partial(one_process_moe, weights, shape, act_kwargs)
            else:
                cap = {"max_tokens_per_rank": T} if timing == "graph" else {}
                layer = ExpertParallelMoE(weights, num_experts=shape.num_experts, top_k=shape.top_k,
                                          exchange=exchange, **cap, **act_kwargs)

            samples = time_forward(functools.partial(layer, activation, routing.ids, routing.weights), timing,
                                   args.warmup, args.iters, cuda)
            ms = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank bounds the step
            records.append(dict(shape=args.shape, H=shape.hidden, I=shape.inter, T_per_rank=T, world=world,
                                quant_mode=args.quant_mode, exchange=exchange, timing=timing, ms=float(ms),
                                tokens_per_s=world * T / float(ms) * 1e3, backend=dist.get_backend(),
                                device=torch.cuda.get_device_name() if cuda else "cpu", command=command))
            if rank == 0:
                print(records[-1], flush=True)
    if rank == 0:
        existing = json.load(open(args.out)) if os.path.exists(args.out) else []
        with open(args.out, "w") as f:
            json.dump(existing + records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
