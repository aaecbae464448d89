"""Routing kernel (sm_90a): global expert ids -> the routing maps of semantics §5.1, on the device.

One CTA of `threads` threads: shared-memory atomics count the slots of each local expert and hand out each slot's
rank inside its expert; warp 0 scans the tile-padded counts; then every slot gets its permuted row and every live
tile its expert and row limit. Non-local ids (outside [offset, offset + E), negative ones included) get -1.
The expert count, offset and tile size are runtime values and every size is read from the tensors, so one
compiled kernel serves every layer and a captured launch serves any routing. The order of rows inside an expert
follows the atomics and is not fixed; every result indexed by slot is independent of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class RoutingConfig:
    threads: int = 1024
    max_experts: int = 2048  # shared-memory capacity: two int32 arrays of this length


CONFIG = RoutingConfig()
WARP = 32


@cute.kernel
def routing_kernel(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
                   expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor,
                   permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                   num_live_tiles: cute.Tensor):
    threads = CONFIG.threads
    tid, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    smem = cutlass.utils.SmemAllocator()
    counts = smem.allocate_tensor(Int32, cute.make_layout(CONFIG.max_experts), byte_alignment=16)
    starts = smem.allocate_tensor(Int32, cute.make_layout(CONFIG.max_experts + 1), byte_alignment=16)
    num_slots = cute.size(ids)

    for e in cutlass.range(tid, num_experts, threads):
        counts[e] = Int32(0)
    # Everything above touches no input; wait for the producer of the ids only now.
    cute.arch.griddepcontrol_wait()
    cute.arch.sync_threads()

    # Count per expert; park each slot's rank inside its expert in the output map.
    for s in cutlass.range(tid, num_slots, threads):
        local = ids[s] - offset
        rank = Int32(-1)
        if local >= 0 and local < num_experts:
            rank = cute.arch.atomic_add((counts.iterator + local).llvm_ptr, Int32(1), scope="cta")
        expanded_to_permuted[s] = rank
    cute.arch.sync_threads()

    # Warp 0: exclusive scan of the tile-padded counts, 32 experts at a time.
    if warp == 0:
        carry = Int32(0)
        for base in cutlass.range(0, num_experts, WARP):
            e = base + lane
            count = Int32(0)
            if e < num_experts:
                count = counts[e]
            padded = (count + tile - 1) // tile * tile
            inclusive = padded
            for step in cutlass.range_constexpr(5):
                neighbour = cute.arch.shuffle_sync_up(inclusive, 1 << step)
                if lane >= (1 << step):
                    inclusive = inclusive + neighbour
            if e < num_experts:
                start = carry + inclusive - padded
                starts[e] = start
                expert_counts[e] = count
                expert_offsets[e] = start
            carry = carry + cute.arch.shuffle_sync(inclusive, WARP - 1)
        if lane == 0:
            starts[num_experts] = carry
            expert_offsets[num_experts] = carry
            num_live_tiles[0] = carry // tile
    # Padding rows and dead tiles are cleared here and overwritten below after the barrier.
    for r in cutlass.range(tid, cute.size(permuted_to_expanded), threads):
        permuted_to_expanded[r] = Int32(-1)
    for t in cutlass.range(tid, cute.size(tile_to_expert), threads):
        tile_to_expert[t] = Int32(0)
        tile_to_mn_limit[t] = Int32(0)
    cute.arch.sync_threads()

    for s in cutlass.range(tid, num_slots, threads):
        rank = expanded_to_permuted[s]
        if rank >= 0:
            row = starts[ids[s] - offset] + rank
            expanded_to_permuted[s] = row
            permuted_to_expanded[row] = s
    for e in cutlass.range(tid, num_experts, threads):
        begin = starts[e]
        end = begin + counts[e]
        for t in cutlass.range(begin // tile, starts[e + 1] // tile):
            tile_to_expert[t] = e
            tile_to_mn_limit[t] = cutlass.min(end, (t + 1) * tile)
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_routing(ids: cute.Tensor, num_experts: Int32, offset: Int32, tile: Int32, expert_counts: cute.Tensor,
                   expert_offsets: cute.Tensor, expanded_to_permuted: cute.Tensor, permuted_to_expanded: cute.Tensor,
                   tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                   pdl: cutlass.Boolean, stream: cuda.CUstream):
    routing_kernel(ids, num_experts, offset, tile, expert_counts, expert_offsets, expanded_to_permuted,
                   permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles).launch(
        grid=(1, 1, 1), block=(CONFIG.threads, 1, 1), stream=stream, use_pdl=pdl)


def compile_routing(options: str):
    """Compile for fake 1-D int32 tensors of dynamic length (the launcher checks the real ones)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector():
        return make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)

    return cute.compile(launch_routing, vector(), Int32(1), Int32(0), Int32(128), vector(), vector(), vector(),
                        vector(), vector(), vector(), vector(), cutlass.Boolean(True), cuda.CUstream(0),
                        options=options)
