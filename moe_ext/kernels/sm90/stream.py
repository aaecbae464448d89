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
    unroll: int = 0  # mainloop iterations to unroll (0: the compiler decides)
    ring: str = "cp_async"  # weight ring: per-thread cp.async slots, or "bulk" copy-engine stages (below)
    sub_steps: int = 2  # bulk: 128-K steps per stage
    bulk_stages: int = 6  # bulk: ring depth

    @property
    def rows(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.k_slices


def config_for(tokens: int) -> StreamConfig:
    """Decode tiles (8 tokens) are latency-bound: one warp's step is a chain of dependent shared loads, decode and
    MMAs, so two warp groups split K (twice the bytes in flight per CTA). Larger tiles have MMA work enough."""
    return StreamConfig(k_slices=2 if tokens <= 8 else 1)


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


def bulk_pitch(c: StreamConfig) -> int:
    """Bytes between weight rows of a bulk stage: 64 of padding put rows r and r + 1 in opposite bank halves, so
    the 8 lanes of a quarter-warp (two rows, four 16-byte chunks each) read 8 different bank groups."""
    return c.sub_steps * 64 + 64


def sf_step_bytes(block: int) -> int:
    """Swizzled scale bytes of 128 rows x one 128-K step (NVFP4: two 512-byte tiles, MXFP4: one)."""
    return 512 * StreamConfig.k_step // block // 4


class Smem(NamedTuple):
    threads: int
    weights: Int32  # shared address of the weight ring: stages x threads x 32 bytes (bulk: stages x 128 x pitch)
    scales: Int32  # stages x threads x 8 bytes (bulk: stages x sub_steps x 1 KB)
    scale_lut: Int32  # 256 x bf16x2: scale byte -> (scale * 2^63, scale * 2^63)
    tokens: Int32  # the token tile
    out: cute.Tensor  # fp32 [tokens, rows] accumulator tile, over the token tile (used after the mainloop)
    full: Int32  # bulk: one mbarrier per stage (8 bytes each), complete when the stage's bytes have landed
    released: Int32  # bulk: one counter per stage of the warps done reading it


def allocate(tokens: int, c: StreamConfig) -> Smem:
    smem = cutlass.utils.SmemAllocator()
    full = released = Int32(0)
    if c.ring == "bulk":
        ring_w = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(c.bulk_stages * c.rows * bulk_pitch(c)), 16)
        ring_s = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(c.bulk_stages * c.sub_steps * 1024), 16)
        bars = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(c.bulk_stages * 12), 16)
        full = bars.iterator.toint()
        released = full + 8 * c.bulk_stages
    else:
        ring_w = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(c.stages * c.threads * 32), 16)
        ring_s = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(c.stages * c.threads * 8), 16)
    lut = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(256 * 4), 16)
    tile_bytes = max(tokens * row_pitch(tokens), tokens * (c.rows + 4) * 4)
    tile = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(tile_bytes), 16)
    out = cute.make_tensor(cute.recast_ptr(tile.iterator, dtype=Float32),
                           cute.make_layout((tokens, c.rows), stride=(c.rows + 4, 1)))
    return Smem(c.threads, ring_w.iterator.toint(), ring_s.iterator.toint(), lut.iterator.toint(),
                tile.iterator.toint(), out, full, released)


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
    multiply_step(sm, tid, w0, w1, s0, s1, tile_offset, acc, tokens)


