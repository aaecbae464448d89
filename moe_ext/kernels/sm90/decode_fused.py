"""The whole small-T forward in one launch (sm_90a): routing, GEMM1, GEMM2 and the fused finalize of a w4a16 layer.

At decode the chain routing -> GEMM1 -> GEMM2 is three latency-bound kernels with a launch gap between each:
Qwen3-30B-A3B at T=1 spent ~27.5 µs on ~19 MB of weights (~4.5 µs at the H200's bandwidth), ~6 µs of it in the
gaps and GEMM1 on only 96-192 CTAs. Here one cooperative grid, two CTAs an SM, does it all:

  1. every CTA routes the T * top_k pairs itself, in shared memory (no routing launch, no maps in global memory):
     rows sorted by (local expert, pair), 8-row tiles of one expert each, and zeroes its share of the output;
  2. GEMM1: work items (row tile, 128 weight rows, K range) spread over the grid, the K ranges sized so the items
     fill it (`splits`); each range leaves its fp32 partial tile in `partials`, then counts itself in on its row
     tile's readiness word;
  3. GEMM2: items (row tile, 128 hidden rows), each waiting for its own row tile's readiness word and for every
     CTA's zeroing (a count of its own), not for the whole grid: a tile whose GEMM1 items are done goes on while
     others finish (a grid-wide barrier opened ~1.3 µs after its last arrival, session 38's timeline). In the
     partials forms an item issues its first weight copies before it waits (GEMM2_PRIMED_STAGES). They are
     handed out from the last CTA down, so the CTAs GEMM1's uneven stride left with fewer items take them. Their token
     staging sums GEMM1's partials in rank order (as the cluster split-K of gemm1.py does), applies alpha and the
     activation and rounds to bf16 - the FC2 input gemm1.py would have stored - and the epilogue reduce-adds the
     router-weighted rows into the output (gemm2.py's fused finalize: one bf16 value a pair). In the kernel's
     split_gemm2 form, for the few GEMM2 items of a long K (DeepSeek-V3's EP8 shard: 56 items of 16 steps at T=1),
     items also take K ranges, sized as GEMM1's but of GEMM2_MIN_STEPS at least: each range leaves its fp32 tile
     in the workspace and the range that arrives last sums them in rank order before that epilogue.

In the fc2_by_gemm1 forms GEMM1's ranges meet that way instead (gemm1_epilogue): the last to arrive sums them,
applies the activation and stores the bf16 FC2 input once, which GEMM2 then stages as GEMM1 stages x; both stage
their first token chunk with its loads issued ahead of the weight copies (stream.LoadsFirst). The meeting costs each
split GEMM1 item an arrival and a sum (~1.7 µs on the H100) and saves GEMM2's staging its serial sums, so neither
form wins everywhere (launcher.decode_fc2_by_gemm1 picks).

Both GEMMs run one copy of stream.py's mainloop on 8-token tiles (a loop over the two phases: with a copy each and
the staging unrolled the kernel was 13,184 instructions and 41% of its stalls waited for instruction fetch). The
output is as deterministic as the fused finalize (its bf16 reduce-adds); the launcher takes this path for
T * top_k <= MAX_PAIRS when the tactic says so (launcher.FUSED_DECODE).

w4a4 and w4a8 (make_kernel's `mode`; the fc2_by_gemm1 forms) run the same kernel on NVFP4 / MXFP8 activations:
GEMM1's staging loads x's codes and scale and decodes them into the token tile (the kernel chain decodes them in
its routing launch, a node this form would add back), and GEMM1's epilogue quantizes the FC2 input and stores it
decoded, as gemm1.py does. Their GEMM2 is w4a16's on MXFP4 or NVFP4 weights. Before, a quantized forward ran the
chain at T=1 (routing, GEMM1, GEMM2 and the output's zeroing: 1.37-1.54x w4a16's time on Qwen3-30B-A3B and
DeepSeek-V3 EP8, H100, h100_session53_quant_modes_t1_t64.json).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, GridConstant, Int32, Int64
from cutlass.experimental.cuda import TensorMap

from . import activations, ptx, quantize
from . import stream as streaming
from .fp4 import ue8m0_to_f32

TOKENS = 8  # rows of a routing tile: one mma.sync n8 column block
MAX_PAIRS = 64  # T * top_k the in-kernel routing holds (shared-memory arrays of this length)
MAX_SPLITS = 8  # K ranges of a weight tile: the partials workspace holds this many tiles
# GEMM2 K steps a range at least: Qwen3-30B-A3B T=1's 2 ranges of 3 steps were 1.07x slower than one
# (h200_session36_checks.md; on the H100 with session 44's kernel, 22.8 against 21.1 us: h100_session45_checks.md)
GEMM2_MIN_STEPS = 4
# Weight stages a GEMM2 item of the partials forms issues before it waits for its routing tile (stream.TokensReady),
# so they land while it waits and its partial loads after the wait do not queue behind them (H100, session 43:
# Qwen3-30B-A3B T=1 21.5 -> 21.15 us, DeepSeek-V3 EP8 T=1 27.45 -> 26.75). The fc2 forms, whose FC2-input loads
# already go out ahead of the copies, lost 0.5-1.4 us with it (the copies contend with GEMM1's last items).
GEMM2_PRIMED_STAGES = 4
# Two CTAs an SM (128 registers: the three-CTA form's 80 spill here), 2048-K token chunks, each staged with all of a
# thread's loads in flight (stream.TokenLoads' unrolled form and stream.LoadsFirst).
CONFIG = replace(streaming.config_for(TOKENS, 1), token_elems=TOKENS * 2048)
# The partials forms walk their ring in a loop instead of a pass unrolled (3,558 instructions against 5,186,
# SwiGLU): H100 graph replays, 5 rounds, DeepSeek-V3 EP8 T=1 26.7 -> 26.0 us, Qwen3-30B-A3B T=1 21.2 either way
# (h100_session44_checks.md). The fc2 forms keep the unrolled pass: without it Qwen3 T=2 and Mixtral T=1-4
# (DeepSeek-V3 EP8 T=8 too) ran 0.3-2.3 us slower.
PARTIALS_CONFIG = replace(CONFIG, unroll_ring=False)
# The fc2 form's deep-ring variant (make_kernel's deep_ring): 6 stages in a loop (no spills; unrolled, or 8
# stages, it spilled). H100 graph replays, two rounds: 0.6-3.4% faster where CTAs stream several items (Qwen3-30B-A3B
# T = 4 / 8, DeepSeek-V3 T = 2-8, Mixtral T = 4 / 8), slower where an item's first landing sets the pace (EP8 T=4
# 1.85 us, Qwen3 T=2 0.35): a burst of 6 stages a CTA lands later (launcher.decode_deep_ring picks).
DEEP_CONFIG = replace(CONFIG, stages=6, unroll_ring=False)
# The quant modes built: the weights' scale block (NVFP4 e4m3 per 16, MXFP4 ue8m0 per 32), and the activations' codes
# (x_sf's scale block is the weights': semantics §1.2) and their quantized FC2 input's scale block.
MODES = ("w4a16", "w4a4", "w4a8")
WEIGHT_BLOCK = {"w4a16": 16, "w4a4": 16, "w4a8": 32}
FC2_BLOCK = {"w4a4": 16, "w4a8": 32}
# The timeline build (make_kernel's `timeline`): thread 0 of each CTA writes TIMELINE_WORDS u32 words at
# TIMELINE[...] past the count buffer's words (launcher.decode_count_words), CTA after CTA; the caller allocates
# them (benchmarks/decode_timeline.py). Clocks are the SM's cycle counter; the *_ns words the GPU's global timer.
# A phase's words start at 8 (GEMM1) and 16 (GEMM2): its first item's start, first token staging done, first
# stages landed, first item's mainloop done (accumulators in shared memory), last item's mainloop done, the
# phase's end (items and their epilogues done), the phase's item count, the K steps of an item (its range). Words
# 27-30: each phase's first weight copies issued and first token loads in (thread 0's); word 7 (barrier_passed):
# its first GEMM2 item's wait for its tile and the zeroing over.
TIMELINE_WORDS = 32
TIMELINE = dict(start_ns_lo=0, start_ns_hi=1, sm=2, start=3, waited=4, routed=5, zeroed=6, barrier_passed=7,
                end=24, end_ns_lo=25, end_ns_hi=26, gemm1_issued=27, gemm1_loaded=28, gemm2_issued=29,
                gemm2_loaded=30)
TIMELINE_PHASE = ("item", "staged", "landed", "first_done", "last_done", "end", "items", "steps")
# The count buffer's u32 words (launcher.decode_count_words): word 0 the zeroing's (every CTA counts in), from
# READINESS_WORD one a row tile (its GEMM1 items count in), then an arrival count a GEMM1 item (row tile, weight
# tile: the fc2 forms' range meeting) and one a GEMM2 item (the split form's). The first two are flip counts
# (ptx.flip_count): each of their 1 + MAX_PAIRS words flips once a launch - a tile the routing did not make by
# CTA 0 - so every word's top bit before a launch is word 0's, which each CTA reads before it counts in.
READINESS_WORD = 4


class RoutePlan(NamedTuple):
    """Shared-memory routing of one CTA (every CTA builds the same)."""

    pair_expert: cute.Tensor  # local expert of pair q (token_selected_experts flat), -1 if not local
    pair_rows: cute.Tensor  # rows of pair q's expert on the pair that comes first for it, else 0
    row_pair: cute.Tensor  # pair of sorted row r (rows by local expert, then pair)
    tile_expert: cute.Tensor  # local expert of 8-row tile t
    tile_row0: cute.Tensor  # its first row
    tile_limit: cute.Tensor  # one past its last row
    # Scalars read back where used rather than held in registers across loops (at the 128-register cap they
    # spilled to local memory): [0] whether this CTA's K range arrived last at its item (ptx.arrive_last), [1] the
    # split_gemm2 form's GEMM2 item arrival count, [2] its GEMM2 K ranges at most (GEMM2_MIN_STEPS each), [3] the
    # flip counts' word 0 before this launch's flips.
    arrival: cute.Tensor


def allocate_plan() -> RoutePlan:
    smem = cutlass.utils.SmemAllocator()
    return RoutePlan(*(smem.allocate_tensor(Int32, cute.make_layout(MAX_PAIRS), byte_alignment=16)
                       for _ in RoutePlan._fields))


@cute.jit
def route_pairs(plan: RoutePlan, tid, ids: cute.Tensor, pairs, num_experts, offset):
    """Fill `plan` from the expert ids (pairs <= MAX_PAIRS <= threads) and return the number of row tiles. Each
    pair finds its row by counting the pairs ordered before it; the first pair of each expert lays out that
    expert's tiles after those of the smaller experts."""
    expert = Int32(-1)
    if tid < pairs:
        local = ids[tid] - offset
        if local >= 0 and local < num_experts:
            expert = local
        plan.pair_expert[tid] = expert
        plan.pair_rows[tid] = Int32(0)
    cute.arch.sync_threads()
    row = Int32(0)
    rows = Int32(0)
    first = Int32(1)
    if tid < pairs and expert >= 0:
        for q in cutlass.range(pairs):
            other = plan.pair_expert[q]
            same = other == expert
            row += cutlass.select_((other >= 0) & ((other < expert) | (same & (q < tid))), Int32(1), Int32(0))
            rows += cutlass.select_(same, Int32(1), Int32(0))
            first = cutlass.select_(same & (q < tid), Int32(0), first)
        plan.row_pair[row] = tid
        if first == 1:
            plan.pair_rows[tid] = rows
    cute.arch.sync_threads()
    if tid < pairs and expert >= 0 and first == 1:
        tile0 = Int32(0)
        for q in cutlass.range(pairs):
            n = plan.pair_rows[q]
            tile0 += cutlass.select_((n > 0) & (plan.pair_expert[q] < expert), (n + TOKENS - 1) // TOKENS, Int32(0))
        for j in cutlass.range((rows + TOKENS - 1) // TOKENS):
            plan.tile_expert[tile0 + j] = expert
            plan.tile_row0[tile0 + j] = row + j * TOKENS
            plan.tile_limit[tile0 + j] = row + cute.math.min(rows, (j + 1) * TOKENS)
    tiles = Int32(0)
    for q in cutlass.range(pairs):
        tiles += (plan.pair_rows[q] + TOKENS - 1) // TOKENS
    cute.arch.sync_threads()
    return tiles


@cute.jit
def mark(on: cutlass.Constexpr, tid, words: Int64, slot):
    """In the timeline build (`on`), thread 0 writes the SM clock to TIMELINE word `slot` of its CTA's at `words`."""
    if cutlass.const_expr(on):
        if tid == 0:
            ptx.st_global_b32(words + Int64(slot) * 4, ptx.sm_clock())


@cute.jit
def mark_value(on: cutlass.Constexpr, tid, words: Int64, slot, value):
    """mark's twin for a value other than the clock (the start's timer words, the SM, a phase's item count)."""
    if cutlass.const_expr(on):
        if tid == 0:
            ptx.st_global_b32(words + Int64(slot) * 4, Int32(value))


def splits(ctas, items, steps, min_steps):
    """K ranges per weight tile: as many as keep `items` x ranges within the grid, each range at least `min_steps`
    128-K steps, at most MAX_SPLITS (the partials workspace holds that many tiles a row)."""
    s = cute.math.max(Int32(1), ctas // cute.math.max(Int32(1), items))
    return cute.math.max(Int32(1), cute.math.min(cute.math.min(s, Int32(MAX_SPLITS)), steps // min_steps))


@cute.jit
def wait_for_tile(tid, zeroed_word: Int64, tile_word: Int64, before: Int32, timeline: cutlass.Constexpr,
                  timeline0: Int64, first_in_cta):
    """Thread 0 waits for the flips of the zeroing's word and a routing tile's readiness word (ptx.flip_wait), and
    the CTA barrier after it passes what they published on to every thread."""
    if tid == 0:
        ptx.flip_wait(zeroed_word, tile_word, before)
    cute.arch.sync_threads()
    if first_in_cta:
        mark(timeline, tid, timeline0, TIMELINE["barrier_passed"])


def readiness_word(barrier: cute.Tensor, t) -> Int64:
    """Address of row tile t's readiness count: its GEMM1 items' flip count."""
    return barrier.iterator.toint() + Int64(READINESS_WORD + t) * 4


def arrival_word(barrier: cute.Tensor, index) -> Int64:
    """Address of arrival count `index`: a GEMM1 item's (row tile, weight tile) at t * n1 // 128 + n_tile, a split
    GEMM2 item's at pairs * n1 // 128 + t * hidden // 128 + n_tile (kept apart: a tile's GEMM2 items may meet
    while another tile's GEMM1 ranges still do)."""
    return barrier.iterator.toint() + Int64(READINESS_WORD + MAX_PAIRS + index) * 4


def gemm2_partial(partials: cute.Tensor, pairs, n1, hidden, rank, row, col) -> Int64:
    """Address of GEMM2 K range `rank`'s fp32 partial at (sorted row, hidden column), after GEMM1's MAX_SPLITS
    ranges of n1 columns. Made at each use from the kernel's parameters: kept live across the item loop, the
    addresses cost registers the two-CTA form does not have."""
    return partials.iterator.toint() + (Int64(MAX_SPLITS * pairs) * Int64(n1) + Int64(rank * pairs + row) * Int64(
        hidden) + Int64(col)) * 4


def gemm1_partial(partials: cute.Tensor, pairs, n1, rank, row, col) -> Int64:
    """Address of GEMM1 K range `rank`'s fp32 partial at (sorted row, n1 column)."""
    return partials.iterator.toint() + (Int64(rank * pairs + row) * Int64(n1) + Int64(col)) * 4


def fc2_input_address(partials: cute.Tensor, pairs, n1, hidden) -> Int64:
    """Start of the bf16 FC2 input [sorted row][inter] that GEMM1's epilogues write and GEMM2 stages: after both
    GEMMs' fp32 partial tiles (launcher.decode_partial_floats)."""
    return partials.iterator.toint() + Int64(MAX_SPLITS * pairs) * Int64(n1 + hidden) * 4


def finalize(sm, plan: RoutePlan, a_row, c0, row, col, w2_alpha: cute.Tensor, expert,
             token_final_scales: cute.Tensor, out_address: Int64, by_top_k, hidden) -> None:
    """gemm2.py's fused finalize of a thread's accumulators (sm.out[a_row, c0...]) of sorted row `row` at hidden
    column `col`: router-weighted bf16 adds into the output row of its token."""
    out_cols = CONFIG.rows * TOKENS // CONFIG.threads
    pair = plan.row_pair[row]
    scale = w2_alpha[expert] * token_final_scales[pair]
    words = [ptx.pack_bf16x2(scale * sm.out[a_row, c0 + 2 * i], scale * sm.out[a_row, c0 + 2 * i + 1])
             for i in range(out_cols // 2)]
    address = out_address + (Int64(ptx.divide_by_magic(pair, by_top_k)) * Int64(hidden) + Int64(col)) * 2
    ptx.write_words(address, words, ptx.red_add_bf16x2_v4, ptx.red_add_bf16x2)


@cute.jit
def gemm1_epilogue(sm, plan: RoutePlan, tid, partials: cute.Tensor, barrier: cute.Tensor, pairs, n1, hidden, inter,
                   t, n_tile, rank, ranges, row0, limit, alpha, params, fc2_input_scale: cute.Tensor,
                   kind: cutlass.Constexpr, mode: cutlass.Constexpr):
    """A GEMM1 item's epilogue: where the weight tile's K is split, each range leaves its fp32 tile in the workspace
    and the range that arrives last sums them in rank order (the cluster split-K's order, gemm1.py); the sum gets
    gemm1.py's epilogue (alpha, the activation, bf16 or in w4a4 / w4a8 its quantization decoded) and is stored as
    the rows' FC2 input. Once a tile here, where GEMM2's staging had summed the ranges again in each of its
    hidden / 128 items, one range after another. A warp writes one row, 2 (gated) or 4 values a lane, so a scale
    block's lanes share its absolute maximum by butterfly shuffles (max is exact in any order: the same scale as
    gemm1.py's one thread a block)."""
    cfg = CONFIG
    out_cols = cfg.rows * TOKENS // cfg.threads
    a_row = tid // (cfg.threads // TOKENS)
    c0 = (tid % (cfg.threads // TOKENS)) * out_cols
    live = a_row < limit - row0
    col = n_tile * cfg.rows + c0
    last = Int32(1)
    if ranges > 1:
        if live:
            ptx.write_words(gemm1_partial(partials, pairs, n1, rank, row0 + a_row, col),
                            [sm.out[a_row, c0 + i].bitcast(Int32) for i in range(out_cols)])
        cute.arch.sync_threads()
        if tid == 0:
            plan.arrival[0] = ptx.arrive_last(arrival_word(barrier, t * (n1 // cfg.rows) + n_tile), ranges)
        cute.arch.sync_threads()
        last = plan.arrival[0]
        if last == 1 and live:  # every range's load in flight at once (the clamped ones repeat the last)
            loaded = [ptx.ld_global_cg_v4(gemm1_partial(partials, pairs, n1, cute.math.min(Int32(r), ranges - 1),
                                                        row0 + a_row, col))
                      for r in range(MAX_SPLITS)]
            for i in cutlass.range_constexpr(out_cols):
                total = Float32(0.0)
                for r in cutlass.range_constexpr(MAX_SPLITS):
                    total = cutlass.select_(Int32(r) < ranges, total + loaded[r][i].bitcast(Float32), total)
                sm.out[a_row, c0 + i] = total
        cute.arch.sync_threads()
    if last == 1:
        gated = kind != "relu2"
        per_thread = cfg.rows // (2 if gated else 1) * TOKENS // cfg.threads  # FC2 inputs a thread (2 or 4)
        width = cfg.rows // (2 if gated else 1)  # FC2 columns of the weight tile: up and gate 64 apart
        row = tid // (width // per_thread)
        j = (tid % (width // per_thread)) * per_thread
        assert width // per_thread == 32, "a warp a row: the shuffles below stay inside a row's warp"
        if row < limit - row0:
            values = [activations.apply(kind, sm.out[row, j + e] * alpha if gated else None,
                                        sm.out[row, width * int(gated) + j + e] * alpha, params)
                      for e in range(per_thread)]
            if cutlass.const_expr(mode == "w4a16"):
                words = [ptx.pack_bf16x2(values[2 * e], values[2 * e + 1]) for e in range(per_thread // 2)]
            else:
                amax = quantize.amax_of(values)
                for b in cutlass.range_constexpr((FC2_BLOCK[mode] // per_thread).bit_length() - 1):
                    amax = cute.math.max(amax, cute.arch.shuffle_sync_bfly(amax, 1 << b))
                if cutlass.const_expr(mode == "w4a4"):
                    words = quantize.dequantized_nvfp4_per_tensor(values, fc2_input_scale[0], amax)
                else:
                    words = quantize.dequantized_mxfp8(values, amax)
            address = fc2_input_address(partials, pairs, n1, hidden) + (Int64(row0 + row) * Int64(inter) + Int64(
                n_tile * width + j)) * 2
            if cutlass.const_expr(per_thread == 4):
                ptx.st_global_v2(address, words[0], words[1])
            else:
                ptx.st_global_b32(address, words[0])


def make_kernel(kind: str, gemms: tuple = (True, True), split_gemm2: bool = False, timeline: bool = False,
                fc2_by_gemm1: bool = False, deep_ring: bool = False, mode: str = "w4a16"):
    """gemms: which GEMM phases run their items (a timing variant without one of them times the rest of the
    kernel: benchmarks/decode_phase_variants.py); the routing, the zeroing and the counts always run.
    split_gemm2: GEMM2 items split K too (GEMM2_MIN_STEPS). A separate build: the arrival and the sum of the
    ranges cost the unsplit kernel 1-3% where it does not split (h200_session36_checks.md).
    timeline: a measurement build that also writes each CTA's TIMELINE words (same signature and results).
    fc2_by_gemm1: GEMM1's epilogues build the bf16 FC2 input (gemm1_epilogue) and both GEMMs stage their tokens
    with the first chunk's loads issued ahead of the weight copies (stream.LoadsFirst); otherwise GEMM2's staging
    sums GEMM1's partials and applies the activation, in a loop after the copies (stream.TokenLoads). Neither is
    faster everywhere (launcher.decode_fc2_by_gemm1).
    deep_ring: the unsplit fc2_by_gemm1 form's mainloop on DEEP_CONFIG's ring.
    mode: w4a16, or w4a4 / w4a8 (fc2_by_gemm1 forms only): x arrives as NVFP4 / MXFP8 codes with linear scales
    (x_sf), which GEMM1's staging decodes to bf16 (as the routing launch's decode does for the kernel chain), and
    GEMM1's epilogue stores the FC2 input's quantization decoded (gemm1.py's, with fc2_input_scale in w4a4)."""
    if deep_ring and (split_gemm2 or not fc2_by_gemm1):
        raise ValueError("deep_ring: only the unsplit fc2_by_gemm1 form has a deep-ring variant")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "w4a16" and not fc2_by_gemm1:
        raise ValueError(f"mode {mode}: only the fc2_by_gemm1 forms quantize the FC2 input")
    block = WEIGHT_BLOCK[mode]
    gated = kind != "relu2"
    cfg = DEEP_CONFIG if deep_ring else CONFIG if fc2_by_gemm1 else PARTIALS_CONFIG
    threads = cfg.threads
    out_cols = cfg.rows * TOKENS // threads  # GEMM epilogues: accumulator columns per thread (4)

    @cute.kernel
    def decode_kernel(x: cute.Tensor, x_sf: cute.Tensor, token_selected_experts: cute.Tensor,
                      token_final_scales: cute.Tensor,
                      w1_sf: cute.Tensor, w1_map: GridConstant[TensorMap], w1_alpha: cute.Tensor,
                      w2_sf: cute.Tensor, w2_map: GridConstant[TensorMap], w2_alpha: cute.Tensor,
                      fc2_input_scale: cute.Tensor, out: cute.Tensor, partials: cute.Tensor, barrier: cute.Tensor,
                      hidden: Int32, inter: Int32, n1: Int32, top_k: Int32, num_experts: Int32, expert_offset: Int32,
                      p0: Float32, p1: Float32, p2: Float32, p3: Float32, ctas: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        start_clock = ptx.sm_clock() if cutlass.const_expr(timeline) else None
        start_ns = ptx.global_timer() if cutlass.const_expr(timeline) else None
        sm = streaming.allocate(TOKENS, cfg)
        plan = allocate_plan()
        out_tile = sm.out  # written below inside run-time branches, which would otherwise carry all of `sm`
        by_top_k = ptx.division_magic(top_k)
        x_address = x.iterator.toint()
        out_address = out.iterator.toint()
        # Before the wait (the descriptors do not depend on the previous kernel): a descriptor's first fetch would
        # otherwise sit between the routing and GEMM1's first copies, and between GEMM2's wait and its copies.
        if tid == 0:
            ptx.prefetch_tensormap(w1_map.get_ptr().toint())
            ptx.prefetch_tensormap(w2_map.get_ptr().toint())
        cute.arch.griddepcontrol_wait()
        # One thread counts the CTA in: a consumer warp's, whose fences stall it and not warp 0's weight copies. It
        # also reads word 0 before its own count, when the word cannot have flipped yet.
        counter = threads - 32
        before = Int32(0)
        if tid == counter:
            before = ptx.ld_relaxed_gpu(barrier.iterator.toint())
        pairs = cute.size(token_selected_experts)
        timeline0 = arrival_word(barrier, pairs * (n1 // cfg.rows + hidden // cfg.rows) + cta * TIMELINE_WORDS)
        if cutlass.const_expr(timeline):
            for name, value in (("start", start_clock), ("start_ns_lo", start_ns[0]), ("start_ns_hi", start_ns[1]),
                                ("sm", ptx.sm_id())):
                mark_value(timeline, tid, timeline0, TIMELINE[name], value)
        mark(timeline, tid, timeline0, TIMELINE["waited"])
        if cutlass.const_expr(split_gemm2):
            if tid == 0:
                plan.arrival[2] = inter // cfg.k_step // GEMM2_MIN_STEPS
        tiles = route_pairs(plan, tid, token_selected_experts, pairs, num_experts, expert_offset)
        if tid == counter:
            plan.arrival[3] = before
        mark(timeline, tid, timeline0, TIMELINE["routed"])
        s1 = splits(ctas, tiles * (n1 // cfg.rows), hidden // cfg.k_step, 2)
        a_row = tid // (threads // TOKENS)  # the epilogues' accumulator row and first column
        c0 = (tid % (threads // TOKENS)) * out_cols

        # The fused finalize adds into the output: zero it, and count in (GEMM2's items wait for every CTA's).
        for i in cutlass.range(cta * threads + tid, cute.size(out) // 8, ctas * threads):
            ptx.st_global_v4(out_address + Int64(i) * 16, Int32(0), Int32(0), Int32(0), Int32(0))
        cute.arch.sync_threads()
        if tid == counter:
            ptx.flip_count(barrier.iterator.toint(), cta == 0, ctas)
        if cta == 0 and tid >= (tiles if gemms[0] else 0) and tid < MAX_PAIRS:  # tiles without GEMM1 items
            ptx.flip_count(readiness_word(barrier, tid), True, 1)
        mark(timeline, tid, timeline0, TIMELINE["zeroed"])

        # Phase 0, GEMM1: (tile, weight-row tile, K range) items -> fp32 partial tiles at
        # partials[range][row][n1 column]. Phase 1, GEMM2: (tile, hidden-row tile) items, their staging builds the
        # FC2 input from the partials, their epilogue adds into the output. One loop, so one copy of the mainloop.
        for phase in cutlass.range(2):
            gemm2 = phase == 1
            phase_words = 8 + 8 * phase  # this phase's TIMELINE_PHASE words
            rows_per_expert = Int32(cutlass.select_(gemm2, hidden, n1))
            k_extent = Int32(cutlass.select_(gemm2, inter, hidden))
            s2 = Int32(1)
            if cutlass.const_expr(split_gemm2):  # made per phase: fewer live registers
                s2 = splits(ctas, tiles * (hidden // cfg.rows), plan.arrival[2], 1)
            ranges = Int32(cutlass.select_(gemm2, s2, s1))
            per_tile = rows_per_expert // cfg.rows * ranges
            w_sf = Int64(cutlass.select_(gemm2, w2_sf.iterator.toint(), w1_sf.iterator.toint()))
            w_map = Int64(cutlass.select_(gemm2, w2_map.get_ptr().toint(), w1_map.get_ptr().toint()))
            if cutlass.const_expr(fc2_by_gemm1):
                token_base = Int64(cutlass.select_(gemm2, fc2_input_address(partials, pairs, n1, hidden), x_address))
            items = tiles * per_tile
            if cutlass.const_expr(gemms != (True, True)):
                items = items * Int32(cutlass.select_(gemm2, Int32(int(gemms[1])), Int32(int(gemms[0]))))
            # GEMM2's items from the last CTA down: where GEMM1's items leave the grid uneven (its stride gives the
            # first CTAs one more), GEMM2's extra items go to the CTAs with fewer, which reach them first.
            first_item = Int32(cutlass.select_(gemm2, ctas - 1 - cta, cta))
            for item in cutlass.range(first_item, items, ctas):
                t = item // per_tile
                rest = item - t * per_tile
                n_tile = rest // ranges
                rank = rest - n_tile * ranges
                expert = plan.tile_expert[t]
                row0 = plan.tile_row0[t]
                limit = plan.tile_limit[t]
                alpha = w1_alpha[expert]
                if cutlass.const_expr(fc2_by_gemm1):
                    ready = None
                    if gemm2:  # the tile's FC2 input (its GEMM1 items' counts) and a zeroed output (every CTA's)
                        wait_for_tile(tid, barrier.iterator.toint(), readiness_word(barrier, t), plan.arrival[3],
                                      timeline, timeline0, item == first_item)
                else:  # the same wait, inside the mainloop after GEMM2's first copies
                    ready = streaming.TokensReady(wait_for_tile, (barrier.iterator.toint(), readiness_word(barrier, t),
                                                                  plan.arrival[3], timeline, timeline0,
                                                                  item == first_item), gemm2, GEMM2_PRIMED_STAGES)

                def load_x(r, kk, k_end):
                    """GEMM1's 8 values at K = kk of row row0 + r: x of its token."""
                    valid = (row0 + r < limit) & (kk < k_end)
                    token = ptx.divide_by_magic(plan.row_pair[cute.math.min(row0 + r, limit - 1)], by_top_k)
                    v = ptx.ld_global_v4(x_address + (Int64(token) * Int64(hidden) + Int64(
                        cute.math.min(kk, hidden - 8))) * 2)
                    return [v[i] for i in range(4)], valid

                def load_fc2_input(r, kk, k_end):
                    """GEMM2's 8 values at K = kk of row row0 + r: gemm1.py's epilogue (alpha, the activation,
                    bf16) on the summed partials."""
                    valid = (row0 + r < limit) & (kk < k_end)
                    row = cute.math.min(row0 + r, limit - 1)
                    words = cute.make_rmem_tensor((4,), Int32)
                    words.fill(0)
                    if valid:  # the K ranges' partials summed in rank order (the cluster split-K's order)
                        col = (kk // 64) * cfg.rows + kk % 64 if gated else kk  # up; gate 64 columns on
                        acc = cute.make_rmem_tensor((16,), Float32)
                        acc.fill(0.0)
                        for rank_in in cutlass.range(s1):  # GEMM1's ranges
                            base = gemm1_partial(partials, pairs, n1, rank_in, row, col)
                            for half in cutlass.range_constexpr(2 if gated else 1):
                                for q in cutlass.range_constexpr(2):
                                    v = ptx.ld_global_cg_v4(base + half * (cfg.rows // 2) * 4 + q * 16)
                                    for i in cutlass.range_constexpr(4):
                                        acc[half * 8 + q * 4 + i] = acc[half * 8 + q * 4 + i] + v[i].bitcast(
                                            Float32)
                        values = [activations.apply(kind, acc[i] * alpha if gated else None,
                                                    acc[8 * gated + i] * alpha, (p0, p1, p2, p3))
                                  for i in range(8)]
                        for i in cutlass.range_constexpr(4):
                            words[i] = ptx.pack_bf16x2(values[2 * i], values[2 * i + 1])
                    return streaming.bf16x8_to_tile([words[i] for i in range(4)]), valid

                def load_tokens(r, kk, k_end):
                    """The 8 bf16 values at K = kk of row row0 + r: x of its token (GEMM1), or the row's FC2 input
                    (GEMM2), which GEMM1's epilogues wrote."""
                    valid = (row0 + r < limit) & (kk < k_end)
                    row = cute.math.min(row0 + r, limit - 1)
                    source = cutlass.select_(gemm2, row, ptx.divide_by_magic(plan.row_pair[row], by_top_k))
                    k = cute.math.min(kk, k_extent - 8)
                    if cutlass.const_expr(mode == "w4a16"):
                        v = ptx.ld_global_cg_v4(token_base + (Int64(source) * Int64(k_extent) + Int64(k)) * 2)
                        return [v[i] for i in range(4)], valid
                    at = source * k_extent + k  # element (< 2^31: at most 64 rows)
                    # GEMM2's bf16 words, or x's codes (1 or 2 words) and scale byte (word 3)
                    raw = ptx.ld_tokens_or_codes(Int32(gemm2), at, token_base, x_address, x_sf.iterator.toint(),
                                                 4 if mode == "w4a4" else 8, block)
                    return raw, valid

                def decode_tokens(raw):
                    """load_tokens' words -> the tile order's 4 words (stream.bf16x8_to_tile's): GEMM2's FC2 input
                    as loaded; GEMM1's x decoded as the routing launch decodes it (routing.decode_values), exact
                    either way. NVFP4 needs no permute: e2m1x8_to_bf16x2's pairs are the tile order's. A branch on
                    the phase (uniform in the CTA), not both computed and one selected: GEMM2's staging skips the
                    decode, T=1 0.2-0.75 µs faster (Mixtral 1.8-2.5) on the H100 (session55_checks.md)."""
                    words = cute.make_rmem_tensor((4,), Int32)
                    if gemm2:
                        loaded = streaming.bf16x8_to_tile(raw)
                        for i in cutlass.range_constexpr(4):
                            words[i] = loaded[i]
                    else:
                        if cutlass.const_expr(mode == "w4a4"):
                            s = ptx.cvt_e4m3_to_f32(raw[3]) * Float32(2.0 ** 63)  # the tile's 2^63 (<= 2^72)
                            for i, w in enumerate(ptx.e2m1x8_to_bf16x2(raw[0], ptx.pack_bf16x2(s, s))):
                                words[i] = ptx.mul_bf16x2(w, Int32(ptx.BF16X2_2P126))  # value * 2^-63 in range
                        else:
                            s = ue8m0_to_f32(raw[3])
                            v = ptx.cvt_e4m3x4_to_f32(raw[0]) + ptx.cvt_e4m3x4_to_f32(raw[1])
                            for i in cutlass.range_constexpr(4):
                                words[i] = ptx.mul_bf16x2(ptx.pack_bf16x2(v[i] * s, v[i + 4] * s),
                                                          Int32(streaming.BF16X2_2P63))
                    return [words[i] for i in range(4)]

                def trace(thread, event):
                    """The first item's first staging (event 0), first landed stages (1), first copies issued (2)
                    and first token loads in (3)."""
                    if item == first_item:
                        mark(timeline, thread, timeline0, phase_words + 1 + event if event < 2 else
                             TIMELINE["gemm1_" + ("issued", "loaded")[event - 2]] + 2 * phase)

                if cutlass.const_expr(split_gemm2):
                    if tid == 0:  # only thread 0 arrives (below)
                        plan.arrival[1] = t * (hidden // cfg.rows) + n_tile
                if item == first_item:
                    mark(timeline, tid, timeline0, phase_words)
                streaming.accumulate(sm, tid, w_sf, w_map, expert, n_tile * cfg.rows, rows_per_expert, k_extent,
                                     rank, ranges, limit - row0, TOKENS, cfg, block,
                                     streaming.LoadsFirst(load_tokens, None if mode == "w4a16" else decode_tokens)
                                     if fc2_by_gemm1 else
                                     streaming.TokenLoads(load_x, load_fc2_input, phase == 0), cluster_reduce=False,
                                     trace=trace if cutlass.const_expr(timeline) else None,
                                     ready=ready)
                if item == first_item:
                    mark(timeline, tid, timeline0, phase_words + 3)
                mark(timeline, tid, timeline0, phase_words + 4)
                last = Int32(1)  # whether this item's epilogue runs: split GEMM2 K ranges meet in the last
                if cutlass.const_expr(split_gemm2):
                    if gemm2 and ranges > 1:  # the range arriving last adds up the ranges' fp32 tiles in rank order
                        live = a_row < limit - row0
                        if live:
                            ptx.write_words(gemm2_partial(partials, pairs, n1, hidden, rank, row0 + a_row,
                                                          n_tile * cfg.rows + c0),
                                            [sm.out[a_row, c0 + i].bitcast(Int32) for i in range(out_cols)])
                        cute.arch.sync_threads()
                        if tid == 0:
                            plan.arrival[0] = ptx.arrive_last(
                                arrival_word(barrier, pairs * (n1 // cfg.rows) + plan.arrival[1]), ranges)
                        cute.arch.sync_threads()
                        last = plan.arrival[0]
                        if last == 1 and live:
                            for i in cutlass.range_constexpr(out_cols):
                                out_tile[a_row, c0 + i] = Float32(0.0)
                            for rank_in in cutlass.range(ranges, unroll=1):
                                address = gemm2_partial(partials, pairs, n1, hidden, rank_in, row0 + a_row,
                                                        n_tile * cfg.rows + c0)
                                for q in cutlass.range_constexpr(out_cols // 4):
                                    v = ptx.ld_global_cg_v4(address + q * 16)
                                    for i in cutlass.range_constexpr(4):
                                        out_tile[a_row, c0 + q * 4 + i] = out_tile[a_row, c0 + q * 4 + i] + v[
                                            i].bitcast(Float32)
                if cutlass.const_expr(fc2_by_gemm1):
                    if a_row < limit - row0 and last == 1 and gemm2:
                        finalize(sm, plan, a_row, c0, row0 + a_row, n_tile * cfg.rows + c0, w2_alpha,
                                 expert, token_final_scales, out_address, by_top_k, hidden)
                    if not gemm2:
                        gemm1_epilogue(sm, plan, tid, partials, barrier, pairs, n1, hidden, inter, t, n_tile, rank,
                                       ranges, row0, limit, alpha, (p0, p1, p2, p3), fc2_input_scale, kind, mode)
                else:
                    if a_row < limit - row0 and last == 1:
                        if gemm2:
                            finalize(sm, plan, a_row, c0, row0 + a_row, n_tile * cfg.rows + c0, w2_alpha,
                                     expert, token_final_scales, out_address, by_top_k, hidden)
                        else:  # this K range's fp32 partial, which GEMM2's staging sums with the others
                            words = [sm.out[a_row, c0 + i].bitcast(Int32) for i in range(out_cols)]
                            ptx.write_words(gemm1_partial(partials, pairs, n1, rank, row0 + a_row,
                                                          n_tile * cfg.rows + c0), words)
                cute.arch.sync_threads()  # the next item's staging overwrites sm.out
                if not gemm2:  # after the CTA barrier: every thread's partial or FC2 input stores are in
                    if tid == counter:
                        ptx.flip_count(readiness_word(barrier, t), item == t * per_tile, per_tile)
            mark(timeline, tid, timeline0, phase_words + 5)
            mark_value(timeline, tid, timeline0, phase_words + 6, items)
            mark_value(timeline, tid, timeline0, phase_words + 7, (k_extent // cfg.k_step + ranges - 1) // ranges)
        if cutlass.const_expr(timeline):
            mark(timeline, tid, timeline0, TIMELINE["end"])
            end_ns = ptx.global_timer()
            mark_value(timeline, tid, timeline0, TIMELINE["end_ns_lo"], end_ns[0])
            mark_value(timeline, tid, timeline0, TIMELINE["end_ns_hi"], end_ns[1])
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x: cute.Tensor, x_sf: cute.Tensor, token_selected_experts: cute.Tensor,
               token_final_scales: cute.Tensor, w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
               w2: cute.Tensor, w2_sf: cute.Tensor, w2_alpha: cute.Tensor, fc2_input_scale: cute.Tensor,
               out: cute.Tensor, partials: cute.Tensor, barrier: cute.Tensor,
               hidden: Int32, inter: Int32, n1: Int32, top_k: Int32, num_experts: Int32, expert_offset: Int32,
               p0: Float32, p1: Float32, p2: Float32, p3: Float32, ctas: Int32, pdl: cutlass.Boolean,
               stream: cuda.CUstream):
        w1_map = streaming.weight_map(w1, cute.size(w1_alpha), n1, hidden, cfg)
        w2_map = streaming.weight_map(w2, cute.size(w2_alpha), hidden, inter, cfg)
        decode_kernel(x, x_sf, token_selected_experts, token_final_scales, w1_sf, w1_map, w1_alpha, w2_sf, w2_map,
                      w2_alpha, fc2_input_scale, out, partials, barrier, hidden, inter, n1, top_k, num_experts,
                      expert_offset, p0, p1, p2, p3, ctas).launch(
            grid=(ctas, 1, 1), block=(threads, 1, 1), stream=stream, use_pdl=pdl,
            min_blocks_per_mp=cfg.ctas_per_sm, preferred_smem_carveout=100, cooperative=True)

    return launch


def compile_decode(kind: str, options: str, gemms: tuple = (True, True), split_gemm2: bool = False,
                   timeline: bool = False, fc2_by_gemm1: bool = False, deep_ring: bool = False, mode: str = "w4a16"):
    from .fake_args import vector

    u8 = cutlass.Uint8
    x = vector(BFloat16, 16) if mode == "w4a16" else vector(u8, 16)  # bf16, or the NVFP4 / MXFP8 codes
    return cute.compile(
        make_kernel(kind, gemms, split_gemm2, timeline, fc2_by_gemm1, deep_ring, mode), x, vector(u8),
        vector(Int32), vector(Float32), vector(u8, 16), vector(u8, 16), vector(Float32), vector(u8, 16),
        vector(u8, 16), vector(Float32), vector(Float32), vector(BFloat16, 16), vector(Float32, 16), vector(Int32),
        Int32(128), Int32(128), Int32(256), Int32(1), Int32(1), Int32(0), Float32(0), Float32(0), Float32(0),
        Float32(0), Int32(1), cutlass.Boolean(True), cuda.CUstream(0), options=options)
