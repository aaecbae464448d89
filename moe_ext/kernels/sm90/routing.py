"""Routing kernel (sm_90a): global expert ids -> the routing maps of semantics §5.1, on the device.

One CTA of `threads` threads: shared-memory atomics count the slots of each local expert and hand out each slot's
rank inside its expert; warp 0 scans the tile-padded counts; then every slot gets its permuted row and every live
tile its expert and row limit. Non-local ids (outside [offset, offset + E), negative ones included) get -1.
The expert count, offset and tile size are runtime values and every size is read from the tensors, so one
compiled kernel serves every layer and a captured launch serves any routing. The order of rows inside an expert
follows the atomics and is not fixed; every result indexed by slot is independent of it.

In the quantized modes the same launch also decodes the activations (NVFP4 or MXFP8, linear scales) to bf16
(`moe_routing_decode_{format}`), once a forward, for GEMM1 of either family: CTA 0 routes, CTAs 1.. decode 16 values
a thread, on the SMs the routing CTA leaves idle, so a forward gains no kernel node. The decode is exact: an e2m1
code times its e4m3 scale, or an e4m3 code times its ue8m0 scale, has at most 6 significant bits (the MXFP8
product flushes to zero below fp32's normal range). With `k_permuted` set the values go in the wgmma GEMMs' token
K order (wgmma_mainloop.stage_position), for the wgmma GEMM1; format "bf16" copies bf16 activations into that order
(w4a16 forwards on the wgmma GEMMs).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from . import ptx
from .wgmma_mainloop import K_GROUP, write_k_permuted
from .fp4 import e4m3_to_f32, ue8m0_to_f32


@dataclass(frozen=True)
class RoutingConfig:
    threads: int = 1024
    max_experts: int = 2048  # shared-memory capacity: two int32 arrays of this length


CONFIG = RoutingConfig()
WARP = 32
DECODE_FORMATS = ("nvfp4", "mxfp8", "bf16")
DECODE_VALUES = 16  # activation values a decode thread converts
BATCH = 8  # slots a routing thread has in flight in each pass over them


def allocate_counters():
    """The routing CTA's shared memory: per-expert counts and tile-padded starts."""
    smem = cutlass.utils.SmemAllocator()
    counts = smem.allocate_tensor(Int32, cute.make_layout(CONFIG.max_experts), byte_alignment=16)
    starts = smem.allocate_tensor(Int32, cute.make_layout(CONFIG.max_experts + 1), byte_alignment=16)
    return counts, starts