def consume_bulk_step(sm: Smem, tid, slot, sub, tile_offset, acc: cute.Tensor, tokens: int, block: int,
                      c: StreamConfig):
    """consume_step for 128-K step `sub` of bulk stage `slot`: the same registers, read from the stage's rows (this
    thread's rows r and r + 8, 16 bytes at 32 t of the step) and its copy of the swizzled scale tiles."""
    lane = tid % 32
    r = ((tid // 32) % c.warps) * 16 + lane // 4
    t = lane % 4
    rows = sm.weights + slot * (c.rows * bulk_pitch(c)) + sub * 64 + t * 16
    w0 = ptx.ld_shared_v4(rows + r * bulk_pitch(c))
    w1 = ptx.ld_shared_v4(rows + (r + 8) * bulk_pitch(c))
    tiles = sm.scales + slot * (c.sub_steps * 1024) + sub * sf_step_bytes(block) + (t // 2 if block == 16 else 0) * 512

    def group(row):
        return ptx.ld_shared_b32(tiles + (row % 32) * 16 + (row // 32) * 4)

    s0 = _scale_pairs(sm, group(r), tid, block)
    s1 = _scale_pairs(sm, group(r + 8), tid, block)
    multiply_step(sm, tid, w0, w1, s0, s1, tile_offset, acc, tokens)


def multiply_step(sm: Smem, tid, w0: list, w1: list, s0: list, s1: list, tile_offset, acc: cute.Tensor,
                  tokens: int):
    """Decode this thread's 16 bytes of rows r and r + 8 (with their bf16x2 scales) and multiply them into acc."""
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


class BulkSource(NamedTuple):
    """Global addresses of a CTA's 128 weight rows (row 0 at K = 0; rows `stride` bytes apart) and of its scale
    tiles at K = 0: 128 rows of the 128x4 layout are one tile row, so each 128-K step's scales are
    sf_step_bytes contiguous bytes, and consecutive steps are consecutive."""

    rows: Int64
    stride: Int64
    scales: Int64


def bulk_source(w: cute.Tensor, w_sf: cute.Tensor, expert, first_row, rows_per_expert, k_extent,
                block: int) -> BulkSource:
    stride = Int64(k_extent // 2)
    rows = w.iterator.toint() + (Int64(expert) * Int64(rows_per_expert) + Int64(first_row)) * stride
    scales = w_sf.iterator.toint() + Int64(swizzled_sf_offset(expert, first_row, 0, rows_per_expert,
                                                              k_extent // block))
    return BulkSource(rows, stride, scales)


@cute.jit
def issue_bulk_stage(sm: Smem, lane, src: BulkSource, first_step, stage, steps, block: cutlass.Constexpr,
                     c: cutlass.Constexpr):
    """One warp starts the copies of stage `stage` (its steps [stage * S, min(stage * S + S, steps)) of the run
    starting at step `first_step`) into slot stage % bulk_stages: lane l copies rows 4l .. 4l + 3, lane 0 also
    the scale tiles, after announcing the byte count on the slot's full barrier."""
    slot = stage % c.bulk_stages
    bar = sm.full + slot * 8
    n = cute.math.min(c.sub_steps, steps - stage * c.sub_steps)
    step = first_step + stage * c.sub_steps
    if lane == 0:
        ptx.mbarrier_arrive_expect_tx(bar, n * (c.rows * 64 + sf_step_bytes(block)))
    cute.arch.sync_warp()
    if lane == 0:
        ptx.cp_async_bulk(sm.scales + slot * (c.sub_steps * 1024), src.scales + Int64(step) * sf_step_bytes(block),
                          n * sf_step_bytes(block), bar)
    dst = sm.weights + slot * (c.rows * bulk_pitch(c))
    for q in cutlass.range_constexpr(c.rows // 32):
        r = lane * (c.rows // 32) + q
        ptx.cp_async_bulk(dst + r * bulk_pitch(c), src.rows + Int64(r) * src.stride + Int64(step) * 64, n * 64, bar)


@cute.jit
def release_bulk_stage(sm: Smem, lane, src: BulkSource, first_step, stage, steps, block: cutlass.Constexpr,
                       c: cutlass.Constexpr):
    """This warp is done reading stage `stage`. The last of the CTA's warps to say so refills the slot with stage
    `stage + bulk_stages`, so no warp ever waits for a producer (the atomic's acquire-release orders every
    warp's reads of the slot before the refill; the proxy fence orders them before the copy engine's writes)."""
    cute.arch.sync_warp()
    slot = stage % c.bulk_stages
    done = Int32(0)
    if lane == 0:
        done = ptx.atomic_add_shared_acq_rel(sm.released + slot * 4, Int32(1))
    done = cute.arch.shuffle_sync(done, 0)
    if done == c.warps * c.k_slices - 1:
        if lane == 0:
            ptx.st_shared_b32(sm.released + slot * 4, Int32(0))
        if stage + c.bulk_stages < (steps + c.sub_steps - 1) // c.sub_steps:
            ptx.fence_proxy_async_shared()
            issue_bulk_stage(sm, lane, src, first_step, stage + c.bulk_stages, steps, block, c)


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
    rows = None
    if cutlass.const_expr(cfg.ring != "bulk"):
        rows = weight_rows(w, w_sf, expert, first_row, tid, rows_per_expert, k_extent, block, cfg)
    fill_scale_lut(sm, tid, block)  # read after the first staging barrier below
    acc = cute.make_rmem_tensor((accumulator_size(tokens),), Float32)
    acc.fill(0.0)
    chunk = k_chunk(tokens)
    first, steps = k_range(k_extent // cfg.k_step, rank, k_split)
    k_end = (first + steps) * cfg.k_step
    part = tid // (cfg.threads // cfg.k_slices)
    if cutlass.const_expr(cfg.ring == "bulk"):
        bulk_mainloop(sm, tid, w, w_sf, expert, first_row, rows_per_expert, k_extent, first, steps, k_end, part, acc,
                      tokens, cfg, block, load_group)
    else:
        ring_mainloop(sm, tid, rows, first, steps, k_end, part, acc, tokens, cfg, block, load_group)
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


@cute.jit
def stage_tokens(sm, tid, first, k_run, k_end, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr,
                 load_group: cutlass.Constexpr):
    """Stage the K-chunk at k_run (inside the run starting at step `first`) of the token rows, decoded to bf16,
    in the tile order, between two CTA barriers."""
    chunk = k_chunk(tokens)
    cute.arch.sync_threads()
    for m in cutlass.range_constexpr(chunk_tasks(tokens, cfg)):
        task = tid + m * cfg.threads
        r = task // (chunk // 8)
        c = task % (chunk // 8)
        values, valid = load_group(r, first * cfg.k_step + k_run + c * 8, k_end)
        store_chunk(sm, tokens, r, c, values, valid)
    cute.arch.sync_threads()


@cute.jit
def bulk_mainloop(sm, tid, w, w_sf, expert, first_row, rows_per_expert, k_extent, first, steps, k_end, part,
                  acc: cute.Tensor, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
                  load_group: cutlass.Constexpr):
    """Stages of cfg.sub_steps 128-K steps arrive by bulk copies (one per weight row, one for the scale tiles),
    counted on the stage's full barrier; K slice `part` takes steps part, part + k_slices, ... of each stage."""
    chunk = k_chunk(tokens)
    assert chunk % (cfg.sub_steps * cfg.k_step) == 0 and cfg.sub_steps % cfg.k_slices == 0
    src = bulk_source(w, w_sf, expert, first_row, rows_per_expert, k_extent, block)
    lane = tid % 32
    if tid == 0:
        for s in cutlass.range_constexpr(cfg.bulk_stages):
            ptx.mbarrier_init(sm.full + s * 8, 1)
            ptx.st_shared_b32(sm.released + s * 4, Int32(0))
        ptx.fence_mbarrier_init()
    cute.arch.sync_threads()
    num_stages = (steps + cfg.sub_steps - 1) // cfg.sub_steps
    if tid < 32:
        for s in cutlass.range_constexpr(cfg.bulk_stages):
            if s < num_stages:
                issue_bulk_stage(sm, lane, src, first, s, steps, block, cfg)
    for i in cutlass.range(num_stages, unroll=cfg.unroll):
        k_run = i * cfg.sub_steps * cfg.k_step
        if k_run % chunk == 0:
            stage_tokens(sm, tid, first, k_run, k_end, tokens, cfg, load_group)
        slot = i % cfg.bulk_stages
        ptx.mbarrier_wait_parity(sm.full + slot * 8, (i // cfg.bulk_stages) % 2)
        for u in cutlass.range_constexpr(cfg.sub_steps // cfg.k_slices):
            sub = u * cfg.k_slices + part
            if i * cfg.sub_steps + sub < steps:
                consume_bulk_step(sm, tid, slot, sub, (k_run % chunk + sub * cfg.k_step) * 2, acc, tokens, block,
                                  cfg)
        release_bulk_stage(sm, lane, src, first, i, steps, block, cfg)


@cute.jit
def ring_mainloop(sm, tid, rows: WeightRows, first, steps, k_end, part, acc: cute.Tensor, tokens: cutlass.Constexpr,
                  cfg: cutlass.Constexpr, block: cutlass.Constexpr, load_group: cutlass.Constexpr):
    """Each thread copies its own ring slots (cp.async, cfg.stages deep; `rows` from weight_rows) and waits on its
    own groups."""
    chunk = k_chunk(tokens)
    my_steps = (steps - part + cfg.k_slices - 1) // cfg.k_slices
    for s in cutlass.range_constexpr(cfg.stages - 1):
        if s < my_steps:
            issue_step(sm, tid, s, rows, first + s * cfg.k_slices + part, block)
        ptx.cp_async_commit()
    for j in cutlass.range((steps + cfg.k_slices - 1) // cfg.k_slices, unroll=cfg.unroll):
        k_run = j * cfg.k_slices * cfg.k_step  # K offset inside this CTA's run
        if k_run % chunk == 0:
            stage_tokens(sm, tid, first, k_run, k_end, tokens, cfg, load_group)
        if j + cfg.stages - 1 < my_steps:
            issue_step(sm, tid, (j + cfg.stages - 1) % cfg.stages, rows,
                       first + (j + cfg.stages - 1) * cfg.k_slices + part, block)
        ptx.cp_async_commit()
        ptx.cp_async_wait(cfg.stages - 1)
        if j < my_steps:
            consume_step(sm, tid, j % cfg.stages, (k_run % chunk + part * cfg.k_step) * 2, acc, tokens, block)
