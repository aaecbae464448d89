"""Localized (two green-context shards) vs full-width fused MoE on one H200, alone and next to other work.

    python3 benchmarks/bench_localized.py [--shapes deepseek-v3-ep8,deepseek-v3] [--tokens 1,64,1024]
        [--sm-count 32] [--out benchmarks/results/h200_localized.json]

Per (shape, T), w4a4 with fused finalize, graph replays (CUDA events, median):
  full_width     the whole GPU;
  localized      FC1/FC2 of the two shards on two green contexts of --sm-count SMs each;
  concurrent_*   the case localized execution exists for: the MoE replays while a stream on a third green context
                 (the SMs left over) runs bf16 matmuls. Reported: the wall time of the bundle (n MoE replays + m
                 matmuls) run concurrently and one after the other, and the MoE's time per replay inside it.
Random weights and routing (moe_ext.bench); weights far exceed L2, so replays stream them from HBM.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import moe_ext
from moe_ext import bench
from moe_ext.quant import PreparedWeights
from moe_ext.quant.swizzle import mma_view


def prepared_from(weights: dict, shape: bench.Shape, block: int) -> PreparedWeights:
    E, H, I = shape.num_local, shape.hidden, shape.inter
    return PreparedWeights(
        "w4a4", weights["w1_weight"], mma_view(weights["w1_weight_sf"], E, 2 * I, H // block), weights["w1_alpha"],
        weights["w2_weight"], mma_view(weights["w2_weight_sf"], E, H, I // block), weights["w2_alpha"],
        weights["fc2_input_scale"], bench.X_GLOBAL_SCALE, False, 3)


def capture(wrapper, args: dict) -> torch.cuda.CUDAGraph:
    wrapper.run(**args)  # validated run: loads kernels, picks the tactic, records the plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(**args)
    torch.cuda.synchronize()
    return graph


def median_us(graph: torch.cuda.CUDAGraph, iters: int = 50) -> float:
    return statistics.median(bench.time_replays([graph], warmup=10, iters=iters, budget_s=2.0))


def bundle_ms(moe_graph, moe_stream, n_moe: int, matmul, mm_stream, n_mm: int, concurrent: bool) -> tuple:
    """Wall time of n_moe MoE replays and n_mm matmuls, overlapped on their streams or one after the other; and
    the MoE stream's own span."""
    torch.cuda.synchronize()
    start, moe_end, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    moe_stream.wait_stream(torch.cuda.current_stream())
    mm_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(moe_stream):
        for _ in range(n_moe):
            moe_graph.replay()
        moe_end.record()
    if not concurrent:
        mm_stream.wait_stream(moe_stream)
    with torch.cuda.stream(mm_stream):
        for _ in range(n_mm):
            matmul()
    torch.cuda.current_stream().wait_stream(moe_stream)
    torch.cuda.current_stream().wait_stream(mm_stream)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), start.elapsed_time(moe_end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v3-ep8,deepseek-v3")
    parser.add_argument("--tokens", default="1,64,1024")
    parser.add_argument("--sm-count", type=int, default=32, help="SMs of each of the two MoE partitions")
    parser.add_argument("--out", default="benchmarks/results/h200_localized.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    total_sms = torch.cuda.get_device_properties(device).multi_processor_count
    from torch.cuda.green_contexts import GreenContext

    other_sms = (total_sms - 2 * args.sm_count) // 8 * 8
    other_context = GreenContext.create(num_sms=other_sms, device_id=device.index or 0)  # must outlive its stream
    other_stream = other_context.Stream()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmul():
        torch.mm(a, b)

    records = []
    meta = dict(command=" ".join(sys.argv), git=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                text=True).stdout.strip(),
                device=torch.cuda.get_device_name(device), sm_count=args.sm_count, other_sms=other_sms)
    for name in args.shapes.split(","):
        shape = bench.SHAPES[name]
        H, I, E = shape.hidden, shape.inter, shape.num_local
        point = bench.Point(shape, 1, "moe_ext", "w4a4", "fused", H, I)
        weights = bench.random_moe_ext_weights(point, device, torch.Generator(device=device).manual_seed(0))
        prepared = prepared_from(weights, shape, 16)
        for T in (int(t) for t in args.tokens.split(",")):
            routing = bench.random_routing(T, shape, bench.point_seed(0, shape, T, 0), device)
            run_args = dict(bench.moe_ext_inputs(routing, H, "w4a4", device), **weights)
            common = dict(use_cuda_graph=True, max_num_tokens=T, quant_mode="w4a4", device=device,
                          num_local_experts=E, **shape.wrapper_kwargs())
            full = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, H, I, **common)
            local = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, H, I, **common, localized=True,
                                              localized_sm_count=args.sm_count)
            local.localize(prepared)
            g_full, g_local = capture(full, run_args), capture(local, run_args)
            out_full = full.run(**run_args).float()
            out_local = local.run(**run_args).float()
            rel = float((out_local - out_full).norm() / out_full.norm())
            t_full, t_local = median_us(g_full), median_us(g_local)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(other_stream):
                for _ in range(5):
                    matmul()
            torch.cuda.synchronize()
            mm_ms = (time.perf_counter() - t0) * 1e3 / 5
            n_moe = max(1, int(20 * mm_ms * 1e3 / max(t_local, 1.0)))  # about as long as 20 matmuls
            moe_stream = torch.cuda.Stream(device)
            for variant, graph, mm in (("localized", g_local, other_stream),
                                       ("full_width", g_full, torch.cuda.Stream(device))):
                bundle_ms(graph, moe_stream, 2, matmul, mm, 2, True)  # warm-up
                seq, _ = bundle_ms(graph, moe_stream, n_moe, matmul, mm, 20, False)
                conc, moe_span = bundle_ms(graph, moe_stream, n_moe, matmul, mm, 20, True)
                records.append(dict(shape=name, T=T, quant_mode="w4a4", finalize="fused",
                                    variant=f"concurrent_{variant}", moe_replays=n_moe, matmuls=20,
                                    matmul_sms=other_sms if variant == "localized" else total_sms,
                                    sequential_ms=seq, concurrent_ms=conc,
                                    moe_us_per_replay_concurrent=moe_span * 1e3 / n_moe, **meta))
            records += [dict(shape=name, T=T, quant_mode="w4a4", finalize="fused", variant="full_width", us=t_full,
                             **meta),
                        dict(shape=name, T=T, quant_mode="w4a4", finalize="fused", variant="localized", us=t_local,
                             rel_l2_vs_full_width=rel, matmul_alone_ms_on_other_sms=mm_ms, **meta)]
            for r in records[-4:]:
                print({k: v for k, v in r.items() if k not in meta}, flush=True)
            del full, local, g_full, g_local
            bench.release_memory()
        del weights, prepared
        bench.release_memory()
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
