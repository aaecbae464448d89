"""GEMM2 (sm_90a): FC2-input rows x 4-bit FC2 weights -> scaled bf16 expert output, finalized (semantics §2.6).

Grid (max tiles, N / 128, K split), the streaming mainloop of stream.py; N is the weight rows this launch covers
(H, or H / 2 for a localized shard) and its output columns start at `col_offset` of rows `out_pitch` (= H) wide.
Each valid permuted row p (expanded index s = t*K + k) forms y = bf16(scale * acc2):
  fused:         scale = w2_alpha[e] * (token_final_scales[s] * pts2), and y is atomically added (bf16x2
                 reduce-add) into out[t, :], which the caller zeroed; the addition order follows the schedule.
  deterministic: scale = w2_alpha[e] * pts2, y is stored to out[s, :] (the slot buffer) and the finalize kernel
                 combines the K slots of each token in a fixed order.
pts2 is the per-token FC2 row scale (w4a4_pt) or 1.

The FC2 input is bf16 in every mode: in w4a4 / w4a8 GEMM1 (or, w4a4_pt, the per-token kernel) stored its
quantization decoded, so w4a4 runs the w4a16 kernel. On gemm1.SLAB_TILES GEMM1 stores it as token slabs
(moe_ext/slabs.py, K = I) but in w4a4_pt (the per-token kernel reads it row-major): there this kernel copies a
step's live rows in one bulk copy a stage (reads_slabs; the weight-tile-fastest grid of stream.launch_grid).
Modes: w2 NVFP4 (w4a16), NVFP4 with per-row FC2 scales (w4a4_pt), MXFP4 (w4a8). The arguments are gemm2_wgmma's (the launcher picks either by name).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, GridConstant, Int32, Int64
from cutlass.experimental.cuda import TensorMap

from . import persistent as persistent_loop
from . import ptx
from . import stream as streaming
# Whether this GEMM2 reads the FC2 input as token slabs: exactly where its GEMM1s write them.
from .gemm1 import reads_slabs

MODES = ("w4a16", "w4a4_pt", "w4a8")  # w4a4 runs the w4a16 kernel


def config_for(mode: str, tokens: int, three_ctas: bool = False) -> streaming.StreamConfig:
    """The mainloop of this GEMM2: stream.config_for's, reading token slabs where reads_slabs."""
    return replace(streaming.config_for(tokens, 2, three_ctas), ring_tokens=reads_slabs(mode, tokens))


@cute.jit
def output_row_and_scale(per_token: cutlass.Constexpr, fused: cutlass.Boolean, slot, row, expert, top_k,
                         w2_alpha: cute.Tensor, token_final_scales: cute.Tensor, row_scale: cute.Tensor):
    """(output row, scale) of permuted row `row` (expanded slot `slot`): the finalize rule in this module's
    docstring, shared with gemm2_wgmma.py."""
    pts2 = Float32(1.0)
    if cutlass.const_expr(per_token):
        pts2 = row_scale[row]
    scale = w2_alpha[expert] * pts2
    out_row = slot
    if fused:
        scale = w2_alpha[expert] * (token_final_scales[slot] * pts2)
        out_row = slot // top_k
    return out_row, scale


def fc2_input_loads(a_bf16: cute.Tensor, inter, row0, limit):
    """The load_group (stream.accumulate) of a tile whose rows are FC2-input rows [row0, limit)."""

    def load_group(r, kk, k_end):
        """8 values of FC2-input row row0 + r at K = kk."""
        valid = (row0 + r < limit) & (kk < k_end)
        row = cute.math.min(row0 + r, limit - 1)
        kk = cute.math.min(kk, inter - 8)
        return streaming.token_group(a_bf16, Int64(row) * Int64(inter) + Int64(kk)), valid

    return load_group


class Output(NamedTuple):
    """What GEMM2's epilogue reads besides the accumulator tile: the kernel's output arguments."""

    out: cute.Tensor
    out_pitch: Int32
    col_offset: Int32
    permuted_to_expanded: cute.Tensor
    w2_alpha: cute.Tensor
    token_final_scales: cute.Tensor
    row_scale: cute.Tensor
    top_k: Int32
    fused: cutlass.Boolean


