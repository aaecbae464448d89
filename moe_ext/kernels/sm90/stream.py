"""Streaming mainloop of the grouped GEMMs (sm_90a, version 2): swap-AB, weights decoded in registers.

The 4-bit weights are the MMA's M side (128 weight rows per CTA, 16 per warp) and the routed tokens its N side
(`tokens` per CTA = the routing tile), so a CTA streams each weight byte once for up to `tokens` tokens: at decode
the kernel is a weight stream, and all of it goes through one path:

  weights  global --cp.async 16 B--> per-thread shared ring (`stages` deep) --> registers --> e2m1 decode
           (shift/mask into bf16 bit patterns, one bf16x2 multiply by the block scale) --> MMA A fragments
  tokens   global --> decoded to bf16 once per CTA and K-chunk --> shared tile --> MMA B fragments
  MMA      mma.sync m16n8k16 bf16 -> fp32 accumulators in registers

Each thread copies and later reads only its own ring slots (16 bytes of each of its two rows per 128-K step, plus
the 4-byte scale group of each row), so the ring needs no barrier, only cp.async.wait_group.

K order inside the MMA is free as long as both operands agree. Thread t of a quad owns K [32t, 32t + 32) of each
128-K step (one 16-byte load per row); a decoded register holds the codes (i, i + 4) of an 8-code word, and the
token tile is stored in the same order (x0 x4 x1 x5 x2 x6 x3 x7 per 8 values), so each B fragment is one 16-byte
shared load.

Parallelism along K, for decode where few tiles are live: inside a CTA, `k_slices` warp groups take alternate
steps of the same rows; across CTAs, the k_split CTAs of a cluster take contiguous runs of steps and rank 0 adds
the others' accumulator tiles through distributed shared memory (add_peer_accumulators), in rank order, so
results stay reproducible.

Scale bookkeeping: the decoded weight bit pattern is w * 2^-126; it is multiplied by bf16(scale * 2^63), and the
token tile holds x * 2^63, so the fp32 accumulator is exactly sum(w * scale * x) (every step is an exact bf16
operation; semantics §2.1). Limits of that trick: token values must stay below 2^64 in magnitude and MXFP4 weight
scales below 2^64 (both far outside anything a real layer holds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import ptx
from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32


@dataclass(frozen=True)
class StreamConfig:
    warps: int = 8  # each warp streams 16 weight rows (MMA M): 128 rows, one 64-row up/gate pair of the interleave
    k_slices: int = 1  # warp groups that take alternate 128-K steps of the same rows (summed at the end)
    k_step: int = 128  # K per pipeline stage
    stages: int = 6  # ring depth: 6 x 40 bytes per thread in flight
    token_elems: int = 32768  # bf16 elements of the shared token tile (64 KB): tokens x K-chunk
    ctas_per_sm: int = 1  # CTAs the launch asks to fit per SM (2 caps registers at 128 for 256 threads)

    @property
    def rows(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.k_slices


def config_for(tokens: int, gemm: int) -> StreamConfig:
    """The mainloop of GEMM `gemm` (1 or 2) on `tokens`-token tiles, as measured on the H200
    (benchmarks/results/h200_stream_variants.md).

    A CTA's fixed costs (launch, prologue, token staging, accumulator exchange, epilogue) take 2-7 us per wave and
    leave the SM's weight stream idle, so where it pays, two 8-warp CTAs share an SM: one streams while the other
    starts or finishes. That needs a 4-stage ring (shared memory under half the SM's) and at most 128 registers a
    thread. It is 8-29% faster for GEMM1 on 8-token tiles and for both GEMMs on 64-token tiles. GEMM2 on 8-token
    tiles keeps one CTA of two 8-warp K slices (twice the bytes in flight): Mixtral's GEMM2 (K = 14336 over 32
    column tiles) is 1.2-1.4x slower with two CTAs."""
    if tokens <= 8 and gemm == 2:
        return StreamConfig(k_slices=2)
    if tokens <= 64:
        return StreamConfig(stages=4, ctas_per_sm=2)
    return StreamConfig()


def shared_pieces(tokens: int, c: StreamConfig) -> tuple[int, int, int, int]:
    """Bytes of what allocate() takes: the weight ring, the scale ring, the scale table and the token tile (which
    the fp32 accumulator tile reuses after the mainloop)."""
    return (c.stages * c.threads * 32, c.stages * c.threads * 8, 256 * 4,
            max(tokens * row_pitch(tokens), tokens * (c.rows + 4) * 4))


def shared_bytes(tokens: int, c: StreamConfig) -> int:
    """Dynamic shared memory of one CTA."""
    return sum(shared_pieces(tokens, c))


def chains(tokens: int) -> int:
    """Independent accumulator sets per n-tile: with one n-tile, four sets break the MMA dependency chain."""
    return 4 if tokens <= 8 else 1


def accumulator_size(tokens: int) -> int:
    return chains(tokens) * tokens // 8 * 4


TOKEN_TILES = (8, 64, 128)  # the routing tiles the kernels are compiled for (tokens per CTA)

BF16X2_2P63 = 0x5F005F00  # bf16 2^63 in both halves
BF16X2_2P120 = 0x7B807B80
TWO_P63 = 9.223372036854775808e18


def k_chunk(tokens: int) -> int:
    """K values of the token tile staged at a time."""
    return min(4096, StreamConfig.token_elems // tokens)


def row_pitch(tokens: int) -> int:
    """Bytes between token rows of the shared tile: one 16-byte chunk of padding staggers the banks."""
    return (k_chunk(tokens) + 8) * 2


class Smem(NamedTuple):
    threads: int
    weights: Int32  # shared address of the weight ring: stages x threads x 32 bytes
    scales: Int32  # stages x threads x 8 bytes
    scale_lut: Int32  # 256 x bf16x2: scale byte -> (scale * 2^63, scale * 2^63)
    tokens: Int32  # the token tile
    out: cute.Tensor  # fp32 [tokens, rows] accumulator tile, over the token tile (used after the mainloop)


def allocate(tokens: int, c: StreamConfig) -> Smem:
    smem = cutlass.utils.SmemAllocator()
    ring_w, ring_s, lut, tile = (smem.allocate_tensor(cutlass.Uint8, cute.make_layout(n), 16)
                                 for n in shared_pieces(tokens, c))
    out = cute.make_tensor(cute.recast_ptr(tile.iterator, dtype=Float32),
                           cute.make_layout((tokens, c.rows), stride=(c.rows + 4, 1)))
    return Smem(c.threads, ring_w.iterator.toint(), ring_s.iterator.toint(), lut.iterator.toint(),
                tile.iterator.toint(), out)


def fill_scale_lut(sm: Smem, tid, block: int) -> None:
    """Each thread writes the entries of scale bytes tid, tid + threads, ... (e4m3 for NVFP4, ue8m0 for MXFP4); a
    barrier must follow before the first consume_step. A lookup is one shared load where the conversion was ~15
    instructions."""
    for i in range(max(1, 256 // sm.threads)):
        code = (tid + i * sm.threads) % 256
        value = (e4m3_to_f32(code) if block == 16 else ue8m0_to_f32(code)) * Float32(TWO_P63)
        ptx.st_shared_b32(sm.scale_lut + code * 4, ptx.pack_bf16x2(value, value))


class WeightRows(NamedTuple):
    """Where a thread's two weight rows (r, r + 8) and their scale groups are at K = 0; each 128-K step moves the
    bytes by 64 and the scale groups by `sf_step` (two 4-block tiles of the 128x4 layout for NVFP4, one for
    MXFP4)."""

    row0: Int64  # global address of this thread's 16 bytes of row r in step 0
    row1: Int64
    sf0: Int64  # global address of the 4 swizzled scale bytes of row r holding this thread's blocks in step 0
    sf1: Int64


def weight_rows(w: cute.Tensor, w_sf: cute.Tensor, expert, first_row, tid, rows_per_expert, k_extent,
                block: int, c: StreamConfig) -> WeightRows:
    warp = (tid // 32) % c.warps
    lane = tid % 32
    r = first_row + warp * 16 + lane // 4
    stride = Int64(k_extent // 2)
    row0 = w.iterator.toint() + (Int64(expert) * Int64(rows_per_expert) + Int64(r)) * stride + Int64((tid % 4) * 16)
    first = 2 * (tid % 4) if block == 16 else tid % 4  # this thread's first block of a step
    sf = w_sf.iterator.toint()
    sf0 = sf + Int64(swizzled_sf_offset(expert, r, first - first % 4, rows_per_expert, k_extent // block))
    sf1 = sf + Int64(swizzled_sf_offset(expert, r + 8, first - first % 4, rows_per_expert, k_extent // block))
    return WeightRows(row0, row0 + stride * 8, sf0, sf1)


def issue_step(sm: Smem, tid, stage, rows: WeightRows, step, block: int):
    """Start the copies of 128-K step `step`: this thread's 16 bytes of each row and their scale groups."""
    dst = sm.weights + (stage * sm.threads + tid) * 32
    offset = Int64(step) * Int64(StreamConfig.k_step // 2)
    ptx.cp_async_16(dst, rows.row0 + offset)
    ptx.cp_async_16(dst + 16, rows.row1 + offset)
    sdst = sm.scales + (stage * sm.threads + tid) * 8
    sf_offset = Int64(step) * Int64(512 * StreamConfig.k_step // block // 4)
    ptx.cp_async_4(sdst, rows.sf0 + sf_offset)
    ptx.cp_async_4(sdst + 4, rows.sf1 + sf_offset)


def _scale_pairs(sm: Smem, group: Int32, tid, block: int) -> list:
    """bf16x2 (scale * 2^63) for each of the 4 words a thread holds of one row (NVFP4: two blocks of 16, MXFP4:
    one block of 32), looked up from the scale bytes of its 4-byte group."""
    if block == 16:
        shift = ((2 * (tid % 4)) % 4) * 8
        lo = ptx.ld_shared_b32(sm.scale_lut + ((group >> shift) & 0xFF) * 4)
        hi = ptx.ld_shared_b32(sm.scale_lut + ((group >> (shift + 8)) & 0xFF) * 4)
        return [lo, lo, hi, hi]
    s2 = ptx.ld_shared_b32(sm.scale_lut + ((group >> ((tid % 4) * 8)) & 0xFF) * 4)
    return [s2, s2, s2, s2]


def consume_step(sm: Smem, tid, stage, tile_offset, acc: cute.Tensor, tokens: int, block: int):
    """acc += this thread's share of the 128-K step in ring slot `stage`; its tokens start at byte `tile_offset`
    of the token tile rows (the step's position inside the staged K-chunk)."""
    slot = sm.weights + (stage * sm.threads + tid) * 32
    w0 = ptx.ld_shared_v4(slot)
    w1 = ptx.ld_shared_v4(slot + 16)
    sslot = sm.scales + (stage * sm.threads + tid) * 8
    s0 = _scale_pairs(sm, ptx.ld_shared_b32(sslot), tid, block)
    s1 = _scale_pairs(sm, ptx.ld_shared_b32(sslot + 4), tid, block)
    lane = tid % 32
    t = lane % 4
    swap = (t >> 1) << 1  # the tile's 16-byte chunk swizzle (see stage_chunk)
    row_base = sm.tokens + (lane // 4) * row_pitch(tokens) + tile_offset
    for j in range(4):
        a0 = ptx.e2m1x8_to_bf16x2(w0[j], s0[j])
        a1 = ptx.e2m1x8_to_bf16x2(w1[j], s1[j])
        chunk = t * 4 + (Int32(j) ^ swap)
        for nt in range(tokens // 8):
            b = ptx.ld_shared_v4(row_base + nt * 8 * row_pitch(tokens) + chunk * 16)
            for h in range(2):
                base = ((2 * j + h) % chains(tokens) * (tokens // 8) + nt) * 4
                c = [acc[base + i] for i in range(4)]
                d = ptx.mma_bf16_16816([a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1]],
                                       [b[2 * h], b[2 * h + 1]], c)
                for i in range(4):
                    acc[base + i] = d[i]


def tile_address(sm: Smem, tokens: int, row, chunk) -> Int32:
    """Shared address of 8-value chunk `chunk` of token row `row`; bit 1 of the chunk flips with bit 3 so the four
    threads of a quad (32 K apart) hit different banks."""
    return sm.tokens + row * row_pitch(tokens) + (chunk ^ (((chunk >> 3) & 1) << 1)) * 16


def permute_bf16x8(u: list) -> list:
    """bf16 x0..x7 in 4 registers -> the tile order (x0 x4)(x1 x5)(x2 x6)(x3 x7)."""
    return [ptx.prmt(u[0], u[2], 0x5410), ptx.prmt(u[0], u[2], 0x7632),
            ptx.prmt(u[1], u[3], 0x5410), ptx.prmt(u[1], u[3], 0x7632)]


def bf16x8_to_tile(u: list) -> list:
    return [ptx.mul_bf16x2(v, Int32(BF16X2_2P63)) for v in permute_bf16x8(u)]


def nvfp4x8_to_tile(word: Int32, scale: Float32) -> list:
    """8 packed e2m1 codes times their e4m3 block scale, times 2^63, in tile order."""
    s2 = ptx.pack_bf16x2(scale * Float32(TWO_P63), scale * Float32(TWO_P63))
    return [ptx.mul_bf16x2(v, s2) for v in ptx.e2m1x8_to_bf16x2(word, Int32(ptx.BF16X2_2P126))]


def mxfp8x8_to_tile(lo: Int32, hi: Int32, scale: Float32) -> list:
    """8 e4m3 bytes (x0..x3 in lo, x4..x7 in hi) times their ue8m0 scale, times 2^63, in tile order. The 7 value
    bits placed at bf16 bits 4..10 read as x * 2^-120 (subnormals included); two exact multiplies finish it."""
    s2 = ptx.pack_bf16x2(scale * Float32(TWO_P63), scale * Float32(TWO_P63))
    out = []
    for p in range(4):
        u = ptx.prmt(lo, hi, ((4 + p) << 8) | p)  # byte 0 = x_p, byte 2 = x_{p+4}
        bits = ((u & Int32(0x007F007F)) << 4) | ((u & Int32(0x00800080)) << 8)
        out.append(ptx.mul_bf16x2(ptx.mul_bf16x2(bits, Int32(BF16X2_2P120)), s2))
    return out


def token_group(a_format: str, values_bf16: cute.Tensor, values_q: cute.Tensor, offset: Int64, scale_byte) -> list:
    """The 8 activation values starting at element `offset` of a row-major token matrix, in tile order: bf16
    (w4a16), NVFP4 (packed e2m1 and its e4m3 block scale) or MXFP8 (e4m3 bytes and their ue8m0 block scale);
    `scale_byte()` loads the block's scale byte (the layouts differ between the GEMMs)."""
    if a_format == "bf16":
        return bf16x8_to_tile(ptx.ld_global_v4(values_bf16.iterator.toint() + offset * 2))
    if a_format == "nvfp4":
        word = ptx.ld_global_b32(values_q.iterator.toint() + offset // 2)
        return nvfp4x8_to_tile(word, e4m3_to_f32(Int32(scale_byte())))
    lo_hi = ptx.ld_global_v2(values_q.iterator.toint() + offset)
    return mxfp8x8_to_tile(lo_hi[0], lo_hi[1], ue8m0_to_f32(Int32(scale_byte())))


def store_chunk(sm: Smem, tokens: int, row, chunk, values: list, valid) -> None:
    zero = Int32(0)
    v = [Int32(cutlass.select_(valid, x, zero)) for x in values]
    ptx.st_shared_v4(tile_address(sm, tokens, row, chunk), v[0], v[1], v[2], v[3])


def store_accumulators(sm: Smem, tid, acc: cute.Tensor, tokens: int, c: StreamConfig, add: bool) -> None:
    """Registers (all chains summed) -> sm.out[token, weight row], written or added (the K slices take turns,
    between barriers, so the sum has a fixed order)."""
    warp = (tid // 32) % c.warps
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    for nt in range(tokens // 8):
        for i in range(4):
            value = acc[nt * 4 + i]
            for chain in range(1, chains(tokens)):
                value = value + acc[(chain * (tokens // 8) + nt) * 4 + i]
            at = (nt * 8 + 2 * t + i % 2, warp * 16 + g + 8 * (i // 2))
            sm.out[at] = sm.out[at] + value if add else value


def add_peer_accumulators(sm: Smem, tid, peer, tokens: int, c: StreamConfig) -> None:
    """sm.out += the accumulator tile of cluster CTA `peer` (its K range), read through distributed shared memory.
    Call between cluster barriers; peers are added in rank order, so the sum is reproducible."""
    for i in range(tokens * c.rows // c.threads):
        index = tid + i * c.threads
        at = (index // c.rows, index % c.rows)
        address = sm.tokens + (at[0] * (c.rows + 4) + at[1]) * 4
        sm.out[at] = sm.out[at] + ptx.ld_shared_cluster_f32(address, peer)


def k_range(steps, rank, k_split):
    """First step and step count of cluster CTA `rank` when `k_split` CTAs share the K steps in contiguous runs."""
    per_rank = (steps + k_split - 1) // k_split
    first = cute.math.min(rank * per_rank, steps)
    return first, cute.math.min(per_rank, steps - first)


def chunk_tasks(tokens: int, c: StreamConfig) -> int:
    """8-value chunks each thread stages per K-chunk."""
    return tokens * k_chunk(tokens) // 8 // c.threads


@cute.jit
def accumulate(sm, tid, w, w_sf, expert, first_row, rows_per_expert, k_extent, rank, k_split,
               tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
               load_group: cutlass.Constexpr):
    """The mainloop of one CTA over weight rows [first_row, first_row + cfg.rows) of `expert` in the 4-bit weight
    `w` (scales `w_sf`): leaves its accumulator tile (summed over K slices, and on cluster rank 0 over the
    cluster's ranks) in sm.out. `load_group(r, k, k_end)` returns the 8 tile-order bf16x2 registers of token row
    r at K = k and whether they are valid (the kernel's gather and decode of its activations).

    The k_split CTAs of a cluster take contiguous runs of K steps; inside a CTA, K slice `part` takes every
    k_slices-th step of the run: its j-th step is first + j * k_slices + part.
    """
    rows = weight_rows(w, w_sf, expert, first_row, tid, rows_per_expert, k_extent, block, cfg)
    fill_scale_lut(sm, tid, block)  # read after the first staging barrier below
    acc = cute.make_rmem_tensor((accumulator_size(tokens),), Float32)
    acc.fill(0.0)
    chunk = k_chunk(tokens)
    first, steps = k_range(k_extent // cfg.k_step, rank, k_split)
    k_end = (first + steps) * cfg.k_step
    part = tid // (cfg.threads // cfg.k_slices)
    my_steps = (steps - part + cfg.k_slices - 1) // cfg.k_slices
    for s in cutlass.range_constexpr(cfg.stages - 1):
        if s < my_steps:
            issue_step(sm, tid, s, rows, first + s * cfg.k_slices + part, block)
        ptx.cp_async_commit()
    for j in cutlass.range((steps + cfg.k_slices - 1) // cfg.k_slices):
        k_run = j * cfg.k_slices * cfg.k_step  # K offset inside this CTA's run
        if k_run % chunk == 0:
            # Stage this K-chunk of the token rows, decoded to bf16, in the tile order.
            cute.arch.sync_threads()
            for m in cutlass.range_constexpr(chunk_tasks(tokens, cfg)):
                task = tid + m * cfg.threads
                r = task // (chunk // 8)
                c = task % (chunk // 8)
                values, valid = load_group(r, first * cfg.k_step + k_run + c * 8, k_end)
                store_chunk(sm, tokens, r, c, values, valid)
            cute.arch.sync_threads()
        if j + cfg.stages - 1 < my_steps:
            issue_step(sm, tid, (j + cfg.stages - 1) % cfg.stages, rows,
                       first + (j + cfg.stages - 1) * cfg.k_slices + part, block)
        ptx.cp_async_commit()
        ptx.cp_async_wait(cfg.stages - 1)
        if j < my_steps:
            consume_step(sm, tid, j % cfg.stages, (k_run % chunk + part * cfg.k_step) * 2, acc, tokens, block)
    cute.arch.sync_threads()
    for sl in cutlass.range_constexpr(cfg.k_slices):
        if part == sl:
            store_accumulators(sm, tid, acc, tokens, cfg, add=sl > 0)
        cute.arch.sync_threads()
    # Cluster split-K: rank 0 adds the other ranks' tiles in rank order; they wait until it has read them.
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    if rank == 0:
        for peer in cutlass.range(1, k_split):
            add_peer_accumulators(sm, tid, peer, tokens, cfg)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
