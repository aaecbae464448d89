"""GEMM1 (sm_90a, w4a16): gathered bf16 token rows x NVFP4 FC1 weights -> alpha -> activation -> bf16 FC2 input.

Grid (max tiles, N1 / tile_n): CTA (m, n) takes routing tile m (one local expert, tile_m permuted rows) and weight
rows [n*tile_n, (n+1)*tile_n); tiles past the device-side live count exit, so the grid depends only on T.
Token rows are gathered through permuted_to_expanded (token = expanded // top_k) straight from x: the permuted
copy is never materialised. With the 64-row up/gate interleave, a 128-row weight tile yields intermediate columns
[64n, 64n + 64): up in accumulator columns 0..63, gate in 64..127. Every tensor is flat; sizes are arguments.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from . import activations
from .fp4 import e2m1_to_f32, e4m3_to_f32, swizzled_sf_offset
from .mainloop import TILE, make_mma, mma_chunk, shared_tiles


def make_kernel(kind: str):
    gated = kind != "relu2"

    @cute.kernel
    def gemm1_kernel(x: cute.Tensor, w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
                     permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                     num_live_tiles: cute.Tensor, intermediate: cute.Tensor, hidden: Int32, n1: Int32, top_k: Int32,
                     p0: Float32, p1: Float32, p2: Float32, p3: Float32):
        tid, _, _ = cute.arch.thread_idx()
        tile, n_tile, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()
        if tile < num_live_tiles[0]:
            expert = tile_to_expert[tile]
            limit = tile_to_mn_limit[tile]
            row0 = tile * TILE.tile_m
            s_a, s_b, s_c = shared_tiles()
            # A: thread -> (row, half of the K chunk); B: thread -> one weight row.
            a_row = tid // 2
            a_half = tid % 2
            token = Int32(-1)
            if row0 + a_row < limit:
                token = permuted_to_expanded[row0 + a_row] // top_k
            b_row = n_tile * TILE.tile_n + tid
            packed_row = (expert * n1 + b_row) * (hidden // 2)

            tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc = make_mma(tid, s_a, s_b, s_c)
            for k0 in cutlass.range(0, hidden, TILE.tile_k):
                for i in cutlass.range_constexpr(TILE.tile_k // 2):
                    col = a_half * (TILE.tile_k // 2) + i
                    value = BFloat16(0.0)
                    if token >= 0:
                        value = x[token * hidden + k0 + col]
                    s_a[a_row, col] = value
                for blk in cutlass.range_constexpr(TILE.tile_k // 16):
                    sf_at = swizzled_sf_offset(expert, b_row, k0 // 16 + blk, n1, hidden // 16)
                    scale = e4m3_to_f32(Int32(w1_sf[sf_at]))
                    for j in cutlass.range_constexpr(8):
                        byte = Int32(w1[packed_row + k0 // 2 + blk * 8 + j])
                        s_b[tid, blk * 16 + 2 * j] = (e2m1_to_f32(byte & 15) * scale).to(BFloat16)
                        s_b[tid, blk * 16 + 2 * j + 1] = (e2m1_to_f32(byte >> 4) * scale).to(BFloat16)
                cute.arch.sync_threads()
                mma_chunk(tiled_mma, t_sa, t_sb, r_a, r_b, acc)
                cute.arch.sync_threads()
            cute.autovec_copy(acc, t_sc)
            cute.arch.sync_threads()

            # Epilogue: thread -> (row, half of the output columns of this tile).
            inter = n1 // 2 if gated else n1
            row = row0 + a_row
            if row < limit:
                s1 = w1_alpha[expert]
                width = TILE.tile_n // 2 if gated else TILE.tile_n
                out_col0 = n_tile * width
                per_thread = width // 2
                for i in cutlass.range_constexpr(per_thread):
                    c = a_half * per_thread + i
                    if cutlass.const_expr(gated):
                        h = activations.apply(kind, s_c[a_row, c] * s1, s_c[a_row, c + TILE.tile_n // 2] * s1,
                                              (p0, p1, p2, p3))
                    else:
                        h = activations.apply(kind, None, s_c[a_row, c] * s1, (p0, p1, p2, p3))
                    intermediate[row * inter + out_col0 + c] = h.to(BFloat16)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x: cute.Tensor, w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
               permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
               num_live_tiles: cute.Tensor, intermediate: cute.Tensor, hidden: Int32, n1: Int32, top_k: Int32,
               p0: Float32, p1: Float32, p2: Float32, p3: Float32, pdl: cutlass.Boolean, stream: cuda.CUstream):
        grid_m = cute.size(tile_to_expert)
        grid_n = n1 // TILE.tile_n
        gemm1_kernel(x, w1, w1_sf, w1_alpha, permuted_to_expanded, tile_to_expert, tile_to_mn_limit,
                     num_live_tiles, intermediate, hidden, n1, top_k, p0, p1, p2, p3).launch(
            grid=(grid_m, grid_n, 1), block=(TILE.threads, 1, 1), stream=stream, use_pdl=pdl)

    return launch


def compile_gemm1(kind: str, options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    return cute.compile(
        make_kernel(kind), vector(BFloat16, 16), vector(cutlass.Uint8, 16), vector(cutlass.Uint8, 16),
        vector(Float32), vector(Int32), vector(Int32), vector(Int32), vector(Int32), vector(BFloat16, 16),
        Int32(128), Int32(256), Int32(1), Float32(0), Float32(0), Float32(0), Float32(0), cutlass.Boolean(True),
        cuda.CUstream(0), options=options)
