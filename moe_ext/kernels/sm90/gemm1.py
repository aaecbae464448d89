"""GEMM1 (sm_90a): gathered token rows x 4-bit FC1 weights -> alpha (x per-token scale) -> activation -> FC2 input.

Grid (max tiles, N1 / 128, K split): CTA (m, n, r) takes routing tile m (one local expert, `tokens` permuted
rows), weight rows [128n, 128n + 128) and K range r of its cluster, through the streaming mainloop (stream.py);
tiles past the device-side live count exit, so the grid depends only on T. N1 is the weight rows of this launch
(2I, or I for a localized shard); its intermediate columns start at `col_offset` of rows `inter` (= I) wide.
Token rows are gathered through permuted_to_expanded (token = expanded // top_k) straight from the bf16 x, except
on SLAB_TILES: there `x_bf16` holds the routed rows' token slabs (token_slabs.py, launched before this kernel),
each stage's rows one bulk copy, and the grid runs a routing tile's weight tiles next to each other (N1 / 128, max
tiles, K split) so its slabs are read again while in L2; there it also stores the FC2 input as token slabs (K = I),
which the slab GEMM2 (gemm2.py) reads the same way. With the 64-row up/gate interleave, a 128-row weight tile
yields intermediate columns [64n, 64n + 64): up in accumulator columns 0..63, gate in 64..127.

The activations always arrive as bf16 `x_bf16`: in w4a4 / w4a8 the routing launch decoded them exactly (routing.py),
once per forward, where staging them here would decode every row again in each of an expert's N tiles. The FC2
input goes to `out_bf16` as bf16 in every mode, the same as gemm1_wgmma.py's (a compile-time mode):
  w4a16    w1 NVFP4 (e4m3 per 16)  -> h
  w4a4     w1 NVFP4                -> h quantized to NVFP4 with the per-tensor scale (§2.4a) and decoded again
  w4a4_pt  like w4a4, accumulator also times per_token_scale -> h (the per-token kernel quantizes it)
  w4a8     w1 MXFP4 (ue8m0 per 32) -> h quantized to MXFP8 (§2.4c) and decoded again
Every tensor is flat; the arguments are the wgmma GEMM1's (the launcher picks either by name).
"""
from __future__ import annotations

from dataclasses import replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, GridConstant, Int32, Int64
from cutlass.experimental.cuda import TensorMap

from . import activations, ptx, quantize
from . import stream as streaming

MODES = ("w4a16", "w4a4", "w4a4_pt", "w4a8")
# Routing tiles whose GEMM1 reads its tokens as token slabs (stream.TokenSlabs: a stage's token rows in one bulk copy,
# from the matrix token_slabs.py gathers after the routing launch) instead of staging K-chunks. Whole forwards, gather
# included: 1.03-1.11x on the H200 at T=32-256, 0.99-1.03x on the H100 (session50_checks.md). w4a4_pt keeps the
# staging: the gather is a kernel node, and its forward already has a node more (the per-token quantizer).
SLAB_TILES = (16, 32)


def reads_slabs(mode: str, tokens: int) -> bool:
    """Whether this GEMM1 reads its tokens as token slabs, and (its GEMM2 being gemm2.reads_slabs then) writes the
    FC2 input as token slabs too."""
    return tokens in SLAB_TILES and mode != "w4a4_pt"


def config_for(mode: str, tokens: int, three_ctas: bool = False) -> streaming.StreamConfig:
    """The mainloop of this GEMM1: stream.config_for's, reading token slabs where reads_slabs."""
    return replace(streaming.config_for(tokens, 1, three_ctas), ring_tokens=reads_slabs(mode, tokens))


# FC2-input values one epilogue task finishes (both GEMM1 families): a scale block in w4a4 / w4a8, one 16-byte store
# of bf16 otherwise.
EPILOGUE_GROUP = {"w4a16": 8, "w4a4": 16, "w4a4_pt": 8, "w4a8": 32}


