"""Warp-specialised wgmma mainloop (sm_90a) for large token counts: gathered bf16 rows x 4-bit weights decoded once
per K stage into shared memory, bf16 wgmma with fp32 accumulators.

CTA tile: 128 routed rows (A, the wgmma M side: one routing tile of one local expert) x 128 weight rows (B, the N
side) x all of K in stages of 64 (one 128-byte swizzle row of bf16), `stages` deep. 384 threads:

  warpgroup 0 (producer, setmaxnreg down)
    A: 16-byte cp.async of the rows `a_row_offset(m)` names (the kernel's gather) into the swizzled sA stage.
    B: cp.async of each thread's weight row (32 code bytes + the 4-byte scale group of the 128x4 layout) into a
       private raw ring `lag` stages ahead; then decode (e2m1 -> bf16, times the bf16 block scale: exact, <= 6
       significant bits) and st.shared 16-byte chunks into the swizzled sB stage.
    Then cp.async.wait_group -> fence.proxy.async (the wgmma reads through the async proxy) -> mbarrier arrive.
  warpgroups 1-2 (consumers, setmaxnreg up)
    wgmma m64n128k16 SS, 64 rows each; acc -> fp32 tile s_c[row][weight col] in shared memory for the epilogue.

The producer never holds data in registers across iterations: iteration j fills stage j (A and raw B as cp.async
group j), waits for group j - lag, decodes B(j - lag) and publishes stage j - lag, so lag + 1 stages of copies are
in flight while one decodes. stages >= lag + 2 (the consumers hold up to two stages: wgmma wait_group(1)).
Measured on the H200 (benchmarks/results/h200_session4_checks.md): 1.57-1.73x the streaming GEMMs at T = 4096.
"""
# (no `from __future__ import annotations`: cute.struct reads its annotations as live objects)
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.tensor_utils import LayoutEnum

from . import ptx
from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32

PRODUCERS = 128  # threads of the producer warpgroup
CONSUMERS = 256


@dataclass(frozen=True)
class WgmmaConfig:
    bm: int = 128  # routed rows per CTA (= the routing tile)
    bn: int = 128  # weight rows per CTA
    bk: int = 64  # K per stage: 128 bytes of bf16 = one 128B-swizzle row
    stages: int = 4  # sA + sB ring depth (32 KB a stage)
    lag: int = 2  # producer: stages of copies in flight ahead of the one being decoded
    # fp32 padding of an s_c row (pitch 132 = 4 mod 32): the epilogue's 16-byte row reads by 8 consecutive rows
    # cover all 32 banks; the accumulator's 8-byte stores pay a 2-way conflict once per tile.
    pad: int = 4
    producer_regs: int = 56  # setmaxnreg: 128 * 56 + 256 * 224 = 64512 <= 65536
    consumer_regs: int = 224
    sf_block: int = 16  # weight scale block: 16 (NVFP4, e4m3 scales) or 32 (MXFP4, ue8m0 scales)

    @property
    def threads(self) -> int:
        return PRODUCERS + CONSUMERS

    @property
    def pitch(self) -> int:
        return self.bn + self.pad

    def check(self) -> None:
        assert self.bm == 128 and self.bn == 128, "the thread mappings assume a 128 x 128 tile"
        assert self.bk == 64, "one stage must be one 4-block group of the 128x4 scale layout"
        assert self.stages >= self.lag + 2, "producer lag + the consumers' two held stages must fit the ring"
        assert self.sf_block in (16, 32), "NVFP4 (16) or MXFP4 (32) weights"


DEFAULT = WgmmaConfig()


def make_tiled_mma(cfg: WgmmaConfig):
    """bf16 x bf16 -> fp32, both K-major; two consumer warpgroups stacked along M. Call inside a jit."""
    return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (2, 1, 1), tiler_mn=(64, cfg.bn))


