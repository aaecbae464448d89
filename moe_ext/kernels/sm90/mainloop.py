"""The shared mainloop of the grouped GEMMs (sm_90a, first version): per K chunk, every thread decodes its share
of the gathered activation rows (A) and of the expert's 4-bit weight rows (B) to bf16 in shared memory, then the
CTA runs bf16 tensor-core MMAs with fp32 accumulation; the accumulator tile is staged through shared memory for the
epilogue. Decode and MMA are not overlapped yet (docs/perf-notes.md)."""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .fp4 import e2m1_to_f32, e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32


@dataclass(frozen=True)
class TileConfig:
    tile_m: int = 64  # permuted rows per CTA = the routing tile
    tile_n: int = 128  # weight rows per CTA (one up/gate pair of 64-row groups for gated FC1)
    tile_k: int = 64
    threads: int = 128  # 4 warps, 2 x 2 over (M, N)


TILE = TileConfig()


def make_tiled_mma():
    op = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
    return cute.make_tiled_mma(op, cute.make_layout((2, 2, 1)), permutation_mnk=(32, 32, 16))


def shared_tiles():
    """(sA [M, K] bf16, sB [N, K] bf16, sC [M, N] fp32); A and B alias the first bytes of C, which is only
    written once the mainloop is done."""
    smem = cutlass.utils.SmemAllocator()
    s_c = smem.allocate_tensor(Float32, cute.make_layout((TILE.tile_m, TILE.tile_n), stride=(TILE.tile_n, 1)), 16)
    a_words = TILE.tile_m * TILE.tile_k // 2  # bf16 pairs per fp32 word
    s_a = cute.make_tensor(cute.recast_ptr(s_c.iterator, dtype=BFloat16),
                           cute.make_layout((TILE.tile_m, TILE.tile_k), stride=(TILE.tile_k, 1)))
    s_b = cute.make_tensor(cute.recast_ptr(s_c.iterator + a_words, dtype=BFloat16),
                           cute.make_layout((TILE.tile_n, TILE.tile_k), stride=(TILE.tile_k, 1)))
    return s_a, s_b, s_c


def make_mma(tid, s_a, s_b, s_c):
    """MMA partitions of one CTA: (tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc) with acc zeroed.

    The K loop lives in each kernel (control flow must be in traced kernel code, and only tensors and numbers
    may be carried through it):

        for k0 in cutlass.range(0, K, TILE.tile_k):
            fill s_a / s_b with the decoded chunk; sync; mma_chunk(...); sync
        cute.autovec_copy(acc, t_sc); sync   # then the epilogue reads s_c
    """
    tiled_mma = make_tiled_mma()
    thr_mma = tiled_mma.get_slice(tid)
    t_sa = thr_mma.partition_A(s_a)
    t_sb = thr_mma.partition_B(s_b)
    t_sc = thr_mma.partition_C(s_c)
    r_a = tiled_mma.make_fragment_A(t_sa)
    r_b = tiled_mma.make_fragment_B(t_sb)
    acc = tiled_mma.make_fragment_C(t_sc)
    acc.fill(0.0)
    return tiled_mma, t_sa, t_sb, t_sc, r_a, r_b, acc


def mma_chunk(tiled_mma, t_sa, t_sb, r_a, r_b, acc):
    """acc += the K chunk now in shared memory."""
    cute.autovec_copy(t_sa, r_a)
    cute.autovec_copy(t_sb, r_b)
    for kb in range(cute.size(r_a, mode=[2])):  # static: a plain Python loop unrolls at trace time
        cute.gemm(tiled_mma, acc, r_a[None, None, kb], r_b[None, None, kb], acc)


def store_e2m1_pairs(s_tile, row, col0, packed, byte0, num_bytes, scale):
    """Decode `num_bytes` packed e2m1 bytes (packed[byte0 + j], even element in the low nibble) times `scale` into
    s_tile[row, col0 : col0 + 2 * num_bytes] as bf16."""
    for j in range(num_bytes):
        byte = Int32(packed[byte0 + j])
        s_tile[row, col0 + 2 * j] = (e2m1_to_f32(byte & 15) * scale).to(BFloat16)
        s_tile[row, col0 + 2 * j + 1] = (e2m1_to_f32(byte >> 4) * scale).to(BFloat16)


def load_weight_chunk(s_b, tid, w, w_sf, expert, weight_row, rows_per_expert, k0, k_extent, block):
    """Thread `tid` decodes the K chunk [k0, k0 + tile_k) of one 4-bit weight row into s_b[tid, :]: e2m1 codes
    times their scale (e4m3 per 16 for NVFP4, ue8m0 per 32 for MXFP4) read from the 128x4-swizzled layout.

    The row is addressed with a 64-bit offset: a layer's weights can exceed 2^31 bytes (DeepSeek-V3 with all
    256 experts on one GPU), which int32 tensor indexing cannot reach.
    """
    row_start = (Int64(expert) * Int64(rows_per_expert) + Int64(weight_row)) * Int64(k_extent // 2)
    row = cute.make_tensor(w.iterator + row_start, cute.make_layout(k_extent // 2))
    for blk in range(TILE.tile_k // block):
        sf_at = swizzled_sf_offset(expert, weight_row, k0 // block + blk, rows_per_expert, k_extent // block)
        raw = Int32(w_sf[sf_at])
        scale = e4m3_to_f32(raw) if block == 16 else ue8m0_to_f32(raw)
        store_e2m1_pairs(s_b, tid, blk * block, row, k0 // 2 + blk * (block // 2), block // 2, scale)


def store_activation_chunk(s_a, row, col0, a_format, values, index0, count, scale):
    """`count` activation values starting at values[index0] into s_a[row, col0:] as bf16: copied (bf16), e4m3
    bytes times `scale` (mxfp8), or packed e2m1 pairs times `scale` (one NVFP4 block of 16 per call)."""
    if a_format == "bf16":
        for i in range(count):
            s_a[row, col0 + i] = values[index0 + i]
    elif a_format == "mxfp8":
        for i in range(count):
            s_a[row, col0 + i] = (e4m3_to_f32(Int32(values[index0 + i])) * scale).to(BFloat16)
    else:
        store_e2m1_pairs(s_a, row, col0, values, index0, count // 2, scale)


def zero_activation_chunk(s_a, row, col0, count):
    """Rows past an expert's last token read as zeros."""
    for i in range(count):
        s_a[row, col0 + i] = BFloat16(0.0)
