"""Decode-time variants of the streaming GEMMs' mainloop (moe_ext/kernels/sm90/stream.py), timed alone.

Each variant sets stream.StreamConfig fields on top of each GEMM's stream.config_for; GEMM1 (w4a16, SwiGLU) and
GEMM2 (w4a16, deterministic slot rows) are JIT-compiled with it through TVM-FFI on the GPU machine (source the
offline CuTe-DSL env.sh first) and launched on the same inputs as the default configuration. Each record says
whether its outputs equal the default's bitwise: a variant that only reschedules must; one that changes the K-slice
count changes the fp32 summation order. Probes (PROBES) replace parts of the mainloop (stream.py functions, or
ptx.py ones when the name starts with "ptx.") to see where time goes; their outputs are wrong by design unless
the probe only changes scheduling or how the same bits are computed.

Timing: one CUDA graph holds `--rotations` launches, each on its own random routing (different experts, so the
weights stream from DRAM, not L2); replays are timed with CUDA events, median over `--iters` replays, divided by
the launches. Weights are random bytes (e2m1 codes, e4m3 scales in [2^-3, 2^2)).

    . /tmp/cutedsl-4.8.1-py312/env.sh
    python3 benchmarks/stream_variants.py --variants default,chunk1024_stages8,probe_no_load --out variants.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402

# The NVFP4 SwiGLU layers of moe_ext.bench (gpt-oss-120b is MXFP4 at an H the kernels need padded: not timed here).
SHAPES = ("qwen3-30b-a3b", "deepseek-v3-ep8", "mixtral-8x7b", "deepseek-v3")

# Named configurations: stream.StreamConfig fields set on top of each GEMM's stream.config_for(tile, gemm).
VARIANTS = {
    "default": {},
    "one_cta": {"ctas_per_sm": 1},
    "stages3": {"stages": 3},
    "stages4": {"stages": 4},
    "stages6": {"stages": 6},
    "slices1": {"k_slices": 1},
    "slices2": {"k_slices": 2, "ctas_per_sm": 1},  # 16 warps: one CTA per SM
    "two_ctas": {"k_slices": 1, "stages": 4, "ctas_per_sm": 2},  # GEMM2 on 8-token tiles as GEMM1 runs
    "wait2": {"stages_per_wait": 2},  # two stages' decode chains per warp in flight
    "one_cta_stages8": {"ctas_per_sm": 1, "stages": 8},
    # A smaller token tile (K-chunk 1024 at 8-token tiles) leaves room for a deeper ring with two CTAs per SM.
    "chunk1024_stages8": {"token_elems": 8192, "stages": 8},
    "chunk2048_stages6": {"token_elems": 16384, "stages": 6},
    # One warpgroup wgmma per k16 for all the tokens, decoded weights as the register A operand (StreamConfig.mma).
    "wgmma_rs": {"mma": "wgmma"},
    "wgmma_async": {"mma": "wgmma_async"},  # ... with each step's wgmmas in flight under the next step
    "wgmma_async_one_cta": {"mma": "wgmma_async", "ctas_per_sm": 1},  # ... with registers for two steps' fragments
    # Three 8-warp CTAs per SM (6 warps per scheduler instead of 4, to hide the decode chains' latencies): 80
    # registers a thread, no spills at tiles 8-32 (sm_90a SASS, session 10); 4 stages and a 32 KB token tile
    # (K-chunk 2048 at 8 tokens) keep three CTAs in 228 KB of shared memory.
    "three_ctas": {"ctas_per_sm": 3, "stages": 4, "token_elems": 16384, "k_slices": 1},
    "three_ctas_chunk1024": {"ctas_per_sm": 3, "stages": 4, "token_elems": 8192, "k_slices": 1},
    "wide_only": {"narrow": False},  # one mainloop width: every tile stages and multiplies all its tokens
}
# Named GEMM1-only configurations (GEMM2 keeps its default): the ring_tokens mainloop reads the routed rows of x as
# token slabs (moe_ext/slabs.py), which the harness prepares for each routing (its outputs must equal the default's
# bitwise).
GEMM1_VARIANTS = {
    "ring_tokens_gemm1": {"ring_tokens": True},
}
# ... and GEMM2-only ones: the ring_tokens GEMM2 reads the FC2 input rows as token slabs (moe_ext/slabs.py), which
# the harness makes from GEMM1's output (a slab's rows are the tile's own rows).
GEMM2_VARIANTS = {
    "ring_tokens_gemm2": {"ring_tokens": True},
    "ring_tokens_gemm2_tile_fastest": {"ring_tokens": True},  # ... on the staging GEMMs' grid order (PROBES)
}


# Probes: leave-one-out versions of the mainloop (their outputs are wrong by design; they bound where time goes).
def _probe_consume_loads_only(sm, place, slot, scales, tile_offset, acc, tokens, block, c, live):
    """Read the thread's fragments of the slot and fold them into one accumulator: the loads stay live, no decode,
    no MMA."""
    from cutlass import Float32, Int32

    from moe_ext.kernels.sm90 import ptx
    rows = place.weights + slot * (c.rows * 64)
    w0 = ptx.ld_shared_v4(rows)
    w1 = ptx.ld_shared_v4(rows + 8 * 64)
    acc[0] = acc[0] + Float32(w0[0] ^ w0[1] ^ w0[2] ^ w0[3] ^ w1[0] ^ w1[1] ^ w1[2] ^ Int32(w1[3]))


@cute.jit
def _probe_issue_nothing(sm, lane, src, first, stage, steps, block, c):
    """No copies: lane 0 arrives on the stage's barrier without bytes, so the mainloop decodes and multiplies
    whatever the ring holds."""
    if lane == 0:
        cute.arch.mbarrier_arrive(sm.full + stage % c.stages)


def _probe_accumulate_nothing(sm, *args):
    """No mainloop at all: launch, prologue of the kernel and its epilogue on whatever shared memory holds."""


def _probe_token_group_zero(values_bf16, offset):
    from cutlass import Int32
    return [Int32(0)] * 4


def _probe_store_nothing(sm, row, chunk, values, valid, tokens, c):
    """No token staging stores (with the zero token_group, no activation loads either)."""


def _tile_fastest_grid(tiles, n_tiles, k_split, c):
    """Every GEMM on the routing-tile-fastest grid: a GEMM2's slabs (the FC2 input, 17/16 of its bytes, a few MB)
    may stay in L2 without the weight-tile-fastest order the GEMM1 slabs (8x x at top_k 8) needed."""
    return (tiles, n_tiles, k_split)


def _tile_fastest_coords(c):
    x, y, rank = cute.arch.block_idx()
    return (x, y, rank)


PROBES = {
    "probe_empty": {"accumulate": _probe_accumulate_nothing},
    "probe_neither_no_stage": {"consume_tma_step": _probe_consume_loads_only, "issue_tma_stage": _probe_issue_nothing,
                               "token_group": _probe_token_group_zero, "store_chunk": _probe_store_nothing},
    "probe_no_decode": {"consume_tma_step": _probe_consume_loads_only},
    "probe_no_load": {"issue_tma_stage": _probe_issue_nothing},
    "probe_no_stage": {"token_group": _probe_token_group_zero, "store_chunk": _probe_store_nothing},
    "probe_neither": {"consume_tma_step": _probe_consume_loads_only, "issue_tma_stage": _probe_issue_nothing},
    # not a leave-one-out: the same kernels on another grid order (outputs equal the default's)
    "ring_tokens_gemm2_tile_fastest": {"launch_grid": _tile_fastest_grid, "block_coords": _tile_fastest_coords},
}


def log(*args):
    print(*args, flush=True)


def compile_pair(cfg: tuple, tile: int):
    from cutlass.cute.runtime import make_fake_stream

    from moe_ext.kernels.sm90 import gemm1, gemm2

    options = "--gpu-arch sm_90a --enable-tvm-ffi"
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (gemm1.compile_launch(gemm1.make_kernel("w4a16", "swiglu", tile, cfg[0]), options, stream),
            gemm2.compile_launch(gemm2.make_kernel("w4a16", tile, cfg[1]), options, stream))


@dataclasses.dataclass
class Layer:
    name: str
    hidden: int
    inter: int
    top_k: int
    w1: torch.Tensor
    w1_sf: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    alpha: torch.Tensor
    x: torch.Tensor
    scales: torch.Tensor
    routings: list
    inters: list  # FC2 input buffer of each routing (GEMM1 out, GEMM2 in)
    slots: list  # GEMM2 slot-row output of each routing
    splits: tuple


def flat(t: torch.Tensor) -> torch.Tensor:
    f = t.reshape(-1)
    return f if f.numel() < 2 ** 31 else f[:2 ** 31 - 1]  # the kernels use the base pointer and 64-bit offsets


def make_layer(name: str, tokens: int, tile: int, rotations: int, seed: int, split_factor: int = 1,
               experts_hit: int | None = None) -> Layer:
    from moe_ext import launcher
    from moe_ext.quant import swizzle_sf
    from moe_ext.routing import compute_routing

    from moe_ext.bench import SHAPES as LAYERS

    shape = LAYERS[name]
    hidden, inter, experts, top_k, local = shape.hidden, shape.inter, shape.num_experts, shape.top_k, shape.num_local
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)

    def weight(rows, k):
        w = torch.randint(0, 256, (local, rows, k // 2), generator=gen, device=dev, dtype=torch.uint8)
        sf = swizzle_sf(torch.randint(0x20, 0x48, (local, rows, k // 16), generator=gen, device=dev,
                                      dtype=torch.uint8))
        return w, sf

    w1, w1_sf = weight(2 * inter, hidden)
    w2, w2_sf = weight(hidden, inter)
    alpha = (torch.rand(local, generator=gen, device=dev) + 0.5).float()
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(torch.bfloat16)
    scales = torch.rand(tokens * top_k, generator=gen, device=dev).float()
    routings, inters, slots = [], [], []
    if experts_hit is not None and not top_k <= experts_hit <= local:
        raise ValueError(f"--experts-hit must be in [top_k, local experts] = [{top_k}, {local}], got {experts_hit}")
    for _ in range(rotations):
        if experts_hit is None:
            ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(top_k, dim=1).indices.to(torch.int32)
        else:  # every token's experts drawn from one random set of experts_hit local ones
            chosen = torch.randperm(local, generator=gen, device=dev)[:experts_hit]
            pick = torch.rand(tokens, experts_hit, generator=gen, device=dev).topk(top_k, dim=1).indices
            ids = chosen[pick].to(torch.int32)
        r = compute_routing(ids, local, 0, tile)
        routings.append(r)
        inters.append(torch.zeros(r.permuted_to_expanded.numel() * inter, dtype=torch.bfloat16, device=dev))
        slots.append(torch.zeros(tokens * top_k * hidden, dtype=torch.bfloat16, device=dev))
    tactic = launcher.default_tactic(tokens, top_k, experts, local, 2 * inter, hidden, launcher.TOKEN_TILES,
                                     torch.cuda.get_device_properties(0).multi_processor_count)
    return Layer(name, hidden, inter, top_k, w1, w1_sf, w2, w2_sf, alpha, x, scales, routings, inters, slots,
                 tuple(min(4, max(1, s) * split_factor) for s in tactic[1:]))


def run_gemm1(fn, layer: Layer, i: int, dummies: dict, pdl: bool = False, x: torch.Tensor | None = None):
    from moe_ext import launcher
    from moe_ext.activation import Activation

    r = layer.routings[i]
    fn((layer.x if x is None else x).reshape(-1), dummies["f32"], flat(layer.w1), layer.w1_sf, layer.alpha,
       r.permuted_to_expanded, r.tile_to_expert, r.tile_to_mn_limit, r.num_live_tiles, layer.inters[i],
       dummies["f32"], layer.hidden, 2 * layer.inter, layer.inter, 0, layer.top_k,
       *launcher.activation_params(Activation("swiglu")), layer.splits[0], pdl)


def run_gemm2(fn, layer: Layer, i: int, dummies: dict, pdl: bool = False, a: torch.Tensor | None = None):
    r = layer.routings[i]
    fn(layer.inters[i] if a is None else a, dummies["f32"], flat(layer.w2), layer.w2_sf, layer.alpha,
       layer.scales, r.permuted_to_expanded, r.tile_to_expert, r.tile_to_mn_limit, r.num_live_tiles,
       layer.slots[i], layer.hidden, layer.inter, layer.hidden, 0, layer.top_k, False, layer.splits[1], pdl)


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 distance over the elements the default wrote (padding rows stay NaN in both); inf where the
    variant leaves one of them non-finite. For variants that reorder the fp32 sums (not bitwise equal)."""
    written = torch.isfinite(ref)
    if not torch.isfinite(out[written]).all():
        return float("inf")
    diff = (out[written].float() - ref[written].float()).norm()
    return float(diff / ref[written].float().norm().clamp_min(1e-30))


