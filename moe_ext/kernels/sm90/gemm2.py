"""GEMM2 (sm_90a): FC2-input rows x 4-bit FC2 weights -> scaled bf16 expert output per slot.

Grid (max tiles, H / tile_n). Each valid permuted row p (expanded index s = t*K + k) writes
y[s, :] = bf16(scale * acc2), scale = w2_alpha[e] * (token_final_scales[s] * pts2) for the fused finalize (router
weight before the bf16 rounding, semantics §2.6) or w2_alpha[e] * pts2 for the deterministic one; pts2 is the
per-token FC2 row scale (w4a4_pt) or 1. The finalize kernel then combines the K slots of each token.

Modes: the FC2 input is bf16 (w4a16), NVFP4 with swizzled e4m3 scales (w4a4, w4a4_pt) or MXFP8 with swizzled ue8m0
scales (w4a8); w2 is NVFP4, or MXFP4 for w4a8. The kernel takes every tensor; a mode ignores the ones it does not use.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32
from .mainloop import (TILE, load_weight_chunk, make_mma, mma_chunk, shared_tiles, store_activation_chunk,
                       zero_activation_chunk)

MODES = ("w4a16", "w4a4", "w4a4_pt", "w4a8")


def make_kernel(mode: str):
    a_format = {"w4a16": "bf16", "w4a4": "nvfp4", "w4a4_pt": "nvfp4", "w4a8": "mxfp8"}[mode]
    b_block = 32 if mode == "w4a8" else 16
    half_k = TILE.tile_k // 2

    @cute.kernel
    def gemm2_kernel(a_bf16: cute.Tensor, a_q: cute.Tensor, a_sf: cute.Tensor, row_scale: cute.Tensor,
                     w2: cute.Tensor, w2_sf: cute.Tensor, w2_alpha: cute.Tensor, token_final_scales: cute.Tensor,
                     permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                     num_live_tiles: cute.Tensor, slot_output: cute.Tensor, hidden: Int32, inter: Int32,
                     router_weight_in_scale: cutlass.Boolean):
        tid, _, _ = cute.arch.thread_idx()
        tile, n_tile, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()
        if tile < num_live_tiles[0]:
            expert = tile_to_expert[tile]
            limit = tile_to_mn_limit[tile]
            row0 = tile * TILE.tile_m
            rows = cute.size(permuted_to_expanded)
            s_a, s_b, s_c = shared_tiles()
            a_row = tid // 2
            a_half = tid % 2
            row = row0 + a_row
            b_row = n_tile * TILE.tile_n + tid
            tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc = make_mma(tid, s_a, s_b, s_c)
            for k0 in cutlass.range(0, inter, TILE.tile_k):
                ka = k0 + a_half * half_k
                col0 = a_half * half_k
                if row < limit:
                    if cutlass.const_expr(a_format == "bf16"):
                        store_activation_chunk(s_a, a_row, col0, a_format, a_bf16, row * inter + ka, half_k, None)
                    elif cutlass.const_expr(a_format == "nvfp4"):
                        for blk in cutlass.range_constexpr(half_k // 16):
                            scale = e4m3_to_f32(Int32(a_sf[swizzled_sf_offset(0, row, ka // 16 + blk, rows,
                                                                              inter // 16)]))
                            store_activation_chunk(s_a, a_row, col0 + blk * 16, a_format, a_q,
                                                   row * (inter // 2) + ka // 2 + blk * 8, 16, scale)
                    else:
                        scale = ue8m0_to_f32(Int32(a_sf[swizzled_sf_offset(0, row, ka // 32, rows, inter // 32)]))
                        store_activation_chunk(s_a, a_row, col0, a_format, a_q, row * inter + ka, half_k, scale)
                else:
                    zero_activation_chunk(s_a, a_row, col0, half_k)
                load_weight_chunk(s_b, tid, w2, w2_sf, expert, b_row, hidden, k0, inter, b_block)
                cute.arch.sync_threads()
                mma_chunk(tiled_mma, t_sa, t_sb, r_a, r_b, acc)
                cute.arch.sync_threads()
            cute.autovec_copy(acc, t_sc)
            cute.arch.sync_threads()

            if row < limit:
                slot = permuted_to_expanded[row]
                pts2 = Float32(1.0)
                if cutlass.const_expr(mode == "w4a4_pt"):
                    pts2 = row_scale[row]
                scale = w2_alpha[expert] * pts2
                if router_weight_in_scale:
                    scale = w2_alpha[expert] * (token_final_scales[slot] * pts2)
                per_thread = TILE.tile_n // 2
                for i in cutlass.range_constexpr(per_thread):
                    c = a_half * per_thread + i
                    slot_output[slot * hidden + n_tile * TILE.tile_n + c] = (scale * s_c[a_row, c]).to(BFloat16)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(a_bf16: cute.Tensor, a_q: cute.Tensor, a_sf: cute.Tensor, row_scale: cute.Tensor, w2: cute.Tensor,
               w2_sf: cute.Tensor, w2_alpha: cute.Tensor, token_final_scales: cute.Tensor,
               permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
               num_live_tiles: cute.Tensor, slot_output: cute.Tensor, hidden: Int32, inter: Int32,
               router_weight_in_scale: cutlass.Boolean, pdl: cutlass.Boolean, stream: cuda.CUstream):
        gemm2_kernel(a_bf16, a_q, a_sf, row_scale, w2, w2_sf, w2_alpha, token_final_scales, permuted_to_expanded,
                     tile_to_expert, tile_to_mn_limit, num_live_tiles, slot_output, hidden, inter,
                     router_weight_in_scale).launch(
            grid=(cute.size(tile_to_expert), hidden // TILE.tile_n, 1), block=(TILE.threads, 1, 1), stream=stream,
            use_pdl=pdl)

    return launch


def compile_gemm2(mode: str, options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    u8 = cutlass.Uint8
    return cute.compile(
        make_kernel(mode), vector(BFloat16, 16), vector(u8, 16), vector(u8), vector(Float32), vector(u8, 16),
        vector(u8, 16), vector(Float32), vector(Float32), vector(Int32), vector(Int32), vector(Int32), vector(Int32),
        vector(BFloat16, 16), Int32(128), Int32(128), cutlass.Boolean(True), cutlass.Boolean(True),
        cuda.CUstream(0), options=options)