@cute.jit
def store_output(o: Output, s_c: cute.Tensor, tid, owner, row0, limit, expert, n_tile,
                 per_token: cutlass.Constexpr, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr):
    """The epilogue of one tile, where `owner`: thread -> (token row, consecutive output columns) of the fp32
    accumulator tile s_c, scaled and written (fused: added) by the finalize rule (output_row_and_scale)."""
    cols_per_thread = cfg.rows * tokens // cfg.threads
    a_row = tid // (cfg.threads // tokens)
    part = tid % (cfg.threads // tokens)
    row = row0 + a_row
    if owner and row < limit:
        out_row, scale = output_row_and_scale(per_token, o.fused, o.permuted_to_expanded[row], row, expert, o.top_k,
                                              o.w2_alpha, o.token_final_scales, o.row_scale)
        c0 = part * cols_per_thread
        words = [ptx.pack_bf16x2(scale * s_c[a_row, c0 + 2 * i], scale * s_c[a_row, c0 + 2 * i + 1])
                 for i in range(cols_per_thread // 2)]
        address = o.out.iterator.toint() + (Int64(out_row) * Int64(o.out_pitch) + Int64(
            o.col_offset + n_tile * cfg.rows + c0)) * 2
        if o.fused:
            ptx.write_words(address, words, ptx.red_add_bf16x2_v4, ptx.red_add_bf16x2)
        else:
            ptx.write_words(address, words)


def make_kernel(mode: str, tokens: int, cfg: streaming.StreamConfig | None = None, persistent: bool = False):
    """cfg: as in gemm1.make_kernel. persistent: one CTA a slot, items (routing tile, weight-row tile) by stride
    through persistent.stream_items (the launch's K split is ignored: none)."""
    b_block = 32 if mode == "w4a8" else 16
    cfg = cfg or config_for(mode, tokens)
    per_token = mode == "w4a4_pt"
    assert not (persistent and cfg.ring_tokens), "the persistent mainloop stages its tokens"

    @cute.kernel
    def gemm2_kernel(a_bf16: cute.Tensor, row_scale: cute.Tensor,
                     w2_sf: cute.Tensor, w2_map: GridConstant[TensorMap], w2_alpha: cute.Tensor,
                     token_final_scales: cute.Tensor,
                     permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
                     num_live_tiles: cute.Tensor, out: cute.Tensor, hidden: Int32, inter: Int32, out_pitch: Int32,
                     col_offset: Int32, top_k: Int32, fused: cutlass.Boolean, k_split: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, n_tile, rank = streaming.block_coords(cfg)  # rank: this CTA's K range inside its cluster
        cute.arch.griddepcontrol_wait()
        output = Output(out, out_pitch, col_offset, permuted_to_expanded, w2_alpha, token_final_scales, row_scale,
                        top_k, fused)
        if cutlass.const_expr(persistent):
            sm = streaming.allocate(tokens, cfg)
            n_tiles = hidden // cfg.rows

            def item_of(i):
                item_tile = i // n_tiles
                item_n = i - item_tile * n_tiles
                return persistent_loop.Item(item_n, tile_to_expert[item_tile], item_n * cfg.rows, item_tile * tokens,
                                            tile_to_mn_limit[item_tile])

            persistent_loop.stream_items(
                sm, tid, w2_sf, w2_map, hidden, inter, tile, cute.arch.grid_dim()[0], num_live_tiles[0] * n_tiles,
                item_of, lambda item: fc2_input_loads(a_bf16, inter, item.row0, item.limit),
                lambda item: store_output(output, sm.out, tid, rank == 0, item.row0, item.limit, item.expert,
                                          item.n_tile, per_token, tokens, cfg),
                tokens, cfg, b_block)
        elif tile < num_live_tiles[0]:
            expert = tile_to_expert[tile]
            limit = tile_to_mn_limit[tile]
            row0 = tile * tokens
            sm = streaming.allocate(tokens, cfg)
            loads = fc2_input_loads(a_bf16, inter, row0, limit)
            if cutlass.const_expr(cfg.ring_tokens):  # a_bf16 holds the FC2 input rows' token slabs
                loads = streaming.tile_slabs(a_bf16, tile, inter, limit - row0, tokens)
            streaming.accumulate(sm, tid, w2_sf, w2_map, expert, n_tile * cfg.rows, hidden, inter, rank,
                                 k_split, limit - row0, tokens, cfg, b_block, loads)
            store_output(output, sm.out, tid, rank == 0, row0, limit, expert, n_tile, per_token, tokens, cfg)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(a_bf16: cute.Tensor, row_scale: cute.Tensor, w2: cute.Tensor,
               w2_sf: cute.Tensor, w2_alpha: cute.Tensor, token_final_scales: cute.Tensor,
               permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
               num_live_tiles: cute.Tensor, out: cute.Tensor, hidden: Int32, inter: Int32, out_pitch: Int32,
               col_offset: Int32, top_k: Int32, fused: cutlass.Boolean, k_split: Int32, pdl: cutlass.Boolean,
               stream: cuda.CUstream):
        w2_map = streaming.weight_map(w2, cute.size(w2_alpha), hidden, inter, cfg)
        grid = streaming.launch_grid(cute.size(tile_to_expert), hidden // cfg.rows, k_split, cfg)
        cluster = (1, 1, k_split)
        if cutlass.const_expr(persistent):
            items = cute.size(tile_to_expert) * (hidden // cfg.rows)
            grid, cluster = (cute.math.min(items, persistent_loop.persistent_ctas(cfg)), 1, 1), (1, 1, 1)
        gemm2_kernel(a_bf16, row_scale, w2_sf, w2_map, w2_alpha, token_final_scales,
                     permuted_to_expanded, tile_to_expert, tile_to_mn_limit, num_live_tiles, out, hidden, inter,
                     out_pitch, col_offset, top_k, fused, k_split).launch(
            grid=grid, block=(cfg.threads, 1, 1), cluster=cluster, stream=stream, use_pdl=pdl,
            min_blocks_per_mp=cfg.ctas_per_sm, preferred_smem_carveout=100)

    return launch


def compile_gemm2(mode: str, tokens: int, options: str, three_ctas: bool = False, persistent: bool = False):
    cfg = streaming.config_for(tokens, 2, three_ctas) if persistent else config_for(mode, tokens, three_ctas)
    return compile_launch(make_kernel(mode, tokens, cfg, persistent), options)


def compile_launch(launch, options: str, stream=None):
    """Compile a GEMM2 launch function (this module's, or gemm2_wgmma's: the same arguments) on fake tensors, for
    `stream` (default: a CUstream; a TVM-FFI fake stream for a JIT-run variant)."""
    from .fake_args import vector

    u8 = cutlass.Uint8
    return cute.compile(
        launch, vector(BFloat16, 16), vector(Float32), vector(u8, 16), vector(u8, 16), vector(Float32),
        vector(Float32), vector(Int32), vector(Int32), vector(Int32), vector(Int32), vector(BFloat16, 16), Int32(128),
        Int32(128), Int32(128), Int32(0), Int32(1), cutlass.Boolean(True), Int32(1), cutlass.Boolean(True),
        cuda.CUstream(0) if stream is None else stream, options=options)
