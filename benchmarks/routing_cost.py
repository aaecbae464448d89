"""What the routing launch costs a small-T forward on its critical path: graph replays of the whole forward against
the same forward with the routing launch left out (its maps kept from a first, full run on the same inputs).

    python3 benchmarks/routing_cost.py [--points qwen3-30b-a3b:1,deepseek-v3-ep8:1] [--tactic 16,2,1]
                                       [--out routing_cost.json]

The difference bounds what GEMMs that build their own tile maps at small T (no routing launch between the previous
layer and GEMM1) could gain: the decode forwards are chains of latency-bound launches. Both graphs replay one input
set (weights L2-warm where a layer's routed experts fit in L2, as in benchmarks/profile_kernels.py), alternating,
so a clock drift moves both alike. w4a16 only: the quantized modes' routing launch also decodes the activations.
"""
import argparse
import json
import statistics

import torch

import moe_ext
from moe_ext import launcher
from moe_ext.bench import (SHAPES, Point, capture_graphs, gpu_state, moe_ext_inputs, point_seed,
                           random_moe_ext_weights, random_routing, supported_dims, time_replays)


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median µs of up to `replays` replays, queued as the benchmark queues them (moe_ext.bench.time_replays)."""
    return statistics.median(time_replays([graph], warmup=20, iters=replays, budget_s=1.0))


def measure(name: str, num_tokens: int, tactic, rounds: int, replays: int) -> dict:
    shape = SHAPES[name]
    hidden, inter = supported_dims(shape, "w4a16", "cuda")
    point = Point(shape, num_tokens, "moe_ext", "w4a16", "fused", hidden, inter)
    seed = point_seed(0, shape, num_tokens, 0)
    inputs = dict(moe_ext_inputs(random_routing(num_tokens, shape, seed, "cuda"), hidden, "w4a16", "cuda"),
                  **random_moe_ext_weights(point, "cuda", torch.Generator(device="cuda").manual_seed(seed)))
    wrapper = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, hidden, inter, max_num_tokens=num_tokens,
                                        num_local_experts=shape.num_local, local_expert_offset=shape.local_offset,
                                        quant_mode="w4a16", device="cuda", use_cuda_graph=True,
                                        use_fused_finalize=True, **shape.wrapper_kwargs())
    full_out = wrapper.run(**inputs, tactic=tactic).clone()  # validated run: records the launches, fills the maps
    full = capture_graphs([lambda: wrapper.run(**inputs, tactic=tactic)])[0][0]

    route = launcher.route
    launcher.route = lambda ids, num_local_experts, offset, out, *args, **kwargs: out  # maps stay from above
    try:
        wrapper._plans.clear()  # record again, without the routing launch
        wrapper.run(**inputs, tactic=tactic)
        no_routing = capture_graphs([lambda: wrapper.run(**inputs, tactic=tactic)])[0][0]
    finally:
        launcher.route = route
    torch.cuda.synchronize()
    no_routing.replay()
    torch.cuda.synchronize()
    # The maps were the same ones (the fused finalize adds in any order: not bit-for-bit)
    out = wrapper.run(**inputs, tactic=tactic).float()
    same = bool((out - full_out.float()).abs().max() <= 1e-2 * full_out.float().abs().max())

    times = {"full": [], "no_routing": []}
    for _ in range(rounds):
        times["full"].append(replay_us(full, replays))
        times["no_routing"].append(replay_us(no_routing, replays))
    full_us, skip_us = statistics.median(times["full"]), statistics.median(times["no_routing"])
    return dict(shape=name, T=num_tokens, tactic=list(wrapper.last_tactic), full_us=round(full_us, 2),
                no_routing_us=round(skip_us, 2), routing_on_path_us=round(full_us - skip_us, 2),
                rounds=times, same_output_after=same, **gpu_state(torch.device("cuda")))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="qwen3-30b-a3b:1,deepseek-v3-ep8:1,gpt-oss-120b:1,deepseek-v3:1,"
                                            "mixtral-8x7b:1,qwen3-30b-a3b:8")
    parser.add_argument("--tactic", default=None, help="routing tile, GEMM1 K split, GEMM2 K split (default: the "
                                                       "heuristic's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tactic = None if args.tactic is None else tuple(int(v) for v in args.tactic.split(","))
    records = []
    for point in args.points.split(","):
        name, num_tokens = point.split(":")
        record = measure(name, int(num_tokens), tactic, args.rounds, args.replays)
        records.append(record)
        print(f"{name} T={num_tokens} tactic={record['tactic']}: full {record['full_us']:.2f} us, without the "
              f"routing launch {record['no_routing_us']:.2f} us (routing on the path {record['routing_on_path_us']:.2f}"
              f" us; same output {record['same_output_after']})", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
