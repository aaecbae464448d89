"""Token slabs (sm_90a): the routed rows of the activations in the order the slab GEMM1 copies them a stage at a time.

The layout is moe_ext/slabs.py's (its torch definition): routing tile m's 128-K step s is `tile` rows of RING_PITCH
bytes at byte (m * steps + s) * tile * RING_PITCH, each row the step's values of the row's token in the token tile's
order, times 2^63. One thread converts one 16-value group of one routed row, after the routing launch's maps
(programmatic dependent launch: griddepcontrol.wait); padding rows and tiles past the live count are left as they
are, since GEMM1 copies only live rows.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from . import ptx
from . import stream as streaming

THREADS = 256
GROUP = 16  # values a thread converts: two 8-value chunks, adjacent in the slab too (streaming.chunk_position)


@cute.kernel
def token_slabs_kernel(x_bf16: cute.Tensor, permuted_to_expanded: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                       num_live_tiles: cute.Tensor, slabs: cute.Tensor, hidden: Int32, top_k: Int32, tile: Int32):
    tid, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    groups = hidden // GROUP
    index = cta * THREADS + tid
    p = index // groups  # routed row
    if p < cute.size(permuted_to_expanded):
        m = p // tile
        if m < num_live_tiles[0]:
            if p < tile_to_mn_limit[m]:
                k = (index - p * groups) * GROUP
                token = permuted_to_expanded[p] // top_k
                src = x_bf16.iterator.toint() + (Int64(token) * Int64(hidden) + Int64(k)) * Int64(2)
                words = ptx.ld_global_v4(src) + ptx.ld_global_v4(src + 16)
                dst = streaming.slab_chunk_address(streaming.tile_slabs(slabs, m, hidden, 0, tile).tile_base,
                                                   p - m * tile, k, tile)
                ptx.write_words(dst, streaming.bf16x8_to_tile(words[:4]) + streaming.bf16x8_to_tile(words[4:]))
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_token_slabs(x_bf16: cute.Tensor, permuted_to_expanded: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                       num_live_tiles: cute.Tensor, slabs: cute.Tensor, hidden: Int32, top_k: Int32, tile: Int32,
                       pdl: cutlass.Boolean, stream: cuda.CUstream):
    tasks = cute.size(permuted_to_expanded) * (hidden // GROUP)
    token_slabs_kernel(x_bf16, permuted_to_expanded, tile_to_mn_limit, num_live_tiles, slabs, hidden, top_k,
                       tile).launch(grid=((tasks + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1),
                                    stream=stream, use_pdl=pdl)


def compile_token_slabs(options: str):
    """Compile for fake flat tensors of dynamic length (the launcher checks the real ones)."""
    from .fake_args import vector

    maps = [vector(Int32) for _ in range(3)]  # fresh tensors: each has a length of its own
    return cute.compile(launch_token_slabs, vector(BFloat16, 16), *maps, vector(BFloat16, 16), Int32(128), Int32(1),
                        Int32(16), cutlass.Boolean(True), cuda.CUstream(0), options=options)