def make_kernel(mode: str, kind: str, tokens: int, cfg: streaming.StreamConfig | None = None,
                fc2_slabs: bool = False):
    """cfg: the mainloop's configuration (default config_for(mode, tokens); benchmarks/stream_variants.py times
    others). fc2_slabs: store the FC2 input as token slabs of K = inter (moe_ext/slabs.py; the routing tile's rows
    are its own), which the slab GEMM2 copies a stage at a time, instead of row-major."""
    gated = kind != "relu2"
    b_block = 32 if mode == "w4a8" else 16
    cfg = cfg or config_for(mode, tokens)

    group = EPILOGUE_GROUP[mode]

    def store_fc2_input(s_c, a_row, c0, row, col0, permuted_to_expanded, top_k, alpha, per_token_scale,
                        fc2_input_scale, out_bf16, inter, params, slab_base):
        """Activation of accumulator columns c0.. (up, and gate half a tile further) of tile row a_row, stored at
        FC2-input row `row`, column col0: bf16, or in w4a4 / w4a8 its quantization decoded; with fc2_slabs in the
        routing tile's slabs at `slab_base`. Traced inline (plain Python: the mode and activation choose the code at
        trace time)."""
        s1 = alpha
        if mode == "w4a4_pt":
            s1 = s1 * per_token_scale[permuted_to_expanded[row] // top_k]
        values = []
        for i in range(group):
            if gated:
                values.append(activations.apply(kind, s_c[a_row, c0 + i] * s1, s_c[a_row, c0 + i + cfg.rows // 2] * s1,
                                                params))
            else:
                values.append(activations.apply(kind, None, s_c[a_row, c0 + i] * s1, params))
        if mode == "w4a4":
            words = quantize.dequantized_nvfp4_per_tensor(values, fc2_input_scale[0])
        elif mode == "w4a8":
            words = quantize.dequantized_mxfp8(values)
        else:
            words = [ptx.pack_bf16x2(values[2 * j], values[2 * j + 1]) for j in range(group // 2)]
        if fc2_slabs:
            for j in range(group // 8):
                ptx.write_words(streaming.slab_chunk_address(slab_base, a_row, col0 + 8 * j, tokens),
                                streaming.bf16x8_to_tile(words[4 * j:4 * j + 4]))
        else:
            ptx.write_words(out_bf16.iterator.toint() + (Int64(row) * Int64(inter) + Int64(col0)) * Int64(2), words)

    @cute.kernel
    def gemm1_kernel(x_bf16: cute.Tensor, per_token_scale: cute.Tensor,
                     w1_sf: cute.Tensor, w1_map: GridConstant[TensorMap], w1_alpha: cute.Tensor,
                     permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor,
                     tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
                     out_bf16: cute.Tensor, fc2_input_scale: cute.Tensor,
                     hidden: Int32, n1: Int32, inter: Int32, col_offset: Int32, top_k: Int32, p0: Float32,
                     p1: Float32, p2: Float32, p3: Float32, k_split: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, n_tile, rank = streaming.block_coords(cfg)  # rank: this CTA's K range inside its cluster
        cute.arch.griddepcontrol_wait()
        if tile < num_live_tiles[0]:
            expert = tile_to_expert[tile]
            limit = tile_to_mn_limit[tile]
            row0 = tile * tokens
            sm = streaming.allocate(tokens, cfg)
            by_top_k = ptx.division_magic(top_k)  # the staging divides once per row and K-chunk

            def gather(r, kk, k_end):
                """8 values of token row r at K = kk, gathered through the permutation and decoded."""
                valid = (row0 + r < limit) & (kk < k_end)
                token = ptx.divide_by_magic(permuted_to_expanded[cute.math.min(row0 + r, limit - 1)], by_top_k)
                kk = cute.math.min(kk, hidden - 8)
                return streaming.token_group(x_bf16, Int64(token) * Int64(hidden) + Int64(kk)), valid

            load_group = gather
            if cutlass.const_expr(cfg.ring_tokens):  # x_bf16 holds the routed rows' token slabs
                load_group = streaming.tile_slabs(x_bf16, tile, hidden, limit - row0, tokens)

            streaming.accumulate(sm, tid, w1_sf, w1_map, expert, n_tile * cfg.rows, n1, hidden, rank,
                                 k_split, limit - row0, tokens, cfg, b_block, load_group)
            s_c = sm.out

            # Epilogue: thread -> (token row, `group` consecutive output columns), every thread of the CTA taking
            # its share: one scale block in w4a4 / w4a8, a 16-byte store otherwise.
            width = cfg.rows // 2 if gated else cfg.rows
            per_row = width // group
            alpha = w1_alpha[expert]  # once a thread: it may take several tasks
            slab_base = streaming.tile_slabs(out_bf16, tile, inter, 0, tokens).tile_base if fc2_slabs else None
            for m in cutlass.range_constexpr((tokens * per_row + cfg.threads - 1) // cfg.threads):
                a_row, g = streaming.task_position(tid, m, cfg.threads, per_row)
                row = row0 + a_row
                if rank == 0 and a_row < tokens and row < limit:
                    store_fc2_input(s_c, a_row, g * group, row, col_offset + n_tile * width + g * group,
                                    permuted_to_expanded, top_k, alpha, per_token_scale, fc2_input_scale, out_bf16,
                                    inter, (p0, p1, p2, p3), slab_base)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x_bf16: cute.Tensor, per_token_scale: cute.Tensor,
               w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor, permuted_to_expanded: cute.Tensor,
               tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor,
               out_bf16: cute.Tensor, fc2_input_scale: cute.Tensor,
               hidden: Int32, n1: Int32, inter: Int32, col_offset: Int32, top_k: Int32, p0: Float32, p1: Float32,
               p2: Float32, p3: Float32, k_split: Int32, pdl: cutlass.Boolean, stream: cuda.CUstream):
        w1_map = streaming.weight_map(w1, cute.size(w1_alpha), n1, hidden, cfg)
        gemm1_kernel(x_bf16, per_token_scale, w1_sf, w1_map, w1_alpha,
                     permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles, out_bf16,
                     fc2_input_scale, hidden, n1, inter, col_offset, top_k, p0, p1, p2, p3, k_split).launch(
            grid=streaming.launch_grid(cute.size(tile_to_expert), n1 // cfg.rows, k_split, cfg),
            block=(cfg.threads, 1, 1), cluster=(1, 1, k_split), stream=stream, use_pdl=pdl,
            min_blocks_per_mp=cfg.ctas_per_sm, preferred_smem_carveout=100)

    return launch


def compile_gemm1(mode: str, kind: str, tokens: int, options: str, three_ctas: bool = False):
    return compile_launch(make_kernel(mode, kind, tokens, config_for(mode, tokens, three_ctas),
                                      fc2_slabs=reads_slabs(mode, tokens)), options)


def compile_launch(launch, options: str, stream=None):
    """Compile a GEMM1 launch function (this module's, or gemm1_wgmma's: the same arguments) on fake tensors, for
    `stream` (default: a CUstream; a TVM-FFI fake stream for a JIT-run variant)."""
    from .fake_args import vector

    u8 = cutlass.Uint8
    return cute.compile(
        launch, vector(BFloat16, 16), vector(Float32), vector(u8, 16), vector(u8, 16), vector(Float32),
        vector(Int32), vector(Int32), vector(Int32), vector(Int32), vector(BFloat16, 16), vector(Float32),
        Int32(128), Int32(256), Int32(128), Int32(0), Int32(1), Float32(0), Float32(0), Float32(0), Float32(0),
        Int32(1), cutlass.Boolean(True),
        cuda.CUstream(0) if stream is None else stream, options=options)
