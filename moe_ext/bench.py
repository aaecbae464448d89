"""Performance benchmark of the fused MoE forward on the GPU: moe_ext against the peers a user has today.

    python -m moe_ext.bench [--shapes deepseek-v3,qwen3-30b-a3b] [--tokens 1,64,1024] [--modes w4a16,w4a4,w4a8]
                            [--finalize fused,deterministic] [--impls moe_ext,torch_grouped_mm_bf16,...]
                            [--out benchmarks/results/h200.json] [--plot roofline.png]
    python -m moe_ext.bench --host-overhead [--shapes ...] [--modes ...]
    (`python benchmarks/bench_moe.py ARGS` is the same entry point; `--help` lists every flag.)

How a point is measured, and why:
- Every forward is a CUDA-graph replay, as a serving loop runs it, so host launch cost is not in the number.
- Input sets rotate: each of several graphs has its own activations and routing (softmax of normal logits, top-k,
  renormalised), enough of them that between two replays of one graph the others stream at least twice the L2;
  when all of a layer's weights fit in 2x L2, weight copies rotate too. So each replay reads its weights from HBM.
- Replays are queued behind a spin kernel, each between its own pair of CUDA events; the median is reported.
  Queueing keeps the GPU busy, so no sample contains the host's launch latency.
- Bytes and FLOPs come from the routing actually used (mean over the rotated sets): packed weights + scales of
  every local expert at least one slot is routed to, activations in, bf16 output out; FLOPs count the slots routed
  to local experts. Roofline time = max(bytes / 4.15 TB/s, flops / 793 TFLOP/s) (H200, docs/perf-notes.md).
- A layer whose (H, I) the kernels refuse (gpt-oss: 2880) runs at the smallest padding they accept, as the
  library itself decides (validation + backend choice); its records carry padded_from.
- Peers (moe_ext/bench_peers.py) run in the same process on the same routing sets, at the model's own dims.
- A point that fails (out of memory, unsupported) is recorded with its error and the sweep goes on.
- With --energy-seconds, each point also replays for that long between two reads of NVML's energy counter
  (energy_mj per forward): at the power cap a forward's time follows its energy, so A/Bs there compare both.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import moe_ext
from moe_ext import launcher
from moe_ext.activation import Activation, ActivationType
from moe_ext.bench_peers import (PeerUnavailable, TritonKernelsMxfp4, bucket_counts, grouped_mm_moe, route_buckets,
                                 triton_kernels_unavailable)
from moe_ext.backends import backend_for
from moe_ext.problem import build_problem
from moe_ext.routing import expected_experts_hit as routing_expected_experts_hit
from moe_ext.tuning import l2_bytes
from moe_ext.quant import e4m3_encode, swizzled_size, ue8m0_encode_ceil
from moe_ext.quant.block import MX_BLOCK, NVFP4_BLOCK, sf_block
from moe_ext.quant.prepare import NVFP4_GLOBAL_RANGE

PEAK_READ_BYTES_PER_S = 4.15e12  # H200 HBM read stream, measured (docs/perf-notes.md)
PEAK_BF16_FLOPS = 793e12  # H200 dense bf16 MMA, measured

IMPLS = ("moe_ext", "torch_grouped_mm_bf16", "triton_kernels_mxfp4")
PEERS = IMPLS[1:]
QUANT_MODES = ("w4a16", "w4a4", "w4a8")
FINALIZE = {"fused": True, "deterministic": False}
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
DEFAULT_OUT = "benchmarks/results/h200.json"
DEFAULT_HOST_OUT = "benchmarks/results/h200_host_overhead.json"
HOST_BATCHES = 7  # timed batches of --host-overhead; the record's host_us is their median

ACTIVATIONS = {
    "swiglu": Activation.resolve(ActivationType.Swiglu),
    "swiglu_oai": Activation.resolve(ActivationType.Swiglu, 1.702, 1.0, 7.0),  # gpt-oss
}

# Formats each implementation reads: (weights, activations).
MODE_FORMATS = {"w4a16": ("nvfp4", "bf16"), "w4a4": ("nvfp4", "nvfp4"), "w4a8": ("mxfp4", "mxfp8")}
PEER_FORMATS = {"torch_grouped_mm_bf16": ("bf16", "bf16"), "triton_kernels_mxfp4": ("mxfp4", "bf16")}
# The quant mode a peer's numbers are compared against, and what its combine step is.
PEER_QUANT_MODE = {"torch_grouped_mm_bf16": "bf16", "triton_kernels_mxfp4": "w4a16"}
PEER_FINALIZE = {"torch_grouped_mm_bf16": "index_add", "triton_kernels_mxfp4": "matmul_ogs_scatter"}
SCALE_BLOCK = {"nvfp4": NVFP4_BLOCK, "mxfp4": MX_BLOCK, "mxfp8": MX_BLOCK}

# Realistic magnitudes for random inputs (a kernel's time does not depend on the values, but NaN/Inf or
# all-zero data could take other paths): block scales near 1/64, N(0, 1) activations (|x| < 6),
# FC2 inputs within +-128 for these random layers.
SCALE_VALUE = 1.0 / 64
X_GLOBAL_SCALE = NVFP4_GLOBAL_RANGE / 6.0
FC2_INPUT_SCALE = NVFP4_GLOBAL_RANGE / 128.0


@dataclass(frozen=True)
class Shape:
    """One MoE layer of a model, as this process (expert-parallel rank 0 where num_local < num_experts) runs it."""

    name: str
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    num_local: int
    activation: str = "swiglu"
    local_offset: int = 0

    @property
    def act(self) -> Activation:
        return ACTIVATIONS[self.activation]

    def wrapper_kwargs(self) -> dict:
        """CuteDslMoEWrapper's activation arguments for this layer."""
        act = self.act
        return dict(activation_type=act.activation_type, swiglu_alpha=act.swiglu_alpha,
                    swiglu_beta=act.swiglu_beta, swiglu_limit=act.swiglu_limit)


SHAPES = {s.name: s for s in (
    Shape("deepseek-v3", 7168, 2048, 256, 8, 256),
    Shape("deepseek-v3-ep8", 7168, 2048, 256, 8, 32),  # rank 0 of 8: experts 0..31 local
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8, 128),
    Shape("gpt-oss-120b", 2880, 2880, 128, 4, 128, "swiglu_oai"),
    Shape("mixtral-8x7b", 4096, 14336, 8, 2, 8),
)}


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------