def time_graph(launches, iters: int) -> float:
    """Median microseconds of one replay of a graph holding `launches()`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launches()  # warm (module load) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launches()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"of {list(VARIANTS) + list(GEMM1_VARIANTS) + list(GEMM2_VARIANTS) + list(PROBES)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--tile", type=int, default=8, help="routing tile (tokens per CTA) of the kernels timed")
    parser.add_argument("--rotations", type=int, default=16)
    parser.add_argument("--experts-hit", type=int, default=None,
                        help="route every token to experts of one random set of this many local experts (a "
                             "launch's live tiles, so its CTA count against the SMs' slots: whole or partial waves)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--split-factor", type=int, default=1,
                        help="multiply the heuristic's K splits (for configurations that fit two CTAs per SM)")
    parser.add_argument("--pdl", action="store_true",
                        help="launch with programmatic dependent launch, as the forward does (a launch's start then "
                             "overlaps the previous one's tail)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: {unknown} not among {list(SHAPES)}")

    from moe_ext.kernels.sm90 import ptx
    from moe_ext.kernels.sm90 import stream as streaming
    from moe_ext.slabs import token_slabs

    tile = args.tile
    dummies = {"f32": torch.zeros(4, dtype=torch.float32, device="cuda")}
    layers = [make_layer(name, args.tokens, tile, args.rotations, seed=7, split_factor=args.split_factor,
                         experts_hit=args.experts_hit) for name in args.shapes.split(",")]
    rev = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], capture_output=True,
                         text=True).stdout.strip()
    variants = args.variants.split(",")
    if variants[0] != "default":  # the bitwise comparison is against the default configuration
        variants.insert(0, "default")
    records, reference = [], {}
    for variant in variants:
        patches = PROBES.get(variant, {})
        over = VARIANTS.get(variant, {})
        cfg = tuple(dataclasses.replace(streaming.config_for(tile, gemm), **over) for gemm in (1, 2))
        cfg = (dataclasses.replace(cfg[0], **GEMM1_VARIANTS.get(variant, {})),
               dataclasses.replace(cfg[1], **GEMM2_VARIANTS.get(variant, {})))
        start = time.perf_counter()
        owners = {name: (ptx if name.startswith("ptx.") else streaming) for name in patches}
        saved = {name: getattr(owners[name], name.split(".")[-1]) for name in patches}
        try:
            for name, fn in patches.items():
                setattr(owners[name], name.split(".")[-1], fn)
            g1, g2 = compile_pair(cfg, tile)
        except Exception as exc:  # a variant that does not compile is reported, the others still run
            log(f"{variant}: compile failed: {type(exc).__name__}: {exc}")
            records.append(dict(variant=variant, config=[dataclasses.asdict(c) for c in cfg], error=str(exc)[:2000]))
            continue
        finally:
            for name, fn in saved.items():
                setattr(owners[name], name.split(".")[-1], fn)
        log(f"{variant}: compiled in {time.perf_counter() - start:.1f} s ({cfg})")
        for layer in layers:
            xs = [None] * len(layer.routings)
            if cfg[0].ring_tokens:
                xs = [token_slabs(layer.x, r.permuted_to_expanded, r.tile_to_mn_limit, int(r.num_live_tiles), tile,
                                  layer.top_k).view(torch.bfloat16) for r in layer.routings]
            for t in layer.inters + layer.slots:
                t.fill_(float("nan"))
            inputs2 = [None] * len(layer.routings)
            for i, r in enumerate(layer.routings):
                run_gemm1(g1, layer, i, dummies, x=xs[i])
                if cfg[1].ring_tokens:
                    rows = torch.arange(r.permuted_to_expanded.numel(), dtype=torch.int32, device="cuda")
                    inputs2[i] = token_slabs(layer.inters[i].view(rows.numel(), layer.inter), rows,
                                             r.tile_to_mn_limit, int(r.num_live_tiles), tile, 1).view(torch.bfloat16)
                run_gemm2(g2, layer, i, dummies, a=inputs2[i])
            torch.cuda.synchronize()
            outputs = [t.clone() for t in layer.inters + layer.slots]
            key = layer.name
            if key not in reference:
                reference[key] = outputs
                equal = True
            else:
                equal = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                            for a, b in zip(outputs, reference[key]))
            rel_l2 = max(relative_l2(a, b) for a, b in zip(outputs, reference[key]))
            n = len(layer.routings)
            us1 = time_graph(lambda: [run_gemm1(g1, layer, i, dummies, args.pdl, xs[i]) for i in range(n)],
                             args.iters) / n
            us2 = time_graph(lambda: [run_gemm2(g2, layer, i, dummies, args.pdl, inputs2[i]) for i in range(n)],
                             args.iters) / n
            rec = dict(variant=variant, shape=layer.name, T=args.tokens, experts_hit=args.experts_hit, tile=tile,
                       splits=layer.splits, pdl=args.pdl,
                       gemm1_us=round(us1, 2), gemm2_us=round(us2, 2), bitwise_equal_to_default=equal,
                       rel_l2_to_default=rel_l2,
                       config=[dataclasses.asdict(c) for c in cfg], git_rev=rev, command=" ".join(sys.argv))
            records.append(rec)
            log(f"  {layer.name:16s} T={args.tokens} tile={tile} splits={layer.splits} GEMM1 {us1:8.2f} us  "
                f"GEMM2 {us2:8.2f} us  equal={equal} rel_l2={rel_l2:.1e}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