def smem_layouts(cfg: WgmmaConfig):
    """128B-swizzled K-major stage layouts of A (bm x bk) and B (bn x bk), `stages` deep. Call inside a jit."""
    tile = (cfg.bm, cfg.bn, cfg.bk)
    return (sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, BFloat16, cfg.stages),
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, BFloat16, cfg.stages))


def make_storage(cfg: WgmmaConfig, sA_layout, sB_layout):
    raw_ring = cfg.lag + 1

    @cute.struct
    class Storage:
        mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]  # full[stages], empty[stages]
        # Producer-private raw weight ring: [slot][half][thread] 16 B (conflict-free 16-byte loads) and
        # [slot][thread] 4 scale bytes.
        raw_codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_ring * 2 * PRODUCERS * 16], 16]
        raw_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_ring * PRODUCERS * 4], 16]
        sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
        sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]
        sC: cute.struct.Align[cute.struct.MemRange[Float32, cfg.bm * cfg.pitch], 16]

    return Storage


def allocate(cfg: WgmmaConfig, sA_layout, sB_layout):
    """(sA, sB, s_c, raw code ring address, raw scale ring address, pipeline): the CTA's shared memory and its
    stage pipeline; all 384 threads call it. Kernels keep the pieces as separate locals (a runtime branch turns
    the Python ints inside a carried tuple into runtime values). Full barriers count the 128 producer threads
    (each after its own wait_group + proxy fence), empty ones the 256 consumer threads.
    sA (bm, bk, stages) and sB (bn, bk, stages) carry their swizzle in the pointer; s_c is fp32 (bm, bn) with row
    pitch cfg.pitch, the accumulator tile for the epilogue."""
    st = cutlass.memory.SmemAllocator().allocate(make_storage(cfg, sA_layout, sB_layout))
    pipe = pipeline.PipelineAsync.create(
        barrier_storage=st.mbar.data_ptr(), num_stages=cfg.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, PRODUCERS),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMERS))
    return (st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner),
            st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner),
            st.sC.get_tensor(cute.make_layout((cfg.bm, cfg.bn), stride=(cfg.pitch, 1))),
            st.raw_codes.data_ptr().toint(), st.raw_scales.data_ptr().toint(), pipe)


# ----------------------------------------------------------------------------------------------------------------
# Producer (warpgroup 0)
# ----------------------------------------------------------------------------------------------------------------
def a_copy_partition(cfg: WgmmaConfig, sA, ptid):
    """Thread p copies 16-byte chunk p % 8 of rows p // 8 + 16 i (i < 8) of each A stage. Returns the cp.async
    atom, the sA partition ((8,1), 8, 1, stages) and the (m, k) coordinate of each chunk."""
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
    g2s = cute.make_tiled_copy_tv(cp_atom, cute.make_layout((16, 8), stride=(8, 1)),
                                  cute.make_layout((1, 8))).get_slice(ptid)
    return cp_atom, g2s.partition_D(sA), g2s.partition_D(cute.make_identity_tensor((cfg.bm, cfg.bk)))


def b_store_partition(cfg: WgmmaConfig, sB, ptid):
    """Thread p owns weight row p of each B stage, all 8 chunks; a quarter warp storing chunk c hits chunks
    c ^ (row % 8) of 8 rows: conflict-free. Returns the st.shared atom and the sB partition ((8,1), 1, 8, stages)."""
    r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    r2s = cute.make_tiled_copy_tv(r2s_atom, cute.make_layout((cfg.bn, 1)), cute.make_layout((1, 8))).get_slice(ptid)
    return r2s_atom, r2s.partition_D(sB)


def a_sources(tAcA, a_base: Int64, a_row_offset) -> cute.Tensor:
    """Global address of each of this thread's A chunks at K = 0 (64-bit: T * H can pass 2^31)."""
    chunks = cute.size(tAcA, mode=[1])
    a_src = cute.make_rmem_tensor((chunks,), Int64)
    for i in range(chunks):
        m, k = tAcA[(0, i, 0)]
        a_src[i] = a_base + a_row_offset(m) + Int64(k) * Int64(2)
    return a_src