def _choices(allowed):
    """argparse type: a comma-separated list whose items must be in `allowed` (keeps the user's order)."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}; "
                                             f"got {text!r}")
        return items
    return parse


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers (token counts, top-k values)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def tactic_choice(text: str) -> str | tuple[int, ...]:
    """--tactic: "tuned", "default" or a tactic as comma-separated integers (e.g. 16,1,2)."""
    if text in ("tuned", "default"):
        return text
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected tuned, default or comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_ext.bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", type=_choices(tuple(SHAPES)), default=list(SHAPES), help="layers to run")
    parser.add_argument("--tokens", type=positive_ints, default=list(TOKENS), help="token counts T")
    parser.add_argument("--modes", type=_choices(QUANT_MODES), default=list(QUANT_MODES), help="moe_ext quant modes")
    parser.add_argument("--finalize", type=_choices(tuple(FINALIZE)), default=list(FINALIZE),
                        help="moe_ext finalize: fused (use_fused_finalize=True) and/or deterministic")
    parser.add_argument("--impls", type=_choices(IMPLS), default=list(IMPLS), help="implementations to time")
    parser.add_argument("--out", help=f"JSON output (default {DEFAULT_OUT}, or {DEFAULT_HOST_OUT} with "
                                      "--host-overhead); rewritten after every point")
    parser.add_argument("--plot", help="also write a roofline PNG here (needs matplotlib)")
    parser.add_argument("--iters", type=int, default=100, help="timed replays per point (at most)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed replays per point (at most)")
    parser.add_argument("--max-seconds-per-point", type=float, default=5.0,
                        help="time budget of warm-up + timed replays; slow points get fewer replays (>= 5 timed)")
    parser.add_argument("--max-weight-gb", type=float, default=40.0,
                        help="skip a point whose weights (all rotated copies) exceed this many GB")
    parser.add_argument("--energy-seconds", type=float, default=0.0,
                        help="also replay each point for about this long between two reads of NVML's energy "
                             "counter: energy_mj per forward (0: off)")
    parser.add_argument("--min-rotations", type=int, default=4, help="input sets (graphs) rotated at least")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tactic", type=tactic_choice, default="tuned",
                        help="moe_ext's tactic: tuned (autotune on the first call), default (the heuristic's, no "
                             "tuning: for A/B runs of two kernel builds) or one given as integers, e.g. 16,1,2")
    parser.add_argument("--decode-form", choices=("rule", "fc2", "partials", "shallow_ring", "split_gemm2"),
                        default="rule",
                        help="FUSED_DECODE's kernel form: the launcher's rules, one form wherever the one-launch "
                             "forward runs, the rules without the deep-ring variant, GEMM2 split wherever the "
                             "grid has room for two K ranges (A/Bs of the rules)")
    parser.add_argument("--host-overhead", action="store_true",
                        help="instead of the sweep: host time of an eager wrapper.run at T=1 and the kernel nodes "
                             "of a captured forward, per shape, mode and finalize")
    parser.add_argument("--host-iters", type=int, default=100,
                        help=f"eager calls in each of the {HOST_BATCHES} timed batches of --host-overhead (kept small "
                             "so the launch queue never fills)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.iters < 1 or args.warmup < 0 or args.host_iters < 1 or args.max_seconds_per_point <= 0
            or args.energy_seconds < 0):
        parser.error("--iters and --host-iters must be >= 1, --warmup and --energy-seconds >= 0, "
                     "--max-seconds-per-point > 0")
    if args.out is None:
        args.out = DEFAULT_HOST_OUT if args.host_overhead else DEFAULT_OUT
    return args


# ----------------------------------------------------------------------------------------------------------------
# Which (H, I) moe_ext can run
# ----------------------------------------------------------------------------------------------------------------

def _tiny_problem_args(shape: Shape, quant_mode: str, hidden: int, inter: int, device) -> tuple:
    """cute_dsl_fused_moe's positional arguments for one token and one expert at (H, I): all a validator or a
    backend looks at is their metadata, so on the meta device they cost nothing."""
    block = sf_block(quant_mode)
    x_dtype = {"w4a4": torch.uint8, "w4a8": torch.float8_e4m3fn, "w4a16": torch.bfloat16}[quant_mode]
    u8 = dict(dtype=torch.uint8, device=device)
    x = torch.empty(1, hidden // 2 if quant_mode == "w4a4" else hidden, dtype=x_dtype, device=device)
    x_sf = None if quant_mode == "w4a16" else torch.empty(1, hidden // block, **u8)
    w1 = torch.empty(1, 2 * inter, hidden // 2, **u8)
    w1_sf = torch.empty(swizzled_size(1, 2 * inter, hidden // block), **u8)
    w2 = torch.empty(1, hidden, inter // 2, **u8)
    w2_sf = torch.empty(swizzled_size(1, hidden, inter // block), **u8)
    one = torch.ones(1, device=device)  # alphas, fc2_input_scale
    ids, scales = torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, 1, device=device)
    return (x, x_sf, ids, scales, w1, w1_sf, one, one if quant_mode == "w4a4" else None, w2, w2_sf, one, 1, 1)


def kernel_rejection(shape: Shape, quant_mode: str, hidden: int, inter: int, device="meta") -> str | None:
    """Why moe_ext would not run (H, I) of this layer on its sm_90a kernels, or None when it would.

    The library decides, so no rule is restated here: the API's validation (build_problem, metadata only), then,
    on a real device, which backend it picks (backend_for). A layer the kernels refuse runs on the reference path,
    which is neither fast nor capturable. On the meta device only the validation is checked.
    """
    kwargs = dict(quant_mode=quant_mode, **shape.wrapper_kwargs())
    try:
        build_problem(*_tiny_problem_args(shape, quant_mode, hidden, inter, "meta"), **kwargs)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if torch.device(device).type == "meta":
        return None
    problem = build_problem(*_tiny_problem_args(shape, quant_mode, hidden, inter, device), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = backend_for(problem)
    if backend.name == "sm90":
        return None
    said = "; ".join(str(w.message) for w in caught)
    return said or (f"moe_ext would take its {backend.name} path on {torch.device(device)}, not the sm_90a "
                    f"kernels (not a Hopper GPU, or moe_ext._C lacks the {quant_mode} kernels)")


def supported_dims(shape: Shape, quant_mode: str, device="meta", search: int = 256, step: int = 16) -> tuple[int, int]:
    """The smallest (H, I) >= the model's that moe_ext runs on its kernels for `quant_mode` (weights grow with
    H*I, so the smallest product wins); the model's own dims when they run."""
    candidates = sorted(((h, i) for h in range(shape.hidden, shape.hidden + search + 1, step)
                         for i in range(shape.inter, shape.inter + search + 1, step)),
                        key=lambda d: (d[0] * d[1], d))
    for hidden, inter in candidates:
        if kernel_rejection(shape, quant_mode, hidden, inter, device) is None:
            return hidden, inter
    raise ValueError(f"{shape.name} {quant_mode}: no (H, I) within +{search} of ({shape.hidden}, {shape.inter}) "
                     f"runs on the kernels; for the model's own: "
                     f"{kernel_rejection(shape, quant_mode, shape.hidden, shape.inter, device)}")