@cute.jit
def route(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
          expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor, permuted_to_expanded: cute.Tensor,
          tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
          counts: cute.Tensor, starts: cute.Tensor):
    """The whole routing, by one CTA of CONFIG.threads threads. Both passes over the slots keep BATCH of a thread's
    loads in flight, and warp 0 scans the experts in one pass, a run of them a lane. One slot at a time, the launch
    that also copies x for the wgmma GEMMs took 101 µs at DeepSeek-V3 T=4096 on an H100 (its routing CTA's round
    trips queued behind the copy's traffic), 65 batched; 411 -> 260 at T=16384 (h100_session57_routing_ab.json).
    The routing alone moved less (48 -> 45 µs), and at T = 1-64 it is 0.2-1.5 µs slower (its longer code):
    docs/experiments/routing_small_t.patch batches only past CONFIG.threads slots."""
    threads = CONFIG.threads
    tid, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    num_slots = cute.size(ids)
    last_slot = num_slots - 1

    for e in cutlass.range(tid, num_experts, threads):
        counts[e] = Int32(0)
    # Everything above touches no input; wait for the producer of the ids only now.
    cute.arch.griddepcontrol_wait()
    cute.arch.sync_threads()

    # Count per expert; park each slot's rank inside its expert in the output map. Past the last slot a thread loads
    # the last one (in bounds) and drops it.
    for base in cutlass.range(0, num_slots, threads * BATCH):
        local = [ids[cutlass.min(base + j * threads + tid, last_slot)] - offset
                 for j in range(BATCH)]
        for j in cutlass.range_constexpr(BATCH):
            s = base + j * threads + tid
            rank = Int32(-1)
            if local[j] >= 0 and local[j] < num_experts and s < num_slots:
                rank = cute.arch.atomic_add((counts.iterator + local[j]).llvm_ptr, Int32(1), scope="cta")
            if s < num_slots:
                expanded_to_permuted[s] = rank
    cute.arch.sync_threads()

    # Warp 0: exclusive scan of the tile-padded counts; lane l sums its run of `per` experts, one warp scan of the
    # runs' sums, then each lane writes its run's starts.
    if warp == 0:
        per = (num_experts + WARP - 1) // WARP
        first = lane * per
        run_end = cutlass.min(first + per, num_experts)
        total = Int32(0)
        for e in cutlass.range(first, run_end):
            total = total + (counts[e] + tile - 1) // tile * tile
        inclusive = total
        for step in cutlass.range_constexpr(5):
            neighbour = cute.arch.shuffle_sync_up(inclusive, 1 << step)
            if lane >= (1 << step):
                inclusive = inclusive + neighbour
        run_start = inclusive - total
        for e in cutlass.range(first, run_end):
            count = counts[e]
            starts[e] = run_start
            expert_counts[e] = count
            expert_offsets[e] = run_start
            run_start = run_start + (count + tile - 1) // tile * tile
        if lane == WARP - 1:
            starts[num_experts] = inclusive
            expert_offsets[num_experts] = inclusive
            num_live_tiles[0] = inclusive // tile
    # Padding rows and dead tiles are cleared here and overwritten below after the barrier.
    for r in cutlass.range(tid, cute.size(permuted_to_expanded), threads):
        permuted_to_expanded[r] = Int32(-1)
    for t in cutlass.range(tid, cute.size(tile_to_expert), threads):
        tile_to_expert[t] = Int32(0)
        tile_to_mn_limit[t] = Int32(0)
    cute.arch.sync_threads()

    for base in cutlass.range(0, num_slots, threads * BATCH):
        clamped = [cutlass.min(base + j * threads + tid, last_slot) for j in range(BATCH)]
        ranks = [expanded_to_permuted[clamped[j]] for j in range(BATCH)]
        local = [ids[clamped[j]] - offset for j in range(BATCH)]
        for j in cutlass.range_constexpr(BATCH):
            s = base + j * threads + tid
            if ranks[j] >= 0 and s < num_slots:
                row = starts[local[j]] + ranks[j]
                expanded_to_permuted[s] = row
                permuted_to_expanded[row] = s
    for e in cutlass.range(tid, num_experts, threads):
        begin = starts[e]
        end = begin + counts[e]
        for t in cutlass.range(begin // tile, starts[e + 1] // tile):
            tile_to_expert[t] = e
            tile_to_mn_limit[t] = cutlass.min(end, (t + 1) * tile)


@cute.kernel
def routing_kernel(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
                   expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor,
                   permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                   num_live_tiles: cute.Tensor):
    counts, starts = allocate_counters()
    route(ids, num_experts, offset, tile, expert_counts, expert_offsets, expanded_to_permuted, permuted_to_expanded,
          tile_to_expert, tile_to_mn_limit, num_live_tiles, counts, starts)
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_routing(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
                   expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor, permuted_to_expanded: cute.Tensor,
                   tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                   pdl: cutlass.Boolean, stream: cuda.CUstream):
    routing_kernel(ids, num_experts, offset, tile, expert_counts, expert_offsets, expanded_to_permuted,
                   permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles).launch(
        grid=(1, 1, 1), block=(CONFIG.threads, 1, 1), stream=stream, use_pdl=pdl)


def decode_values(x_format: str, x_q: cute.Tensor, x_sf: cute.Tensor, x_out: cute.Tensor, index, k_permuted: bool):
    """Values [16 index, 16 index + 16) of the row-major activations -> bf16 in x_out (linear block scales), in
    plain order or (k_permuted; rows of a multiple of 64 values) in the wgmma token K order."""
    first = Int64(index) * Int64(DECODE_VALUES)
    words = []
    if cutlass.const_expr(x_format == "nvfp4"):
        codes = ptx.ld_global_v2(x_q.iterator.toint() + first // 2)
        s = e4m3_to_f32(Int32(x_sf[index]))  # one block of 16
        s2 = ptx.pack_bf16x2(s, s)
        words = ptx.e2m1x8_to_bf16x8(codes[0], s2) + ptx.e2m1x8_to_bf16x8(codes[1], s2)
    elif cutlass.const_expr(x_format == "mxfp8"):
        codes = ptx.ld_global_v4(x_q.iterator.toint() + first)
        s = ue8m0_to_f32(Int32(x_sf[index // 2]))  # blocks of 32
        for w in range(4):
            v = [e4m3_to_f32((codes[w] >> (8 * b)) & 0xFF) * s for b in range(4)]
            words += [ptx.pack_bf16x2(v[0], v[1]), ptx.pack_bf16x2(v[2], v[3])]
    else:  # bf16: a copy
        words = ptx.ld_global_v4(x_q.iterator.toint() + first * 2) + ptx.ld_global_v4(x_q.iterator.toint() +
                                                                                       first * 2 + 16)
    if k_permuted:
        quarter = index % (K_GROUP // DECODE_VALUES)
        write_k_permuted(x_out.iterator.toint() + (first - Int64(quarter * DECODE_VALUES)) * Int64(2), words,
                         quarter * DECODE_VALUES)
    else:
        ptx.write_words(x_out.iterator.toint() + first * Int64(2), words)


def make_routing_decode(x_format: str):
    """The routing launch that also decodes the activations: CTA 0 routes, CTA c > 0 decodes values
    [16 * 1024 (c - 1), 16 * 1024 c). x_out (bf16, T * H) is GEMM1's x."""
    if x_format not in DECODE_FORMATS:
        raise ValueError(f"x_format must be one of {DECODE_FORMATS}, got {x_format}")

    @cute.kernel
    def routing_decode_kernel(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32,
                              expert_counts: cute.Tensor, expert_offsets: cute.Tensor,
                              expanded_to_permuted: cute.Tensor, permuted_to_expanded: cute.Tensor,
                              tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                              x_q: cute.Tensor, x_sf: cute.Tensor, x_out: cute.Tensor, k_permuted: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        counts, starts = allocate_counters()
        if cta == 0:
            route(ids, num_experts, offset, tile, expert_counts, expert_offsets, expanded_to_permuted,
                  permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles, counts, starts)
        else:
            index = (cta - 1) * CONFIG.threads + tid
            cute.arch.griddepcontrol_wait()
            if index < cute.size(x_out) // DECODE_VALUES:
                if k_permuted != 0:
                    decode_values(x_format, x_q, x_sf, x_out, index, True)
                else:
                    decode_values(x_format, x_q, x_sf, x_out, index, False)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
               expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor, permuted_to_expanded: cute.Tensor,
               tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
               x_q: cute.Tensor, x_sf: cute.Tensor, x_out: cute.Tensor, k_permuted: Int32, pdl: cutlass.Boolean,
               stream: cuda.CUstream):
        per_cta = CONFIG.threads * DECODE_VALUES
        routing_decode_kernel(ids, num_experts, offset, tile, expert_counts, expert_offsets, expanded_to_permuted,
                              permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles, x_q, x_sf,
                              x_out, k_permuted).launch(
            grid=(1 + (cute.size(x_out) + per_cta - 1) // per_cta, 1, 1), block=(CONFIG.threads, 1, 1),
            stream=stream, use_pdl=pdl)

    return launch


def compile_routing_decode(x_format: str, options: str):
    from .fake_args import vector

    maps = [vector(Int32) for _ in range(7)]  # fresh tensors: each has a length of its own
    return cute.compile(make_routing_decode(x_format), vector(Int32), Int32(1), Int32(0), Int32(128), *maps,
                        vector(cutlass.Uint8, 16), vector(cutlass.Uint8), vector(BFloat16, 16), Int32(0),
                        cutlass.Boolean(True), cuda.CUstream(0), options=options)


def compile_routing(options: str):
    """Compile for fake 1-D int32 tensors of dynamic length (the launcher checks the real ones)."""
    from .fake_args import vector

    maps = [vector(Int32) for _ in range(7)]  # fresh tensors: each has a length of its own
    return cute.compile(launch_routing, vector(Int32), Int32(1), Int32(0), Int32(128), *maps, cutlass.Boolean(True),
                        cuda.CUstream(0), options=options)
