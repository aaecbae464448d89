"""GEMM1 (sm_90a): gathered token rows x 4-bit FC1 weights -> alpha (x per-token scale) -> activation -> FC2 input.

Grid (max tiles, N1 / tile_n): CTA (m, n) takes routing tile m (one local expert, tile_m permuted rows) and weight
rows [n*tile_n, (n+1)*tile_n); tiles past the device-side live count exit, so the grid depends only on T.
Token rows are gathered through permuted_to_expanded (token = expanded // top_k) straight from x: the permuted
copy is never materialised. With the 64-row up/gate interleave, a 128-row weight tile yields intermediate columns
[64n, 64n + 64): up in accumulator columns 0..63, gate in 64..127.

Modes (a compile-time choice; operands decode exactly to bf16, semantics §2.1):
  w4a16    x bf16,                 w1 NVFP4 (e4m3 per 16) -> FC2 input bf16
  w4a4     x NVFP4 (linear e4m3),  w1 NVFP4                -> FC2 input NVFP4, per-tensor scale (§2.4a)
  w4a4_pt  like w4a4, accumulator also times per_token_scale -> FC2 input bf16 (the per-token kernel quantizes it)
  w4a8     x MXFP8 (linear ue8m0), w1 MXFP4 (ue8m0 per 32) -> FC2 input MXFP8 (§2.4c)
Every tensor is flat and the kernel takes all of them; a mode ignores the ones it does not use (1-element dummies).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from . import activations, quantize
from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32
from .mainloop import (TILE, load_weight_chunk, make_mma, mma_chunk, shared_tiles, store_activation_chunk,
                       zero_activation_chunk)

MODES = ("w4a16", "w4a4", "w4a4_pt", "w4a8")


def make_kernel(mode: str, kind: str):
    gated = kind != "relu2"
    a_format = {"w4a16": "bf16", "w4a4": "nvfp4", "w4a4_pt": "nvfp4", "w4a8": "mxfp8"}[mode]
    b_block = 32 if mode == "w4a8" else 16
    out_format = {"w4a16": "bf16", "w4a4": "nvfp4", "w4a4_pt": "bf16", "w4a8": "mxfp8"}[mode]
    half_k = TILE.tile_k // 2  # K values of a chunk each A-loading thread decodes

    @cute.kernel
    def gemm1_kernel(x_bf16: cute.Tensor, x_q: cute.Tensor, x_sf: cute.Tensor, per_token_scale: cute.Tensor,
                     w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor, permuted_to_expanded: cute.Tensor,
                     tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                     out_bf16: cute.Tensor, out_q: cute.Tensor, out_sf: cute.Tensor, fc2_input_scale: cute.Tensor,
                     hidden: Int32, n1: Int32, top_k: Int32, p0: Float32, p1: Float32, p2: Float32, p3: Float32):
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
            tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc = make_mma(tid, s_a, s_b, s_c)
            for k0 in cutlass.range(0, hidden, TILE.tile_k):
                ka = k0 + a_half * half_k
                col0 = a_half * half_k
                if token >= 0:
                    if cutlass.const_expr(a_format == "bf16"):
                        store_activation_chunk(s_a, a_row, col0, a_format, x_bf16, token * hidden + ka, half_k, None)
                    elif cutlass.const_expr(a_format == "nvfp4"):
                        for blk in cutlass.range_constexpr(half_k // 16):
                            scale = e4m3_to_f32(Int32(x_sf[token * (hidden // 16) + ka // 16 + blk]))
                            store_activation_chunk(s_a, a_row, col0 + blk * 16, a_format, x_q,
                                                   token * (hidden // 2) + ka // 2 + blk * 8, 16, scale)
                    else:
                        scale = ue8m0_to_f32(Int32(x_sf[token * (hidden // 32) + ka // 32]))
                        store_activation_chunk(s_a, a_row, col0, a_format, x_q, token * hidden + ka, half_k, scale)
                else:
                    zero_activation_chunk(s_a, a_row, col0, half_k)
                load_weight_chunk(s_b, tid, w1, w1_sf, expert, b_row, n1, k0, hidden, b_block)
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
                if cutlass.const_expr(mode == "w4a4_pt"):
                    s1 = s1 * per_token_scale[token]
                width = TILE.tile_n // 2 if gated else TILE.tile_n
                per_thread = width // 2
                col0 = n_tile * width + a_half * per_thread  # first intermediate column of this thread
                values = []
                for i in cutlass.range_constexpr(per_thread):
                    c = a_half * per_thread + i
                    if cutlass.const_expr(gated):
                        h = activations.apply(kind, s_c[a_row, c] * s1, s_c[a_row, c + TILE.tile_n // 2] * s1,
                                              (p0, p1, p2, p3))
                    else:
                        h = activations.apply(kind, None, s_c[a_row, c] * s1, (p0, p1, p2, p3))
                    values.append(h)
                if cutlass.const_expr(out_format == "bf16"):
                    for i in cutlass.range_constexpr(per_thread):
                        out_bf16[row * inter + col0 + i] = values[i].to(BFloat16)
                elif cutlass.const_expr(out_format == "nvfp4"):
                    rows = cute.size(permuted_to_expanded)
                    gs2 = fc2_input_scale[0]
                    for blk in cutlass.range_constexpr(per_thread // 16):
                        quantize.store_nvfp4_per_tensor(
                            values[blk * 16:(blk + 1) * 16], gs2, out_q, row * (inter // 2) + (col0 + blk * 16) // 2,
                            out_sf, swizzled_sf_offset(0, row, col0 // 16 + blk, rows, inter // 16))
                else:
                    rows = cute.size(permuted_to_expanded)
                    for blk in cutlass.range_constexpr(per_thread // 32):
                        quantize.store_mxfp8(values[blk * 32:(blk + 1) * 32], out_q, row * inter + col0 + blk * 32,
                                             out_sf, swizzled_sf_offset(0, row, col0 // 32 + blk, rows, inter // 32))
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x_bf16: cute.Tensor, x_q: cute.Tensor, x_sf: cute.Tensor, per_token_scale: cute.Tensor,
               w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor, permuted_to_expanded: cute.Tensor,
               tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
               out_bf16: cute.Tensor, out_q: cute.Tensor, out_sf: cute.Tensor, fc2_input_scale: cute.Tensor,
               hidden: Int32, n1: Int32, top_k: Int32, p0: Float32, p1: Float32, p2: Float32, p3: Float32,
               pdl: cutlass.Boolean, stream: cuda.CUstream):
        gemm1_kernel(x_bf16, x_q, x_sf, per_token_scale, w1, w1_sf, w1_alpha, permuted_to_expanded, tile_to_expert,
                     tile_to_mn_limit, num_live_tiles, out_bf16, out_q, out_sf, fc2_input_scale, hidden, n1, top_k,
                     p0, p1, p2, p3).launch(
            grid=(cute.size(tile_to_expert), n1 // TILE.tile_n, 1), block=(TILE.threads, 1, 1), stream=stream,
            use_pdl=pdl)

    return launch


def compile_gemm1(mode: str, kind: str, options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    u8 = cutlass.Uint8
    return cute.compile(
        make_kernel(mode, kind), vector(BFloat16, 16), vector(u8, 16), vector(u8), vector(Float32),
        vector(u8, 16), vector(u8, 16), vector(Float32), vector(Int32), vector(Int32), vector(Int32), vector(Int32),
        vector(BFloat16, 16), vector(u8, 16), vector(u8), vector(Float32), Int32(128), Int32(256), Int32(1),
        Float32(0), Float32(0), Float32(0), Float32(0), cutlass.Boolean(True), cuda.CUstream(0), options=options)
