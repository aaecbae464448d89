"""GEMM2 (sm_90a, w4a16): bf16 FC2-input rows x NVFP4 FC2 weights -> scaled bf16 expert output per slot.

Grid (max tiles, H / tile_n). Each valid permuted row p (expanded index s = t*K + k) writes
y[s, :] = bf16(scale * acc2) with scale = w2_alpha[e] * token_final_scales[s] for the fused finalize (router
weight before the bf16 rounding, semantics §2.6) or w2_alpha[e] for the deterministic one. The finalize kernel
then combines the K slots of each token; no atomics, so both modes are reproducible here.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .fp4 import e2m1_to_f32, e4m3_to_f32, swizzled_sf_offset
from .mainloop import TILE, make_mma, mma_chunk, shared_tiles


@cute.kernel
def gemm2_kernel(intermediate: cute.Tensor, w2: cute.Tensor, w2_sf: cute.Tensor, w2_alpha: cute.Tensor,
                 token_final_scales: cute.Tensor, permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor,
                 tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor, slot_output: cute.Tensor,
                 hidden: Int32, inter: Int32, router_weight_in_scale: cutlass.Boolean):
    tid, _, _ = cute.arch.thread_idx()
    tile, n_tile, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    if tile < num_live_tiles[0]:
        expert = tile_to_expert[tile]
        limit = tile_to_mn_limit[tile]
        row0 = tile * TILE.tile_m
        s_a, s_b, s_c = shared_tiles()
        a_row = tid // 2
        a_half = tid % 2
        a_valid = row0 + a_row < limit
        b_row = n_tile * TILE.tile_n + tid
        packed_row = (expert * hidden + b_row) * (inter // 2)
        tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc = make_mma(tid, s_a, s_b, s_c)
        for k0 in cutlass.range(0, inter, TILE.tile_k):
            for i in cutlass.range_constexpr(TILE.tile_k // 2):
                col = a_half * (TILE.tile_k // 2) + i
                value = BFloat16(0.0)
                if a_valid:
                    value = intermediate[(row0 + a_row) * inter + k0 + col]
                s_a[a_row, col] = value
            for blk in cutlass.range_constexpr(TILE.tile_k // 16):
                sf_at = swizzled_sf_offset(expert, b_row, k0 // 16 + blk, hidden, inter // 16)
                scale = e4m3_to_f32(Int32(w2_sf[sf_at]))
                for j in cutlass.range_constexpr(8):
                    byte = Int32(w2[packed_row + k0 // 2 + blk * 8 + j])
                    s_b[tid, blk * 16 + 2 * j] = (e2m1_to_f32(byte & 15) * scale).to(BFloat16)
                    s_b[tid, blk * 16 + 2 * j + 1] = (e2m1_to_f32(byte >> 4) * scale).to(BFloat16)
            cute.arch.sync_threads()
            mma_chunk(tiled_mma, t_sa, t_sb, r_a, r_b, acc)
            cute.arch.sync_threads()
        cute.autovec_copy(acc, t_sc)
        cute.arch.sync_threads()

        if a_valid:
            slot = permuted_to_expanded[row0 + a_row]
            scale = w2_alpha[expert]
            if router_weight_in_scale:
                scale = scale * token_final_scales[slot]
            per_thread = TILE.tile_n // 2
            for i in cutlass.range_constexpr(per_thread):
                c = a_half * per_thread + i
                slot_output[slot * hidden + n_tile * TILE.tile_n + c] = (scale * s_c[a_row, c]).to(BFloat16)
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_gemm2(intermediate: cute.Tensor, w2: cute.Tensor, w2_sf: cute.Tensor, w2_alpha: cute.Tensor,
                 token_final_scales: cute.Tensor, permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor,
                 tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor, slot_output: cute.Tensor,
                 hidden: Int32, inter: Int32, router_weight_in_scale: cutlass.Boolean, pdl: cutlass.Boolean,
                 stream: cuda.CUstream):
    gemm2_kernel(intermediate, w2, w2_sf, w2_alpha, token_final_scales, permuted_to_expanded, tile_to_expert,
                 tile_to_mn_limit, num_live_tiles, slot_output, hidden, inter, router_weight_in_scale).launch(
        grid=(cute.size(tile_to_expert), hidden // TILE.tile_n, 1), block=(TILE.threads, 1, 1), stream=stream,
        use_pdl=pdl)


def compile_gemm2(options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    return cute.compile(
        launch_gemm2, vector(BFloat16, 16), vector(cutlass.Uint8, 16), vector(cutlass.Uint8, 16), vector(Float32),
        vector(Float32), vector(Int32), vector(Int32), vector(Int32), vector(Int32), vector(BFloat16, 16),
        Int32(128), Int32(128), cutlass.Boolean(True), cutlass.Boolean(True), cuda.CUstream(0), options=options)