# ----------------------------------------------------------------------------------------------------------------
# Bytes, FLOPs, roofline
# ----------------------------------------------------------------------------------------------------------------

def weight_bytes_per_expert(weight_format: str, hidden: int, inter: int, n1: int) -> int:
    """Bytes of one expert's FC1 + FC2 weights, which a forward reads once when any slot is routed to it:
    bf16, or packed e2m1 (two per byte) plus the 128x4-swizzled scale bytes as stored (padding included)."""
    elements = n1 * hidden + hidden * inter
    if weight_format == "bf16":
        return 2 * elements
    block = SCALE_BLOCK[weight_format]
    return elements // 2 + swizzled_size(1, n1, hidden // block) + swizzled_size(1, hidden, inter // block)


def activation_bytes_per_token(act_format: str, hidden: int) -> int:
    """Bytes of one token's input row: bf16; NVFP4 codes + e4m3 per 16; MXFP8 codes + ue8m0 per 32."""
    return {"bf16": 2 * hidden, "nvfp4": hidden // 2 + hidden // NVFP4_BLOCK,
            "mxfp8": hidden + hidden // MX_BLOCK}[act_format]


def forward_bytes(experts_hit: float, weight_bytes: int, num_tokens: int, act_bytes: int, hidden: int) -> float:
    """Bytes a forward must move at least: weights of the experts hit, activations in, bf16 output out."""
    return experts_hit * weight_bytes + num_tokens * act_bytes + num_tokens * hidden * 2


def forward_flops(local_pairs: float, hidden: int, inter: int, n1: int) -> float:
    """2 * (routed (token, slot) pairs on local experts) * (N1*H + H*I): both GEMMs, multiply-add = 2 FLOPs."""
    return 2.0 * local_pairs * (n1 * hidden + hidden * inter)


def roofline_us(num_bytes: float, flops: float) -> float:
    """Time at the H200 ceilings: the slower of streaming the bytes and doing the bf16 math."""
    return max(num_bytes / PEAK_READ_BYTES_PER_S, flops / PEAK_BF16_FLOPS) * 1e6


def expected_experts_hit(num_tokens: int, shape: Shape) -> float:
    """Mean local experts a random routing of `shape` hits (sizes the rotation before any routing exists)."""
    return routing_expected_experts_hit(num_tokens, shape.top_k, shape.num_experts, shape.num_local)


@dataclass(frozen=True)
class RoutingStats:
    """What the rotated routing sets make a forward touch, averaged over the sets."""

    experts_hit: float  # local experts with at least one slot
    local_pairs: float  # (token, slot) pairs routed to a local expert


def routing_stats(ids_list: list[torch.Tensor], num_local: int, local_offset: int) -> RoutingStats:
    counts = [bucket_counts(route_buckets(ids, num_local, local_offset), num_local)[:num_local] for ids in ids_list]
    return RoutingStats(experts_hit=statistics.fmean(int((c > 0).sum()) for c in counts),
                        local_pairs=statistics.fmean(int(c.sum()) for c in counts))


# ----------------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One measurement: a layer at T tokens through one implementation (and quant mode / finalize)."""

    shape: Shape
    num_tokens: int
    impl: str
    quant_mode: str
    finalize: str
    hidden: int  # the dims run: moe_ext may run a padded (H, I) where the model's is not accepted
    inter: int

    @property
    def n1(self) -> int:
        return 2 * self.inter  # every benchmarked layer is gated (SwiGLU)

    @property
    def formats(self) -> tuple[str, str]:
        return MODE_FORMATS[self.quant_mode] if self.impl == "moe_ext" else PEER_FORMATS[self.impl]

    def weight_bytes_per_expert(self) -> int:
        return weight_bytes_per_expert(self.formats[0], self.hidden, self.inter, self.n1)

    def identity(self) -> dict:
        """The keys every record of this point carries, measured or not."""
        out = dict(shape=self.shape.name, T=self.num_tokens, quant_mode=self.quant_mode, finalize=self.finalize,
                   impl=self.impl, H=self.hidden, I=self.inter, num_experts=self.shape.num_experts,
                   top_k=self.shape.top_k, num_local_experts=self.shape.num_local, activation=self.shape.activation)
        if (self.hidden, self.inter) != (self.shape.hidden, self.shape.inter):
            out["padded_from"] = [self.shape.hidden, self.shape.inter]
        return out


def build_record(point: Point, samples_us: list[float], stats: RoutingStats, meta: dict, **extra) -> dict:
    """A measured point: median time, the bytes / FLOPs of its routing, achieved rates and roofline fraction."""
    us = statistics.median(samples_us)
    weight_format, act_format = point.formats
    num_bytes = forward_bytes(stats.experts_hit, point.weight_bytes_per_expert(), point.num_tokens,
                              activation_bytes_per_token(act_format, point.hidden), point.hidden)
    flops = forward_flops(stats.local_pairs, point.hidden, point.inter, point.n1)
    ideal_us = roofline_us(num_bytes, flops)
    return dict(point.identity(), us=round(us, 3), us_min=round(min(samples_us), 3), samples=len(samples_us),
                experts_hit=stats.experts_hit, local_pairs=stats.local_pairs, weight_format=weight_format,
                bytes=num_bytes, flops=flops, tbps=num_bytes / us / 1e6, tflops=flops / us / 1e6,
                roofline_us=ideal_us, roofline_fraction=ideal_us / us, **extra, **meta)


def failure_record(point: Point, key: str, reason: str, meta: dict) -> dict:
    """A point that did not produce a time: key "error" (it failed) or "skipped" (it was not attempted)."""
    return dict(point.identity(), **{key: reason}, **meta)


# ----------------------------------------------------------------------------------------------------------------
# Random inputs
# ----------------------------------------------------------------------------------------------------------------

def point_seed(base: int, shape: Shape, num_tokens: int, index: int) -> int:
    """A seed per (shape, T, input set), stable across runs and implementations (so peers see the same data)."""
    return zlib.crc32(f"{base}/{shape.name}/{num_tokens}/{index}".encode())


@dataclass
class RoutingSet:
    """One rotated input set's routing: router logits and what a softmax top-k router makes of them."""

    seed: int
    logits: torch.Tensor  # fp32 [T, E]
    ids: torch.Tensor  # int32 [T, K]
    weights: torch.Tensor  # fp32 [T, K], renormalised top-k probabilities


def random_routing(num_tokens: int, shape: Shape, seed: int, device) -> RoutingSet:
    """Routing like a real router's: softmax of normal logits, top-k, the k probabilities renormalised."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num_tokens, shape.num_experts, generator=g, device=device)
    probs, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    return RoutingSet(seed, logits, ids.to(torch.int32), probs / probs.sum(-1, keepdim=True))


def random_activations(num_tokens: int, hidden: int, seed: int, device) -> torch.Tensor:
    """bf16 N(0, 1) token rows (never zeros: an all-zero input can shortcut work)."""
    g = torch.Generator(device=device).manual_seed(seed ^ 0x5EED)
    return torch.randn(num_tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)


def random_scale_bytes(numel: int, weight_format: str, device, generator) -> torch.Tensor:
    """Block-scale bytes near SCALE_VALUE (x 2^U(-1, 1)), encoded by moe_ext's own encoders: e4m3 for NVFP4,
    ue8m0 (code ~121) for MXFP4."""
    values = SCALE_VALUE * torch.exp2(torch.rand(numel, generator=generator, device=device) * 2 - 1)
    return e4m3_encode(values) if weight_format == "nvfp4" else ue8m0_encode_ceil(values)


def random_packed(shape: tuple[int, ...], device, generator) -> torch.Tensor:
    """Random e2m1 byte pairs: every code appears, as in a real checkpoint."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)


def random_moe_ext_weights(point: Point, device, generator) -> dict:
    """The weight arguments of CuteDslMoEWrapper.run for point's mode, with random codes and realistic scales.
    Alphas fold the global scales in as prepare_moe_weights does (w4a4: 1/gs_x and 1/fc2_input_scale)."""
    experts, hidden, inter, n1 = point.shape.num_local, point.hidden, point.inter, point.n1
    weight_format = point.formats[0]
    block = SCALE_BLOCK[weight_format]
    f32 = dict(dtype=torch.float32, device=device)
    w4a4 = point.quant_mode == "w4a4"
    return dict(
        w1_weight=random_packed((experts, n1, hidden // 2), device, generator),
        w1_weight_sf=random_scale_bytes(swizzled_size(experts, n1, hidden // block), weight_format, device,
                                        generator),
        w1_alpha=torch.full((experts,), 1.0 / X_GLOBAL_SCALE if w4a4 else 1.0, **f32),
        fc2_input_scale=torch.full((1,), FC2_INPUT_SCALE, **f32) if w4a4 else None,
        w2_weight=random_packed((experts, hidden, inter // 2), device, generator),
        w2_weight_sf=random_scale_bytes(swizzled_size(experts, hidden, inter // block), weight_format, device,
                                        generator),
        w2_alpha=torch.full((experts,), 1.0 / FC2_INPUT_SCALE if w4a4 else 1.0, **f32),
    )


def moe_ext_inputs(routing: RoutingSet, hidden: int, quant_mode: str, device) -> dict:
    """The activation and routing arguments of CuteDslMoEWrapper.run for one input set: random bf16 rows
    quantized as the mode takes them (w4a4 with the per-tensor scale X_GLOBAL_SCALE)."""
    x = random_activations(routing.ids.shape[0], hidden, routing.seed, device)
    return dict(moe_ext.quantize_activation(x, quant_mode, global_scale=X_GLOBAL_SCALE).kwargs(),
                token_selected_experts=routing.ids, token_final_scales=routing.weights)


def random_bf16_weights(point: Point, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 [E, 2I, H] (rows [up; gate]) and w2 [E, H, I] in bf16, the nn.Linear layout of a checkpoint."""
    experts, hidden, inter = point.shape.num_local, point.hidden, point.inter
    w1 = torch.randn(experts, point.n1, hidden, generator=generator, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, generator=generator, device=device, dtype=torch.bfloat16)
    return w1.mul_(hidden ** -0.5), w2.mul_(inter ** -0.5)


def random_mxfp4_kn_weights(point: Point, device, generator) -> tuple[torch.Tensor, ...]:
    """MXFP4 weights in triton_kernels' [E, K, N] orientation: packed along K, one ue8m0 code per 32 K values."""
    experts, hidden, inter, n1 = point.shape.num_local, point.hidden, point.inter, point.n1

    def scales(k: int, n: int) -> torch.Tensor:
        return random_scale_bytes(experts * (k // MX_BLOCK) * n, "mxfp4", device, generator).view(
            experts, k // MX_BLOCK, n)

    return (random_packed((experts, hidden // 2, n1), device, generator), scales(hidden, n1),
            random_packed((experts, inter // 2, hidden), device, generator), scales(inter, hidden))


# ----------------------------------------------------------------------------------------------------------------
# L2-cold rotation and timing
# ----------------------------------------------------------------------------------------------------------------

def rotation_count(bytes_per_forward: float, l2: int, minimum: int = 4, maximum: int = 32) -> int:
    """Input sets to rotate so that between two replays of one set the others move >= 2x L2 bytes: the data a
    replay reads has then been evicted since its last use (LRU-like replacement needs about 2x, not 1x)."""
    needed = math.ceil(2 * l2 / max(bytes_per_forward, 1.0)) + 1
    return max(minimum, min(maximum, needed))


def weight_copies(total_weight_bytes: int, l2: int, maximum: int = 16) -> int:
    """Copies of a layer's weights to rotate: 1 when they exceed 2x L2 (different routing then reads different
    experts), else enough that the other copies stream 2x L2 between two uses of one."""
    if total_weight_bytes >= 2 * l2:
        return 1
    return min(maximum, math.ceil(2 * l2 / max(total_weight_bytes, 1)) + 1)


def budgeted_count(requested: int, estimate_us: float, budget_s: float, minimum: int) -> int:
    """How many replays fit the time budget, at least `minimum` and at most `requested`."""
    fit = int(budget_s * 1e6 / max(estimate_us, 1e-3))
    return max(minimum, min(requested, fit))


def capture_graphs(forwards: list[Callable[[], torch.Tensor]]) -> tuple[list[torch.cuda.CUDAGraph], list]:
    """One graph per forward (each closes over its own inputs), all in one memory pool: replays never overlap,
    so one graph's intermediates may reuse another's memory. Returns the graphs and their static outputs."""
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    for forward in forwards:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs.append(forward())
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs, outputs


# The last field is named clocks_event_reasons on newer drivers; gpu_state retries without it if it is refused.
GPU_STATE_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def parse_gpu_state(line: str) -> dict:
    """One `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` line of GPU_STATE_FIELDS as record fields;
    a field the driver reports as unsupported is left out."""
    values = [v.strip() for v in line.split(",")]
    out = {}
    for name, value in zip(("sm_clock_mhz", "power_w", "temperature_c"), values):
        try:
            out[name] = float(value)
        except ValueError:
            pass
    if len(values) > 3 and values[3].startswith("0x"):
        out["clock_event_reasons"] = values[3]
    return out


def gpu_state(device: torch.device) -> dict:
    """SM clock, power, temperature and active clock-event (throttle) reasons right after a point's timed replays,
    so a slow point can be told from a throttled one; {} where nvidia-smi cannot answer."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    for fields in (GPU_STATE_FIELDS, GPU_STATE_FIELDS[:3]):
        try:
            lines = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                                   check=True).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            continue
        if lines:
            return parse_gpu_state(lines[0])
    return {}


class EnergyCounter:
    """NVML's total energy counter of one GPU (millijoules since the driver loaded), read through the driver's own
    libnvidia-ml with ctypes (no Python NVML package on the offline machines). Under the H200's power cap a
    forward's time follows its energy, so energy per forward separates two builds that clock noise hides.
    `read()` is None where NVML or the counter is missing."""

    def __init__(self, index: int) -> None:
        self._lib = self._handle = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                                          ctypes.byref(handle)) == 0:
                self._lib, self._handle = lib, handle
        except (OSError, AttributeError):
            pass

    def read(self) -> int | None:
        if self._lib is None:
            return None
        value = ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value)) != 0:
            return None
        return value.value


def replay_energy(graphs: list[torch.cuda.CUDAGraph], forward_us: float, seconds: float,
                  counter: EnergyCounter) -> dict:
    """Millijoules per forward over back-to-back replays (graphs round-robin) lasting about `seconds`: the
    counter is read with the GPU idle before them and after they finish, so the window holds only the replays
    and their launch. {} where the counter cannot be read."""
    replays = max(len(graphs), int(seconds * 1e6 / max(forward_us, 1e-3)))
    torch.cuda.synchronize()
    before = counter.read()
    if before is None:
        return {}
    start = time.perf_counter()
    _keep_gpu_busy(min(replays, 64))  # the host enqueues ahead; at most ~1.6 ms of spin in the window
    for i in range(replays):
        graphs[i % len(graphs)].replay()
    torch.cuda.synchronize()
    after, window = counter.read(), time.perf_counter() - start
    if after is None or after <= before:  # a counter that did not tick over the window tells nothing
        return {}
    return dict(energy_mj=round((after - before) / replays, 4), energy_replays=replays,
                energy_window_s=round(window, 3), energy_avg_w=round((after - before) / 1e3 / window, 1))


def _keep_gpu_busy(replays: int) -> None:
    """Queue a spin kernel long enough (~25 us per replay) for the host to enqueue every replay behind it, so
    each replay starts as soon as the previous one ends and no sample includes host launch latency."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(min(replays * 50_000, 2_000_000_000))


def time_replays(graphs: list[torch.cuda.CUDAGraph], warmup: int, iters: int, budget_s: float) -> list[float]:
    """Microseconds of each timed replay, graphs taken round-robin. The first replay of every graph (uploads it)
    gives the estimate that scales warm-up and timed counts to the budget."""
    start = time.perf_counter()
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    estimate_us = (time.perf_counter() - start) * 1e6 / len(graphs)
    warmup = budgeted_count(warmup, estimate_us, budget_s / 4, minimum=min(warmup, 1))
    iters = budgeted_count(iters, estimate_us, budget_s, minimum=min(iters, 5))
    for i in range(warmup):
        graphs[i % len(graphs)].replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    _keep_gpu_busy(iters)
    for i in range(iters):
        starts[i].record()
        graphs[(warmup + i) % len(graphs)].replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


# ----------------------------------------------------------------------------------------------------------------
# One (shape, T): moe_ext and the peers
# ----------------------------------------------------------------------------------------------------------------

def release_memory() -> None:
    """Return cached blocks between points, so one large layer's memory does not crowd out the next."""
    gc.collect()
    torch.cuda.empty_cache()


@dataclass
class Run:
    """State of one benchmark run: arguments, device facts, metadata stamped on every record, the records."""

    args: argparse.Namespace
    device: torch.device
    l2: int
    meta: dict
    records: list
    triton_unavailable: str | None = None
    energy: EnergyCounter | None = None  # with --energy-seconds

    def add(self, record: dict) -> None:
        """Keep, print and save at once, so a run cut short still leaves every finished point on disk."""
        self.records.append(record)
        print(format_row(record), flush=True)
        write_records(self.records, self.args.out)

    def fail(self, point: Point, exc: Exception) -> None:
        """Record why a point has no time: a peer that cannot run here is skipped, anything else is an error."""
        if isinstance(exc, PeerUnavailable):
            self.add(failure_record(point, "skipped", str(exc), self.meta))
        else:
            self.add(failure_record(point, "error", f"{type(exc).__name__}: {exc}", self.meta))

    def attempt(self, point: Point, measure: Callable[[], dict]) -> None:
        """Run one point's measurement; a failure (out of memory, unsupported) becomes the point's record and
        the sweep goes on."""
        try:
            self.add(measure())
        except Exception as exc:  # noqa: BLE001
            self.fail(point, exc)
        finally:
            release_memory()

    def plan(self, point: Point) -> tuple[int, str | None]:
        """Weight copies the point rotates, and why it is skipped (its weights exceed --max-weight-gb) or None."""
        total = point.shape.num_local * point.weight_bytes_per_expert()
        copies = weight_copies(total, self.l2)
        if total * copies > self.args.max_weight_gb * 1e9:
            return copies, f"weights {total * copies / 1e9:.1f} GB exceed --max-weight-gb {self.args.max_weight_gb:g}"
        return copies, None

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def rotated(items: list, copies: list, count: int) -> list[tuple]:
    """(input set, weight copy) of each of `count` graphs, both taken round-robin."""
    return [(items[j % len(items)], copies[j % len(copies)]) for j in range(count)]


def timed(run: Run, point: Point, forwards: list[Callable[[], torch.Tensor]], stats: RoutingStats,
          **extra) -> dict:
    """Capture, replay and time a point's forwards, then check the outputs are finite: random inputs with these
    magnitudes never overflow, so a NaN marks a broken run rather than a slow one."""
    graphs, outputs = capture_graphs(forwards)
    samples = time_replays(graphs, run.args.warmup, run.args.iters, run.args.max_seconds_per_point)
    state = gpu_state(run.device)
    if run.args.energy_seconds > 0:
        state.update(replay_energy(graphs, statistics.median(samples), run.args.energy_seconds, run.energy))
    finite = all(bool(torch.isfinite(out).all()) for out in outputs)
    return build_record(point, samples, stats, run.meta, graphs=len(graphs), output_finite=finite, **state, **extra)


def measure_moe_ext(run: Run, point: Point, pairs: list[tuple], stats: RoutingStats, copies: int) -> dict:
    """CuteDslMoEWrapper with use_cuda_graph and max_num_tokens=T, run once eagerly (under autotune with --tactic
    tuned) and then captured per input set: the capture recipe of the README."""
    shape = point.shape
    wrapper = moe_ext.CuteDslMoEWrapper(
        shape.num_experts, shape.top_k, point.hidden, point.inter, use_cuda_graph=True,
        max_num_tokens=point.num_tokens, num_local_experts=shape.num_local, local_expert_offset=shape.local_offset,
        device=run.device, use_fused_finalize=FINALIZE[point.finalize], quant_mode=point.quant_mode,
        **shape.wrapper_kwargs())
    given = run.args.tactic if isinstance(run.args.tactic, tuple) else None
    forwards = [lambda i=i, w=w: wrapper.run(**i, **w, tactic=given) for i, w in pairs]
    with moe_ext.autotune(run.args.tactic == "tuned"):
        forwards[0]()
    return timed(run, point, forwards, stats, weight_copies=copies, tactic=list(wrapper.last_tactic))


def run_moe_ext(run: Run, shape: Shape, num_tokens: int, quant_mode: str, dims: tuple[int, int],
                sets: list[RoutingSet], stats: RoutingStats) -> None:
    """moe_ext in one quant mode, every requested finalize, sharing one set of weights and inputs."""
    points = [Point(shape, num_tokens, "moe_ext", quant_mode, f, *dims) for f in run.args.finalize]
    copies, reason = run.plan(points[0])
    if reason:
        for point in points:
            run.add(failure_record(point, "skipped", reason, run.meta))
        return
    try:
        weights = [random_moe_ext_weights(points[0], run.device, run.generator(sets[0].seed + c))
                   for c in range(copies)]
        inputs = [moe_ext_inputs(s, dims[0], quant_mode, run.device) for s in sets]
    except Exception as exc:  # noqa: BLE001
        for point in points:
            run.fail(point, exc)
        release_memory()
        return
    pairs = rotated(inputs, weights, max(len(inputs), copies))
    for point in points:
        run.attempt(point, lambda point=point: measure_moe_ext(run, point, pairs, stats, copies))


def peer_point(shape: Shape, num_tokens: int, impl: str) -> Point:
    """A peer runs the model's own (H, I): it supports them, and that is the problem a user has."""
    return Point(shape, num_tokens, impl, PEER_QUANT_MODE[impl], PEER_FINALIZE[impl], shape.hidden, shape.inter)


def run_grouped_mm(run: Run, shape: Shape, num_tokens: int, sets: list[RoutingSet], stats: RoutingStats) -> None:
    """The bf16 torch._grouped_mm composite on the same routing sets."""
    point = peer_point(shape, num_tokens, "torch_grouped_mm_bf16")
    copies, reason = run.plan(point)
    if reason:
        run.add(failure_record(point, "skipped", reason, run.meta))
        return

    def measure() -> dict:
        weights = [random_bf16_weights(point, run.device, run.generator(sets[0].seed + c)) for c in range(copies)]
        inputs = [(random_activations(num_tokens, shape.hidden, s.seed, run.device), s.ids, s.weights)
                  for s in sets]
        forwards = [lambda i=i, w=w: grouped_mm_moe(*i, *w, shape.local_offset, shape.act)
                    for i, w in rotated(inputs, weights, max(len(inputs), copies))]
        forwards[0]()  # eager warm-up: cuBLAS handles and workspaces exist before capture
        return timed(run, point, forwards, stats, weight_copies=copies)

    run.attempt(point, measure)


def run_triton_kernels(run: Run, shape: Shape, num_tokens: int, sets: list[RoutingSet],
                       stats: RoutingStats) -> None:
    """triton_kernels' MXFP4 matmul_ogs on the same routing (it routes from the same logits)."""
    point = peer_point(shape, num_tokens, "triton_kernels_mxfp4")
    copies, reason = run.plan(point)
    if shape.num_local != shape.num_experts:
        reason = "expert-parallel routing (one rank's slice of the experts) is not expressed for triton_kernels"
    if reason:
        run.add(failure_record(point, "skipped", reason, run.meta))
        return

    def measure() -> dict:
        moes = [TritonKernelsMxfp4(*random_mxfp4_kn_weights(point, run.device, run.generator(sets[0].seed + c)),
                                   shape.top_k, shape.act, num_tokens=num_tokens) for c in range(copies)]
        inputs = [(random_activations(num_tokens, shape.hidden, s.seed, run.device), s.logits) for s in sets]
        forwards = [lambda i=i, m=m: m(*i) for i, m in rotated(inputs, moes, max(len(inputs), copies))]
        forwards[0]()  # eager warm-up: Triton compiles its kernels before capture
        return timed(run, point, forwards, stats, weight_copies=copies)

    run.attempt(point, measure)


def moe_ext_dims(run: Run, shape: Shape) -> dict[str, tuple[int, int]]:
    """(H, I) moe_ext runs on its kernels per requested mode, padded where the model's own are refused (said so);
    a mode with none is recorded as skipped for every T and finalize."""
    dims = {}
    for mode in run.args.modes if "moe_ext" in run.args.impls else ():
        try:
            dims[mode] = supported_dims(shape, mode, run.device)
        except ValueError as exc:
            print(f"moe_ext skipped: {exc}", flush=True)
            for num_tokens in run.args.tokens:
                for finalize in run.args.finalize:
                    point = Point(shape, num_tokens, "moe_ext", mode, finalize, shape.hidden, shape.inter)
                    run.add(failure_record(point, "skipped", str(exc), run.meta))
            continue
        if dims[mode] != (shape.hidden, shape.inter):
            print(f"{shape.name}: (H, I) = ({shape.hidden}, {shape.inter}) does not run on the kernels for {mode} "
                  f"({kernel_rejection(shape, mode, shape.hidden, shape.inter, run.device)}); running the nearest "
                  f"supported padding (H, I) = {dims[mode]}", flush=True)
    return dims


def run_shape(run: Run, shape: Shape) -> None:
    """Every requested T of one layer: one set of rotated routings per T, shared by every implementation."""
    dims = moe_ext_dims(run, shape)
    for num_tokens in run.args.tokens:
        smallest = expected_experts_hit(num_tokens, shape) * weight_bytes_per_expert(
            "nvfp4", shape.hidden, shape.inter, 2 * shape.inter)
        count = rotation_count(smallest, run.l2, minimum=run.args.min_rotations)
        sets = [random_routing(num_tokens, shape, point_seed(run.args.seed, shape, num_tokens, i), run.device)
                for i in range(count)]
        stats = routing_stats([s.ids for s in sets], shape.num_local, shape.local_offset)
        for mode in dims:
            run_moe_ext(run, shape, num_tokens, mode, dims[mode], sets, stats)
        if "torch_grouped_mm_bf16" in run.args.impls:
            run_grouped_mm(run, shape, num_tokens, sets, stats)
        if "triton_kernels_mxfp4" in run.args.impls and run.triton_unavailable is None:
            run_triton_kernels(run, shape, num_tokens, sets, stats)
        del sets
        release_memory()


# ----------------------------------------------------------------------------------------------------------------
# Host overhead
# ----------------------------------------------------------------------------------------------------------------

def host_time_us(forward: Callable[[], object], calls: int, warmup: int = 10, batches: int = HOST_BATCHES) -> float:
    """Host microseconds per eager call, no synchronisation inside a batch: what the CPU spends launching. The
    median of `batches` batch means, so one descheduled batch on a shared host does not decide the number (single
    batches of the same build read 22-35 µs). `calls` must stay small (~100) so the GPU's launch queue never fills
    and blocks the host; the queue drains between batches."""
    for _ in range(warmup):
        forward()
    means = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            forward()
        means.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(means)


def _cudart():
    try:
        from cuda.bindings import runtime
    except ImportError:
        from cuda import cudart as runtime
    return runtime


def graph_kernel_nodes(forward: Callable[[], object]) -> tuple[int, int]:
    """(kernel nodes, all nodes) of a captured forward, read from the cudaGraph_t with cuda-python."""
    runtime = _cudart()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        forward()
    handle = runtime.cudaGraph_t(init_value=graph.raw_cuda_graph())
    err, _, count = runtime.cudaGraphGetNodes(handle, 0)
    err, nodes, count = runtime.cudaGraphGetNodes(handle, count)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes: {err}")
    kinds = [runtime.cudaGraphNodeGetType(node)[1] for node in nodes[:count]]
    return sum(k == runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel for k in kinds), count


def profiled_kernels(forward: Callable[[], object]) -> int:
    """Kernels torch.profiler sees in one eager forward (memcpy / memset excluded): the fallback count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset")))


def measure_host_overhead(run: Run, point: Point) -> dict:
    """Host time of an eager CuteDslMoEWrapper.run at T=1 (max_num_tokens=1, so nothing is allocated per call)
    and the kernel nodes of the same forward captured in a CUDA graph."""
    shape, dims = point.shape, (point.hidden, point.inter)
    routing = random_routing(1, shape, point_seed(run.args.seed, shape, 1, 0), run.device)
    inputs = dict(moe_ext_inputs(routing, dims[0], point.quant_mode, run.device),
                  **random_moe_ext_weights(point, run.device, run.generator(routing.seed)))
    common = dict(num_local_experts=shape.num_local, local_expert_offset=shape.local_offset, device=run.device,
                  use_fused_finalize=FINALIZE[point.finalize], quant_mode=point.quant_mode, max_num_tokens=1,
                  **shape.wrapper_kwargs())
    eager = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, *dims, **common)
    host_us = host_time_us(lambda: eager.run(**inputs), run.args.host_iters)
    graphed = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, *dims, use_cuda_graph=True, **common)
    graphed.run(**inputs)
    try:
        kernels, nodes = graph_kernel_nodes(lambda: graphed.run(**inputs))
        method = "cudaGraphGetNodes"
    except Exception:  # noqa: BLE001  (no cuda-python or no raw graph access: count one eager forward instead)
        kernels, nodes, method = profiled_kernels(lambda: eager.run(**inputs)), None, "torch.profiler"
    return dict(point.identity(), host_us=round(host_us, 2), host_calls=run.args.host_iters,
                host_statistic=f"median of {HOST_BATCHES} batch means", kernel_nodes=kernels,
                graph_nodes=nodes, kernel_count_method=method, **run.meta)


def run_host_overhead(run: Run, shape: Shape, quant_mode: str) -> None:
    """--host-overhead for one layer and mode, every requested finalize."""
    try:
        dims, reason = supported_dims(shape, quant_mode, run.device), None
    except ValueError as exc:
        dims, reason = (shape.hidden, shape.inter), str(exc)
    for finalize in run.args.finalize:
        point = Point(shape, 1, "moe_ext", quant_mode, finalize, *dims)
        if reason:
            run.add(failure_record(point, "skipped", reason, run.meta))
        else:
            run.attempt(point, lambda point=point: measure_host_overhead(run, point))


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------

def git_revision(directory: Path) -> str:
    """HEAD of the tree the code ran from, with "-dirty" when it has uncommitted changes."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=directory, capture_output=True, text=True, check=True).stdout
    try:
        return git("rev-parse", "HEAD").strip() + ("-dirty" if git("status", "--porcelain").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_metadata(argv: list[str] | None, gpu: str) -> dict:
    """What every record carries so a number can be traced to its command, code and machine."""
    command = shlex.join(sys.argv if argv is None else ["python", "-m", "moe_ext.bench", *argv])
    return dict(command=command, git_rev=git_revision(Path(__file__).resolve().parent), gpu=gpu,
                torch=torch.__version__, cuda=torch.version.cuda)


def write_records(records: list[dict], path: str) -> None:
    """Write the JSON list atomically (a reader never sees half a file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, out)


TABLE_HEADER = (f"{'shape':<17} {'T':>6} {'impl':<22} {'mode':<6} {'finalize':<18} {'us':>10} {'TB/s':>7} "
                f"{'TFLOP/s':>8} {'roof%':>6}")


def format_row(record: dict) -> str:
    """One line per record: the measurement, or why there is none."""
    shape = record["shape"] + ("*" if "padded_from" in record else "")
    head = (f"{shape:<17} {str(record['T']):>6} {record['impl']:<22} {record['quant_mode']:<6} "
            f"{record['finalize']:<18}")
    if "us" in record:
        return (f"{head} {record['us']:>10.1f} {record['tbps']:>7.3f} {record['tflops']:>8.1f} "
                f"{record['roofline_fraction'] * 100:>5.1f}%")
    if "host_us" in record:
        return f"{head} host {record['host_us']:.1f} us/call, {record['kernel_nodes']} kernel nodes"
    return f"{head} {'ERROR' if 'error' in record else 'skipped'}: {record.get('error', record.get('skipped'))}"


def annotate_speedups(records: list[dict]) -> None:
    """Give every measured moe_ext record `speedup_vs`: {peer: peer time / moe_ext time} for each peer measured at
    the same (shape, T), i.e. on the same routing sets (> 1: moe_ext is faster)."""
    peer_us = {(r["shape"], r["T"], r["impl"]): r["us"] for r in records if "us" in r and r["impl"] in PEERS}
    for r in records:
        if "us" in r and r["impl"] == "moe_ext":
            r["speedup_vs"] = {p: peer_us[r["shape"], r["T"], p] / r["us"] for p in PEERS
                               if (r["shape"], r["T"], p) in peer_us}


def format_table(records: list[dict]) -> str:
    """The measured points grouped by (shape, T), each moe_ext row with its speedup over every measured peer,
    then the points without a time and why."""
    annotate_speedups(records)
    measured = [r for r in records if "us" in r]
    peers = [p for p in PEERS if any(r["impl"] == p for r in measured)]
    order = {name: i for i, name in enumerate(SHAPES)}
    measured.sort(key=lambda r: (order.get(r["shape"], len(order)), r["T"], IMPLS.index(r["impl"]),
                                 r["quant_mode"], r["finalize"]))
    lines = [TABLE_HEADER + "".join(f" {'vs ' + p:>28}" for p in peers)]
    for r in measured:
        speedup = r.get("speedup_vs", {})
        lines.append(format_row(r) + "".join(f" {f'{speedup[p]:.2f}x' if p in speedup else '-':>28}"
                                             for p in peers))
    if any("padded_from" in r for r in measured):
        lines.append("* moe_ext ran a padded (H, I) (padded_from in the JSON); peers ran the model's own dims.")
    lines += [format_row(r) for r in records if "us" not in r and "host_us" not in r]
    return "\n".join(lines)


def write_plot(records: list[dict], path: str) -> None:
    """--plot: the roofline PNG, an optional extra: a missing matplotlib is reported, not fatal."""
    from moe_ext.bench_plot import MatplotlibMissing, plot_roofline

    try:
        plot_roofline(records, path)
        print(f"roofline plot: {path}")
    except MatplotlibMissing as exc:
        print(f"--plot skipped: {exc}", file=sys.stderr)


def force_decode_form(form: str) -> None:
    """--decode-form: "fc2" drops the rule's step floor, "partials" turns the fc2_by_gemm1 forms off,
    "shallow_ring" their deep-ring variant, "split_gemm2" drops decode_splits_gemm2's floor of K steps a range (the
    kernel still sizes its ranges by its own decode_fused.GEMM2_MIN_STEPS: a build with a lower one is what this
    times). Refused when the form is not linked (the launcher would run the other one)."""
    needs = {"fc2": dict(fc2_by_gemm1=True), "partials": {}, "split_gemm2": dict(split_gemm2=True)}.get(form)
    if needs is not None and not launcher.has_kernel(launcher.decode_kernel("swiglu", **needs)):
        raise SystemExit(f"--decode-form {form}: the launcher links no such decode objects (a build older than the "
                         "tree?)")
    if form == "fc2":
        launcher.DECODE_FC2_MIN_RANGE_STEPS = 0
    elif form == "partials":
        launcher.DECODE_FC2_BY_GEMM1 = False
    elif form == "shallow_ring":
        launcher.DECODE_DEEP_RING = False
    elif form == "split_gemm2":
        launcher.DECODE_GEMM2_MIN_STEPS = 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_ext.bench needs a CUDA GPU (it times sm_90a kernels by CUDA-graph replay); torch "
              f"{torch.__version__} sees none here. Run it on the H200.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    force_decode_form(args.decode_form)
    run = Run(args, device, l2_bytes(device), run_metadata(argv, torch.cuda.get_device_name(device)), [])
    if args.energy_seconds > 0:
        run.energy = EnergyCounter(device.index)
    print(f"{run.meta['gpu']}, torch {run.meta['torch']}, L2 {run.l2 / 2 ** 20:.0f} MiB, tree {run.meta['git_rev']}")
    print(f"writing {args.out}\n{TABLE_HEADER}", flush=True)
    if args.host_overhead:
        for name in args.shapes:
            for mode in args.modes:
                run_host_overhead(run, SHAPES[name], mode)
        return 0
    if "triton_kernels_mxfp4" in args.impls:
        run.triton_unavailable = triton_kernels_unavailable()
        if run.triton_unavailable:
            print(f"triton_kernels_mxfp4 skipped for the whole run: {run.triton_unavailable}", flush=True)
            run.add(dict(shape="all", T=None, quant_mode=PEER_QUANT_MODE["triton_kernels_mxfp4"],
                         finalize=PEER_FINALIZE["triton_kernels_mxfp4"], impl="triton_kernels_mxfp4",
                         skipped=run.triton_unavailable, **run.meta))
    for name in args.shapes:
        run_shape(run, SHAPES[name])
    print("\n" + format_table(run.records))
    write_records(run.records, args.out)  # now with speedup_vs on the moe_ext records
    if args.plot:
        write_plot(run.records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
