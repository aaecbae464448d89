"""Per-kernel GPU time of one forward (torch.profiler over eager wrapper runs), to see which kernel bounds a point.
Layers, weights and routing are the benchmark's own (moe_ext.bench).

    python3 benchmarks/profile_kernels.py [--points qwen3-30b-a3b:1,mixtral-8x7b:1024] [--mode w4a16]
                                          [--tactic 8,1,2] [--fused] [--ncu] [--min-local-pairs 1]

--ncu runs one forward per point between cudaProfilerStart/Stop and no torch.profiler, for
`ncu --profile-from-start off`, which times each kernel alone (no PDL overlap with its neighbours).
--min-local-pairs N takes the first input set (index 0, 1, ...) whose routing sends at least N (token, expert) pairs
to this rank's experts: at DeepSeek-V3 EP8 T=1 (8 of 256 experts a token, 32 local) a set sends none a third of
the time, and then the GEMMs launch only empty tiles (session 29's ncu of index 0 read no weights).
"""
import argparse
import collections
import statistics

import torch

import moe_ext
from moe_ext.bench import (SHAPES, Point, gpu_state, moe_ext_inputs, point_seed,
                           random_moe_ext_weights, random_routing, routing_stats, supported_dims)


def per_forward_medians(events: list, reps: int) -> tuple[dict, list]:
    """(median per-forward µs of each kernel, per-forward totals) from (name, start, µs) of `reps` forwards'
    kernels: a kernel's launches, in start order, split into `reps` equal runs (one forward's), each summed. The
    median keeps one slow forward (a clock dip) from moving an A/B."""
    launches = collections.defaultdict(list)
    for name, start, us in sorted(events, key=lambda e: e[1]):
        launches[name].append(us)
    medians, totals = {}, [0.0] * reps
    for name, times in launches.items():
        per = max(1, len(times) // reps)
        sums = [sum(times[r * per:(r + 1) * per]) for r in range(len(times) // per)]
        medians[name] = statistics.median(sums)
        for r, v in enumerate(sums[:reps]):
            totals[r] += v
    return medians, totals


def routing_with_local_pairs(shape, num_tokens: int, min_pairs: int, device, tries: int = 1000):
    """The benchmark's routing of the first input set (index 0, 1, ...) that sends at least `min_pairs` (token,
    expert) pairs to this rank's experts [local_offset, local_offset + num_local)."""
    for index in range(tries):
        routing = random_routing(num_tokens, shape, point_seed(0, shape, num_tokens, index), device)
        local = int(routing_stats([routing.ids], shape.num_local, shape.local_offset).local_pairs)
        if local >= min_pairs:
            return routing, index, local
    raise ValueError(f"min_local_pairs: no input set of the first {tries} sends {min_pairs} pairs to {shape.name}'s "
                     f"local experts")


def profile_point(shape, num_tokens: int, mode: str, tactic, reps: int = 10, fused: bool = False,
                  ncu: bool = False, min_local_pairs: int = 0) -> tuple[dict, list]:
    """Median GPU microseconds per forward of each kernel of one point, and each forward's total."""
    hidden, inter = supported_dims(shape, mode, "cuda")
    point = Point(shape, num_tokens, "moe_ext", mode, "deterministic", hidden, inter)
    routing, index, local = routing_with_local_pairs(shape, num_tokens, min_local_pairs, "cuda")
    print(f"{shape.name} T={num_tokens}: input set {index}, {local} local (token, expert) pairs")
    inputs = dict(moe_ext_inputs(routing, hidden, mode, "cuda"), **random_moe_ext_weights(
        point, "cuda", torch.Generator(device="cuda").manual_seed(routing.seed)))
    wrapper = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, hidden, inter, max_num_tokens=num_tokens,
                                        num_local_experts=shape.num_local, local_expert_offset=shape.local_offset,
                                        quant_mode=mode, device="cuda", use_fused_finalize=fused,
                                        **shape.wrapper_kwargs())
    for _ in range(3):
        wrapper.run(**inputs, tactic=tactic)
    torch.cuda.synchronize()
    if ncu:
        torch.cuda.cudart().cudaProfilerStart()
        wrapper.run(**inputs, tactic=tactic)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return {}, []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            wrapper.run(**inputs, tactic=tactic)
        torch.cuda.synchronize()
    return per_forward_medians([(e.name[:60], e.time_range.start, e.device_time) for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA], reps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="qwen3-30b-a3b:1,deepseek-v3-ep8:1,deepseek-v3-ep8:64,mixtral-8x7b:1,"
                                            "mixtral-8x7b:1024")
    parser.add_argument("--mode", default="w4a16")
    parser.add_argument("--tactic", default=None, help="routing tile, GEMM1 K split, GEMM2 K split, e.g. 8,1,2")
    parser.add_argument("--fused", action="store_true", help="fused finalize (default deterministic)")
    parser.add_argument("--ncu", action="store_true", help="one unprofiled forward per point, for ncu")
    parser.add_argument("--min-local-pairs", type=int, default=0,
                        help="the first input set whose routing sends this many pairs to the local experts")
    args = parser.parse_args()
    tactic = None if args.tactic is None else tuple(int(v) for v in args.tactic.split(","))
    label = "default" if tactic is None else ",".join(map(str, tactic))  # one field for the scripts' awk
    for point in args.points.split(","):
        name, num_tokens = point.split(":")
        times, totals = profile_point(SHAPES[name], int(num_tokens), args.mode, tactic, fused=args.fused,
                                      ncu=args.ncu, min_local_pairs=args.min_local_pairs)
        print(f"{name} T={num_tokens} {args.mode} tactic={label}: {sum(times.values()):.1f} us of kernels")
        for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {us:9.1f} us  {kernel}")
        if totals:  # not under --ncu, which profiles one forward and no clock is worth reading
            state = gpu_state(torch.device("cuda"))
            print(f"    forwards: min {min(totals):.1f} / max {max(totals):.1f} us; gpu after: "
                  + " ".join(f"{k}={v}" for k, v in state.items()))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
