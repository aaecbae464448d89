"""GEMM2 for large token counts (sm_90a): the warp-specialised wgmma mainloop (wgmma_mainloop.py) over the bf16
FC2-input rows and 4-bit FC2 weights, finalized like gemm2.py (semantics §2.6).

Same arguments as gemm2.py's kernel (the launcher picks either by name; this one ignores `k_split`, which must
be 1). The FC2 input is always bf16 `a_bf16`: in the quantized modes gemm1_wgmma.py (or the
per-token kernel) stored its quantization decoded again. Modes: w4a16 (NVFP4 weights; w4a4 runs it too, its FC2
input arriving decoded), w4a4_pt (also times the per-row FC2 scale `row_scale`), w4a8 (MXFP4 weights).

Work items (m, n) over the persistent CTAs, as in gemm1_wgmma.py: item (m, n) takes routing tile m (128 permuted
rows of one local expert, read in place as TMA boxes: the FC2 input is already in permuted order) and weight rows
[128n, 128n + 128) of this launch's N (= `hidden`: H, or H / 2 for a localized shard), whose output columns start
at `col_offset` of rows `out_pitch` wide. Each valid row p (expanded slot s = t*K + k) gives y = bf16(scale * acc),
with scale formed as gemm2.py forms it (pts2: w4a4_pt's row_scale[p], else 1):
  fused          scale = w2_alpha[e] * (token_final_scales[s] * pts2); y is added (bf16x2 reduce-add) into out[t]
  deterministic  scale = w2_alpha[e] * pts2; y is stored to the slot row out[s]
"""
from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import gemm1_wgmma, gemm2, ptx
from . import wgmma_mainloop as mainloop

MODES = ("w4a16", "w4a4_pt", "w4a8")  # w4a4 runs the w4a16 kernel (launcher._GEMM2_MODE)


def make_kernel(mode: str, cfg: mainloop.WgmmaConfig | None = None):
    if mode not in MODES:
        raise ValueError(f"the wgmma GEMM2 has no mode {mode}; modes: {MODES}")
    # the FC2 input's rows are contiguous per routing tile: the copier loads them as TMA boxes
    cfg = dataclasses.replace(cfg or gemm1_wgmma.config_for(mode), tma_tokens=True)
    cfg.check()
    per_thread = mainloop.WEIGHT_HALF // 2  # output columns of one epilogue thread

    @cute.kernel
    def gemm2_wgmma_kernel(a_bf16: cute.Tensor, row_scale: cute.Tensor,
                           w2_tma_atom: cute.CopyAtom, w2_tma: cute.Tensor, w2_sf: cute.Tensor, w2_alpha: cute.Tensor,
                           token_final_scales: cute.Tensor, permuted_to_expanded: cute.Tensor,
                           tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                           out: cute.Tensor, hidden: Int32, inter: Int32, out_pitch: Int32, col_offset: Int32,
                           top_k: Int32, fused: cutlass.Boolean, tiled_mma: cute.TiledMma,
                           tok_layout: cute.ComposedLayout, a_tma_atom: cute.CopyAtom, a_tma: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()

        def epilogue(item, n_tile, s_c, r, half, row):
            expert = item.expert
            out_row, scale = gemm2.output_row_and_scale(mode == "w4a4_pt", fused, permuted_to_expanded[row],
                                                        row, expert, top_k, w2_alpha, token_final_scales,
                                                        row_scale)
            scale = scale * Float32(mainloop.ACCUMULATOR_SCALE)
            c0 = half * per_thread
            row_addr = s_c.iterator.toint() + r * (cfg.pitch * 4)
            words = []
            for v in cutlass.range_constexpr(per_thread // 4):
                acc = ptx.ld_shared_v4(row_addr + (c0 + 4 * v) * 4)
                words += [ptx.pack_bf16x2(scale * acc[0].bitcast(Float32), scale * acc[1].bitcast(Float32)),
                          ptx.pack_bf16x2(scale * acc[2].bitcast(Float32), scale * acc[3].bitcast(Float32))]
            address = out.iterator.toint() + (Int64(out_row) * Int64(out_pitch) + Int64(
                col_offset + n_tile * mainloop.WEIGHT_HALF + c0)) * 2
            if fused:
                ptx.write_words(address, words, ptx.red_add_bf16x2_v4, ptx.red_add_bf16x2)
            else:
                ptx.write_words(address, words)

        mainloop.run_roles(cfg, tidx, cta, num_live_tiles[0], tok_layout, tiled_mma, tile_to_expert,
                           tile_to_mn_limit, a_bf16.iterator.toint(), None, w2_tma_atom, w2_tma, w2_sf,
                           hidden, inter, epilogue, token_tma=(a_tma_atom, a_tma))
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(a_bf16: cute.Tensor, row_scale: cute.Tensor, w2: cute.Tensor,
               w2_sf: cute.Tensor, w2_alpha: cute.Tensor, token_final_scales: cute.Tensor,
               permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
               num_live_tiles: cute.Tensor, out: cute.Tensor, hidden: Int32, inter: Int32, out_pitch: Int32,
               col_offset: Int32, top_k: Int32, fused: cutlass.Boolean, k_split: Int32, pdl: cutlass.Boolean,
               stream: cuda.CUstream):
        tiled_mma = mainloop.make_tiled_mma(cfg)
        tok_layout = mainloop.token_layout(cfg)
        storage = mainloop.make_storage(cfg, tok_layout)
        w2_tma_atom, w2_tma = mainloop.raw_weight_tma(cfg, w2, cute.size(w2_alpha), hidden, inter)
        a_tma_atom, a_tma = mainloop.token_box_tma(cfg, a_bf16, inter, tok_layout)
        gemm2_wgmma_kernel(a_bf16, row_scale, w2_tma_atom, w2_tma, w2_sf, w2_alpha, token_final_scales,
                           permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles, out, hidden,
                           inter, out_pitch, col_offset, top_k, fused, tiled_mma, tok_layout, a_tma_atom,
                           a_tma).launch(
            grid=(cfg.ctas, 1, 1), block=(cfg.threads, 1, 1),
            smem=storage.size_in_bytes(), stream=stream, use_pdl=pdl,
            min_blocks_per_mp=cfg.ctas_per_sm,  # ptxas honours setmaxnreg only with a known register count at entry
            preferred_smem_carveout=100 if cfg.ctas_per_sm > 1 else None)

    return launch


def compile_gemm2_wgmma(mode: str, options: str, tile: int = 128, weight_rows: int = 128):
    return gemm2.compile_launch(make_kernel(mode, gemm1_wgmma.config_for(mode, tile, weight_rows)), options)