def issue_a_stage(cfg: WgmmaConfig, cp_atom, tAsA, a_src: cute.Tensor, kt, stage):
    """cp.async 16 bytes of each of this thread's A chunks of K stage kt into sA[..., stage]."""
    k_bytes = Int64(kt) * Int64(cfg.bk * 2)
    for i in range(cute.size(tAsA, mode=[1])):
        src = cute.make_tensor(cute.make_ptr(BFloat16, a_src[i] + k_bytes, cute.AddressSpace.gmem, assumed_align=16),
                               cute.make_layout(((8, 1),)))
        cute.copy(cp_atom, src, tAsA[(None, i, 0, stage)])


class RawRing:
    """This thread's slots of the raw weight ring (private: read back by the thread that wrote them, no barrier)."""

    def __init__(self, codes_base: Int32, scales_base: Int32, ptid):
        self.codes = codes_base + ptid * 16
        self.scales = scales_base + ptid * 4

    def codes_at(self, slot, half) -> Int32:
        return self.codes + (slot * 2 + half) * (PRODUCERS * 16)

    def scales_at(self, slot) -> Int32:
        return self.scales + slot * (PRODUCERS * 4)


def issue_b_stage(cfg: WgmmaConfig, ring: RawRing, w_row: Int64, sf_row: Int64, kt, slot):
    """cp.async this thread's weight row for K stage kt: 32 code bytes and the 4-byte scale group of the 128x4
    layout that holds the stage's blocks (the next group is 512 bytes on). NVFP4: blocks 4kt..4kt+3, the whole
    group; MXFP4: blocks 2kt, 2kt + 1, half of group kt / 2 (decode_b_stage picks the half)."""
    src = w_row + Int64(kt) * Int64(cfg.bk // 2)
    ptx.cp_async_16(ring.codes_at(slot, 0), src)
    ptx.cp_async_16(ring.codes_at(slot, 1), src + Int64(16))
    stages_per_group = 4 * cfg.sf_block // cfg.bk
    ptx.cp_async_4(ring.scales_at(slot), sf_row + Int64(kt // stages_per_group) * Int64(512))


def decode_b_stage(cfg: WgmmaConfig, ring: RawRing, r2s_atom, tBsB, slot, stage, kt):
    """Raw ring slot of K stage kt -> bf16 value * scale (e4m3, or ue8m0: a power of two, exact too) -> this
    thread's row of sB[..., stage], one 16-byte chunk at a time."""
    words = [ptx.ld_shared_v4(ring.codes_at(slot, h)) for h in range(2)]
    scale_word = ptx.ld_shared_b32(ring.scales_at(slot))
    chunk = cute.make_rmem_tensor(tBsB[(None, 0, 0, 0)].shape, BFloat16)
    chunk_words = cute.recast_tensor(chunk, Int32)
    blocks = cfg.bk // cfg.sf_block
    chunks_per_block = cfg.sf_block // 8
    first_byte = 0
    if cutlass.const_expr(cfg.sf_block == 32):
        first_byte = (kt % 2) * 2  # this stage's half of the 4-byte group
    for blk in range(blocks):
        byte = (scale_word >> (8 * (first_byte + blk))) & 0xFF
        if cutlass.const_expr(cfg.sf_block == 16):
            s = e4m3_to_f32(byte)
        else:
            s = ue8m0_to_f32(byte)
        s2 = ptx.pack_bf16x2(s, s)
        for part in range(chunks_per_block):
            c = chunks_per_block * blk + part
            values = ptx.e2m1x8_to_bf16x8(words[c // 4][c % 4], s2)
            for j in range(4):
                chunk_words[j] = values[j]
            cute.copy(r2s_atom, chunk, tBsB[(None, 0, c, stage)])


@cute.jit
def produce(cfg: cutlass.Constexpr, pipe, sA, sB, raw_codes: Int32, raw_scales: Int32, ptid, a_base: Int64,
            a_row_offset: cutlass.Constexpr, w, w_sf, expert, first_row, rows_per_expert, k_extent):
    """Warpgroup 0 over all K stages. A row m of the tile starts `a_row_offset(m)` bytes past `a_base` (bf16,
    16-byte aligned rows); the weight rows are [first_row, first_row + 128) of `expert` in the 4-bit `w` of
    `rows_per_expert` rows and K = k_extent, block scales `w_sf` (cfg.sf_block)."""
    cp_atom, tAsA, tAcA = a_copy_partition(cfg, sA, ptid)
    r2s_atom, tBsB = b_store_partition(cfg, sB, ptid)
    a_src = a_sources(tAcA, a_base, a_row_offset)
    w_row_index = first_row + ptid
    w_row = w.iterator.toint() + (Int64(expert) * Int64(rows_per_expert) + Int64(w_row_index)) * Int64(k_extent // 2)
    sf_row = w_sf.iterator.toint() + Int64(swizzled_sf_offset(expert, w_row_index, 0, rows_per_expert,
                                                              k_extent // cfg.sf_block))
    ring = RawRing(raw_codes, raw_scales, ptid)
    k_tiles = k_extent // cfg.bk

    fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
    publish = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
    for j in cutlass.range(k_tiles + cfg.lag, unroll=1):
        if j < k_tiles:
            pipe.producer_acquire(fill)
            issue_a_stage(cfg, cp_atom, tAsA, a_src, j, fill.index)
            issue_b_stage(cfg, ring, w_row, sf_row, j, j % (cfg.lag + 1))
            fill.advance()
        # One group per iteration, empty ones included, so "group j - lag landed" is always wait_group(lag).
        cute.arch.cp_async_commit_group()
        if j >= cfg.lag:
            d = j - cfg.lag
            cute.arch.cp_async_wait_group(cfg.lag)
            decode_b_stage(cfg, ring, r2s_atom, tBsB, d % (cfg.lag + 1), publish.index, d)
            cute.arch.fence_view_async_shared()  # generic-proxy writes (cp.async, st.shared) -> wgmma reads
            pipe.producer_commit(publish)
            publish.advance()
    pipe.producer_tail(fill)  # don't exit with consumer releases still in flight


# ----------------------------------------------------------------------------------------------------------------
# Consumers (warpgroups 1 and 2)
# ----------------------------------------------------------------------------------------------------------------
@cute.jit
def consume(cfg: cutlass.Constexpr, pipe, sA, sB, s_c, tiled_mma: cute.TiledMma, wg, ctid, k_extent):
    """acc (64 rows x 128 weight rows per warpgroup) = sA . sB^T over all K stages, then staged into s_c and
    synchronised across both consumer warpgroups."""
    thr_wg = tiled_mma.get_slice((wg - 1) * 128)
    tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))  # smem descriptors (MMA, M, K, stages)
    tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
    tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    acc = cute.make_rmem_tensor(tCcC.shape, Float32)
    k_blocks = cute.size(tCrA, mode=[2])

    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    for kt in cutlass.range(k_extent // cfg.bk, unroll=1):
        pipe.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(1)  # the previous stage is no longer read: release it
        if kt > 0:
            pipe.consumer_release(release)
            release.advance()
        read.advance()
    cute.nvgpu.warpgroup.wait_group(0)
    pipe.consumer_release(release)

    for i in cutlass.range_constexpr(cute.size(acc)):
        m, n = tCcC[i]
        s_c[(m, n)] = acc[i]
    pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMERS).arrive_and_wait()


def epilogue_thread(ctid):
    """(tile row, half) of a consumer thread in the epilogue: lanes 0-15 of a warp take 16 consecutive rows'
    first halves, lanes 16-31 their second halves, so 8 lanes of one 16-byte shared load read 8 different rows."""
    lane = ctid % 32
    return (ctid // 32) * 16 + lane % 16, lane // 16
