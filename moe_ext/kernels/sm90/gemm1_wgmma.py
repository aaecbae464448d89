"""GEMM1 for large token counts (sm_90a): the warp-specialised wgmma mainloop (wgmma_mainloop.py) over gathered
bf16 token rows and 4-bit weights, then alpha (x per-token scale) -> activation -> FC2 input.

Same arguments as gemm1.py's kernel (the launcher picks either by name; this one ignores `k_split`, which must
be 1). The activations always arrive as bf16 `x_bf16`: for w4a4 / w4a8 the
routing kernel decoded them exactly (routing.py). Work items (m, n), live tiles x N1 / 128 of them, spread over
the persistent CTAs (a fixed grid; the device-side live count sets the items): item (m, n) takes routing tile m
(128 permuted rows of one local expert) and weight rows [128n, 128n + 128) of this launch's N1 rows. Token rows
are gathered through permuted_to_expanded (token = expanded // top_k); rows at or past the tile's limit read the
last valid row and are not stored, or on 64- and 128-token tiles (zero_padding) are zeros and stored as zeros. With the
64-row up/gate interleave a 128-row weight tile gives intermediate columns [col_offset + 64n, col_offset + 64n +
64) (up in accumulator columns 0..63, gate in 64..127); Relu2 gives 128.

The FC2 input goes to `out_bf16` as bf16 in every mode, for the wgmma GEMM2, each 64-column group in its token K
order (wgmma_mainloop.stage_position):
  w4a16, w4a4_pt  h itself (w4a4_pt: alpha x per_token_scale; the per-token kernel quantizes it afterwards)
  w4a4            h quantized to NVFP4 with the per-tensor fc2_input_scale (semantics §2.4a) and decoded again
  w4a8            h quantized to MXFP8 (§2.4c) and decoded again (w1 is MXFP4)
The decoded values are exactly what the streaming GEMM2 multiplies (code * block scale), so both GEMM2s see the
same FC2 input.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import activations, gemm1, ptx, quantize
from . import wgmma_mainloop as mainloop

MODES = gemm1.MODES


def config_for(mode: str, tile: int = 128, weight_rows: int = 128) -> mainloop.WgmmaConfig:
    return mainloop.config_for_tile(tile, 32 if mode == "w4a8" else 16, weight_rows)


def make_kernel(mode: str, kind: str, cfg: mainloop.WgmmaConfig | None = None):
    if mode not in MODES:
        raise ValueError(f"the wgmma GEMM1 has no mode {mode}; modes: {MODES}")
    cfg = cfg or config_for(mode)
    cfg.check()
    gated = kind != "relu2"
    width = mainloop.WEIGHT_HALF // 2 if gated else mainloop.WEIGHT_HALF  # intermediate columns of one s_c pass
    per_thread = width // 2
    group = gemm1.EPILOGUE_GROUP[mode]

    @cute.kernel
    def gemm1_wgmma_kernel(x_bf16: cute.Tensor, per_token_scale: cute.Tensor,
                           w1_tma_atom: cute.CopyAtom, w1_tma: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
                           permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor,
                           tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor, out_bf16: cute.Tensor,
                           fc2_input_scale: cute.Tensor, hidden: Int32,
                           n1: Int32, inter: Int32, col_offset: Int32, top_k: Int32, p0: Float32, p1: Float32,
                           p2: Float32, p3: Float32, tiled_mma: cute.TiledMma, tok_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()

        def token_row_offset(item, m):
            token = permuted_to_expanded[cute.math.min(item.row0 + m, item.limit - 1)] // top_k
            return Int64(token) * Int64(hidden) * Int64(2)

        def fc2_group_address(n_tile, c0, row):
            """Where FC2-input row `row` holds the 64-column group (mainloop.K_GROUP) of its intermediate column
            col_offset + n_tile * width + c0."""
            return out_bf16.iterator.toint() + (
                Int64(row) * Int64(inter) + Int64(col_offset + n_tile * width + c0 // 64 * 64)) * Int64(2)

        def epilogue(item, n_tile, s_c, r, half, row):
            expert = item.expert
            s1 = w1_alpha[expert]
            if cutlass.const_expr(mode == "w4a4_pt"):
                s1 = s1 * per_token_scale[permuted_to_expanded[row] // top_k]
            s1 = s1 * Float32(mainloop.ACCUMULATOR_SCALE)
            c0 = half * per_thread  # this thread's first intermediate column of the item's
            row_addr = s_c.iterator.toint() + r * (cfg.pitch * 4)
            group_addr = fc2_group_address(n_tile, c0, row)
            out = []
            for g in cutlass.range_constexpr(per_thread // group):
                h = []
                for q in cutlass.range_constexpr(group // 4):
                    c = c0 + group * g + 4 * q
                    up = ptx.ld_shared_v4(row_addr + c * 4)
                    if cutlass.const_expr(gated):
                        gate = ptx.ld_shared_v4(row_addr + (c + mainloop.WEIGHT_HALF // 2) * 4)
                        for j in cutlass.range_constexpr(4):
                            h.append(activations.apply(kind, up[j].bitcast(Float32) * s1,
                                                       gate[j].bitcast(Float32) * s1, (p0, p1, p2, p3)))
                    else:
                        for j in cutlass.range_constexpr(4):
                            h.append(activations.apply(kind, None, up[j].bitcast(Float32) * s1,
                                                       (p0, p1, p2, p3)))
                if cutlass.const_expr(mode == "w4a4"):
                    words = quantize.dequantized_nvfp4_per_tensor(h, fc2_input_scale[0])
                elif cutlass.const_expr(mode == "w4a8"):
                    words = quantize.dequantized_mxfp8(h)
                else:
                    words = [ptx.pack_bf16x2(h[2 * j], h[2 * j + 1]) for j in range(group // 2)]
                out += words
            mainloop.write_k_permuted(group_addr, out, c0 % 64)  # in the wgmma GEMM2's token K order

        def zero_padding(item, n_tile, half, row):
            # zero_padding: GEMM2's wgmmas then multiply zeros in the padding rows too
            c0 = half * per_thread
            mainloop.write_k_permuted(fc2_group_address(n_tile, c0, row), [Int32(0)] * (per_thread // 2), c0 % 64)

        mainloop.run_roles(cfg, tidx, cta, num_live_tiles[0], tok_layout, tiled_mma, tile_to_expert,
                           tile_to_mn_limit, x_bf16.iterator.toint(), token_row_offset, w1_tma_atom, w1_tma, w1_sf,
                           n1, hidden, epilogue, pad_epilogue=zero_padding)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x_bf16: cute.Tensor, per_token_scale: cute.Tensor,
               w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor, permuted_to_expanded: cute.Tensor,
               tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
               out_bf16: cute.Tensor, fc2_input_scale: cute.Tensor,
               hidden: Int32, n1: Int32, inter: Int32, col_offset: Int32, top_k: Int32, p0: Float32, p1: Float32,
               p2: Float32, p3: Float32, k_split: Int32, pdl: cutlass.Boolean, stream: cuda.CUstream):
        tiled_mma = mainloop.make_tiled_mma(cfg)
        tok_layout = mainloop.token_layout(cfg)
        storage = mainloop.make_storage(cfg, tok_layout)
        w1_tma_atom, w1_tma = mainloop.raw_weight_tma(cfg, w1, cute.size(w1_alpha), n1, hidden)
        gemm1_wgmma_kernel(x_bf16, per_token_scale, w1_tma_atom, w1_tma, w1_sf, w1_alpha, permuted_to_expanded,
                           tile_to_expert, tile_to_mn_limit, num_live_tiles, out_bf16, fc2_input_scale, hidden, n1,
                           inter, col_offset, top_k, p0, p1, p2, p3, tiled_mma, tok_layout).launch(
            grid=(cfg.ctas, 1, 1), block=(cfg.threads, 1, 1),
            smem=storage.size_in_bytes(), stream=stream, use_pdl=pdl,
            min_blocks_per_mp=cfg.ctas_per_sm,  # ptxas honours setmaxnreg only with a known register count at entry
            preferred_smem_carveout=100 if cfg.ctas_per_sm > 1 else None)

    return launch


def compile_gemm1_wgmma(mode: str, kind: str, options: str, tile: int = 128, weight_rows: int = 128):
    return gemm1.compile_launch(make_kernel(mode, kind, config_for(mode, tile, weight_rows)), options)
