"""Warp-specialised wgmma mainloop (sm_90a) for large token counts: gathered bf16 rows x 4-bit weights decoded once
per K stage into shared memory, bf16 wgmma with fp32 accumulators.

CTA tile: 128 routed rows (A, the wgmma M side: one routing tile of one local expert) x 128 weight rows (B, the N
side) x all of K in stages of 64 (one 128-byte swizzle row of bf16), `stages` deep. Persistent: `ctas` CTAs (one
per SM) loop over the work items (routing tile, column tile); each role carries its ring states from one item to
the next, so the copier and decoder fill the next item's stages while the consumers run this item's epilogue out
of their own s_c. 512 threads, four roles:

  warpgroup 0, copier (setmaxnreg down)
    A: 16-byte cp.async of the rows `a_row_offset(m)` names (the kernel's gather) into the swizzled sA stage,
       then cp.async.mbarrier.arrive.noinc on the stage's `copied` barrier (the arrival lands with the copies).
    B: warp 0 copies the stage's raw weights as one TMA box (128 rows x 32 code bytes) and the 512-byte scale
       atom of the 128x4 layout that holds its blocks as one bulk copy, both completing on the same barrier
       (its one expect_tx arrival). The copier never waits for its own copies and runs up to `stages` ahead.
  warpgroup 1, decoder (setmaxnreg down)
    waits for `copied`, decodes its row of the raw slot (e2m1 -> bf16, times the bf16 block scale: exact, <= 6
    significant bits), st.shared 16-byte chunks into the swizzled sB stage, fence.proxy.async (the wgmma reads
    through the async proxy), mbarrier arrive on the stage's `full` barrier. It issues no copies, so its proxy
    fence has no copies in flight to wait for.
  warpgroups 2-3, consumers (setmaxnreg up)
    wgmma m64n128k16 SS, 64 rows each; acc -> fp32 tile s_c[row][weight col] in shared memory for the epilogue.

The A copies need no proxy fence: CUTLASS's cp.async wgmma mainloops signal them with the same mbarrier arrival.
Measured at T = 4096 on five shapes (benchmarks/results/h200_session10_checks.md, h200_session11_checks.md): the
copier/decoder split ran GEMM1 1.06-1.18x and GEMM2 1.01-1.08x faster than one producer warpgroup; this
persistent, TMA-fed form another 1.06-1.17x (GEMM1) and 1.04-1.23x (GEMM2) over the split's one CTA per tile with
per-thread cp.async weight rows. Two decoder warpgroups did not pay (GEMM1 1.07-1.11x, GEMM2 0.97-1.00x; with
persistence, less than persistence and TMA alone). The ring is 4 stages (214 KB with s_c); 128 registers at
launch, no stack or local memory (sm_90a SASS).
"""
# (no `from __future__ import annotations`: cute.struct reads its annotations as live objects)
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.tensor_utils import LayoutEnum

from . import ptx
from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32
from .stream import weight_box_tma

WARPGROUP = 128
COPIER, DECODER, FIRST_CONSUMER = 0, 1, 2  # warpgroups
CONSUMERS = 256


@dataclass(frozen=True)
class WgmmaConfig:
    bm: int = 128  # routed rows per CTA (= the routing tile)
    bn: int = 128  # weight rows per CTA
    bk: int = 64  # K per stage: 128 bytes of bf16 = one 128B-swizzle row
    stages: int = 4  # sA + sB + raw ring depth (36.5 KB a stage; 6 measured no faster in session 10)
    # Persistent CTAs, work items ctas apart. 132 = the SMs of an H100 SXM / H200 (one 214 KB CTA each); on a GPU
    # with fewer SMs the extra CTAs wait for a free SM.
    ctas: int = 132
    # fp32 padding of an s_c row (pitch 132 = 4 mod 32): the epilogue's 16-byte row reads by 8 consecutive rows
    # cover all 32 banks; the accumulator's 8-byte stores pay a 2-way conflict once per tile.
    pad: int = 4
    # setmaxnreg: 128 * (copier_regs + decoder_regs) + 256 * consumer_regs <= 65536
    copier_regs: int = 40
    decoder_regs: int = 56
    consumer_regs: int = 208
    sf_block: int = 16  # weight scale block: 16 (NVFP4, e4m3 scales) or 32 (MXFP4, ue8m0 scales)

    @property
    def threads(self) -> int:
        return FIRST_CONSUMER * WARPGROUP + CONSUMERS

    @property
    def pitch(self) -> int:
        return self.bn + self.pad

    def check(self) -> None:
        assert self.bm == 128 and self.bn == 128, "the thread mappings assume a 128 x 128 tile"
        assert self.bk == 64, "one stage must be one 4-block group of the 128x4 scale layout"
        assert self.stages >= 3, "the consumers hold up to two stages (wgmma wait_group(1))"
        assert self.sf_block in (16, 32), "NVFP4 (16) or MXFP4 (32) weights"
        regs = WARPGROUP * (self.copier_regs + self.decoder_regs) + CONSUMERS * self.consumer_regs
        assert regs <= 65536, "register file"


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
    @cute.struct
    class Storage:
        copied_mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]  # copied[stages] (+ unused empties)
        mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]  # full[stages], empty[stages]
        # Raw weight slot of each stage as the TMA box lands: [stage][row] 32 code bytes, and the stage's 512-byte
        # scale atom of the 128x4 layout (bulk copy).
        raw_codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cfg.stages * cfg.bn * cfg.bk // 2], 1024]
        raw_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cfg.stages * 512], 16]
        sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
        sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]
        sC: cute.struct.Align[cute.struct.MemRange[Float32, cfg.bm * cfg.pitch], 16]

    return Storage


def allocate(cfg: WgmmaConfig, sA_layout, sB_layout):
    """(sA, sB, s_c, raw code ring address, raw scale ring address, copied, pipeline): the CTA's shared memory and
    its two pipelines; all threads call it. Kernels keep the pieces as separate locals (a runtime branch turns
    the Python ints inside a carried tuple into runtime values). `copied` counts the copier's 128 cp.async
    arrivals and the one expect_tx arrival of the TMA bytes per stage (its empty side is unused: the copier waits
    for the consumers' release of the stage);
    `pipeline`'s full barriers count the 128 decoder threads, its empty ones the 256 consumer threads.
    sA (bm, bk, stages) and sB (bn, bk, stages) carry their swizzle in the pointer; s_c is fp32 (bm, bn) with row
    pitch cfg.pitch, the accumulator tile for the epilogue (its own memory: the ring already holds the next work
    item's stages while the epilogue reads it)."""
    st = cutlass.memory.SmemAllocator().allocate(make_storage(cfg, sA_layout, sB_layout))
    warpgroup = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP)
    # 128 cp.async arrivals (A) + the arrival that announces the TMA bytes (raw weights and scales)
    copied = pipeline.PipelineCpAsync.create(barrier_storage=st.copied_mbar.data_ptr(), num_stages=cfg.stages,
                                             producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                                      WARPGROUP + 1),
                                             consumer_group=warpgroup, defer_sync=True)
    pipe = pipeline.PipelineAsync.create(
        barrier_storage=st.mbar.data_ptr(), num_stages=cfg.stages, producer_group=warpgroup,
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMERS))
    return (st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner),
            st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner),
            st.sC.get_tensor(cute.make_layout((cfg.bm, cfg.bn), stride=(cfg.pitch, 1))),
            st.raw_codes.data_ptr().toint(), st.raw_scales.data_ptr().toint(), copied, pipe)


class WorkItem:
    """Work item w of a persistent CTA: routing tile w % live (consecutive CTAs share a column tile of weights,
    as the grid order of the non-persistent kernels did) and column tile w // live."""

    def __init__(self, cfg: WgmmaConfig, w, live, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor):
        tile = w % live
        self.n_tile = w // live
        self.expert = tile_to_expert[tile]
        self.limit = tile_to_mn_limit[tile]
        self.row0 = tile * cfg.bm


# ----------------------------------------------------------------------------------------------------------------
# Copier (warpgroup 0) and decoder (warpgroup 1); thread t of each handles weight row t
# ----------------------------------------------------------------------------------------------------------------
def a_copy_partition(cfg: WgmmaConfig, sA, tid):
    """Thread t copies 16-byte chunk t % 8 of rows t // 8 + 16 i (i < 8) of each A stage. Returns the cp.async
    atom, the sA partition ((8,1), 8, 1, stages) and the (m, k) coordinate of each chunk."""
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
    g2s = cute.make_tiled_copy_tv(cp_atom, cute.make_layout((WARPGROUP // 8, 8), stride=(8, 1)),
                                  cute.make_layout((1, 8))).get_slice(tid)
    return cp_atom, g2s.partition_D(sA), g2s.partition_D(cute.make_identity_tensor((cfg.bm, cfg.bk)))


def b_store_partition(cfg: WgmmaConfig, sB, row):
    """The decoder thread of weight row `row` owns that row of each B stage, all 8 chunks; a quarter warp storing
    chunk c hits chunks c ^ (row % 8) of 8 rows: conflict-free. Returns the st.shared atom and the sB partition
    ((8,1), 1, 8, stages)."""
    r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    r2s = cute.make_tiled_copy_tv(r2s_atom, cute.make_layout((cfg.bn, 1)), cute.make_layout((1, 8))).get_slice(row)
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
    """Weight row `row`'s view of the raw slots: its 32 code bytes of a stage (the TMA box's row, read as two
    16-byte pieces: 2-way bank conflicts on 2 loads a stage) and its 4-byte scale group in the stage's 512-byte
    atom of the 128x4 layout (row r at (r % 32) * 16 + (r // 32) * 4)."""

    def __init__(self, cfg: WgmmaConfig, codes_base: Int32, scales_base: Int32, row):
        self.slot_bytes = cfg.bn * cfg.bk // 2
        self.codes = codes_base + row * (cfg.bk // 2)
        self.scales = scales_base + (row % 32) * 16 + (row // 32) * 4

    def codes_at(self, stage, piece) -> Int32:
        return self.codes + stage * self.slot_bytes + piece * 16

    def scales_at(self, stage) -> Int32:
        return self.scales + stage * 512


def raw_weight_tma(cfg: WgmmaConfig, w: cute.Tensor, experts, rows_per_expert, k_extent):
    """The launch function's TMA atom and coordinate tensor for the raw weight boxes: one stage of a CTA's weight
    rows, (1 expert, bn rows, bk / 2 bytes)."""
    return weight_box_tma(w, experts, rows_per_expert, k_extent, cfg.bn, cfg.bk // 2)


@cute.jit
def issue_b_stage(cfg: cutlass.Constexpr, copied, fill, tma_atom, boxes, slots, sf_tile: Int64, kt, lane):
    """Warp 0 of the copier starts stage kt's weight copies into slot fill.index: lane 0 announces their bytes on
    the stage's `copied` barrier (its one extra arrival) and bulk-copies the 512-byte scale atom that holds the
    stage's blocks (NVFP4: the 4 blocks of the stage; MXFP4: 2 stages share an atom, decode_b_stage picks the
    half); the box copy elects its own lane, so the whole warp calls it."""
    bar = copied.producer_get_barrier(fill)
    stages_per_group = 4 * cfg.sf_block // cfg.bk
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(bar, cfg.bn * cfg.bk // 2 + 512)
        ptx.cp_async_bulk(slots.scales + fill.index * 512, sf_tile + Int64(kt // stages_per_group) * Int64(512), 512,
                          bar.toint())
    cute.arch.sync_warp()
    cute.copy(tma_atom, boxes[None, kt], slots.codes[None, fill.index], tma_bar_ptr=bar)


class RawSlots(NamedTuple):
    """The shared side of the raw copies: the box slots as the TMA partition's destination, and the scale slots."""

    codes: cute.Tensor
    scales: Int32


def decode_b_stage(cfg: WgmmaConfig, ring: RawRing, r2s_atom, tBsB, stage, kt):
    """Raw slot of K stage kt -> bf16 value * scale (e4m3, or ue8m0: a power of two, exact too) -> this thread's
    row of sB[..., stage], one 16-byte chunk at a time."""
    words = [ptx.ld_shared_v4(ring.codes_at(stage, h)) for h in range(2)]
    scale_word = ptx.ld_shared_b32(ring.scales_at(stage))
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
def copy_stages(cfg: cutlass.Constexpr, pipe, copied, sA, raw_codes: Int32, raw_scales: Int32, tid, a_base: Int64,
                a_row_offset: cutlass.Constexpr, tma_atom, tma_w, w_sf, expert, first_row, rows_per_expert, k_extent,
                fill):
    """The copier over all K stages of one work item, from ring state `fill` (returned advanced). A row m of the
    tile starts `a_row_offset(m)` bytes past `a_base` (bf16, 16-byte aligned rows); the weight rows are
    [first_row, first_row + 128) of `expert` in the 4-bit `w` of `rows_per_expert` rows and K = k_extent, block
    scales `w_sf` (cfg.sf_block). The copier waits for its last copies once, after its last item."""
    cp_atom, tAsA, tAcA = a_copy_partition(cfg, sA, tid)
    a_src = a_sources(tAcA, a_base, a_row_offset)
    ring = cute.make_tensor(cute.make_ptr(cutlass.Uint8, raw_codes, cute.AddressSpace.smem, assumed_align=1024),
                            cute.make_layout((1, cfg.bn, cfg.bk // 2, cfg.stages),
                                             stride=(0, cfg.bk // 2, 1, cfg.bn * cfg.bk // 2)))
    boxes = cute.local_tile(tma_w, (1, cfg.bn, cfg.bk // 2), (expert, first_row // cfg.bn, None))
    slot_part, boxes = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(ring, 0, 3),
                                             cute.group_modes(boxes, 0, 3))
    slots = RawSlots(slot_part, raw_scales)
    sf_tile = w_sf.iterator.toint() + Int64(swizzled_sf_offset(expert, first_row, 0, rows_per_expert,
                                                               k_extent // cfg.sf_block))
    warp = cute.arch.make_warp_uniform(tid // 32)
    for kt in cutlass.range(k_extent // cfg.bk, unroll=1):
        pipe.producer_acquire(fill)  # the consumers are done with the stage (so the decoder is done with its slot)
        if warp == 0:
            issue_b_stage(cfg, copied, fill, tma_atom, boxes, slots, sf_tile, kt, tid % 32)
        issue_a_stage(cfg, cp_atom, tAsA, a_src, kt, fill.index)
        copied.producer_commit(fill)  # cp.async.mbarrier.arrive.noinc: lands with this thread's copies
        fill.advance()
    return fill


def ring_states(cfg: WgmmaConfig):
    """Fresh (producer, consumer) states of a ring, for a role's first work item."""
    return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages))


def drain_copies():
    """The copier's last act: don't exit with copies in flight."""
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)


@cute.jit
def decode_stages(cfg: cutlass.Constexpr, pipe, copied, sB, raw_codes: Int32, raw_scales: Int32, tid, k_extent,
                  landed, publish):
    """The decoder over all K stages of one work item: thread t decodes weight row t of each stage's raw slot into
    sB. Returns the states (landed on `copied`, publish on the pipeline) advanced."""
    r2s_atom, tBsB = b_store_partition(cfg, sB, tid)
    ring = RawRing(cfg, raw_codes, raw_scales, tid)
    for kt in cutlass.range(k_extent // cfg.bk, unroll=1):
        copied.consumer_wait(landed)
        decode_b_stage(cfg, ring, r2s_atom, tBsB, landed.index, kt)
        cute.arch.fence_view_async_shared()  # st.shared (generic proxy) -> wgmma reads (async proxy)
        pipe.producer_commit(publish)
        landed.advance()
        publish.advance()
    return landed, publish


# ----------------------------------------------------------------------------------------------------------------
# Consumers (warpgroups 2 and 3)
# ----------------------------------------------------------------------------------------------------------------
@cute.jit
def consume(cfg: cutlass.Constexpr, pipe, sA, sB, s_c, tiled_mma: cute.TiledMma, wg, ctid, k_extent, read, release):
    """acc (64 rows x 128 weight rows per warpgroup) = sA . sB^T over all K stages of one work item, then staged
    into s_c and synchronised across both consumer warpgroups. Returns the ring states advanced."""
    thr_wg = tiled_mma.get_slice((wg - FIRST_CONSUMER) * WARPGROUP)
    tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))  # smem descriptors (MMA, M, K, stages)
    tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
    tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    acc = cute.make_rmem_tensor(tCcC.shape, Float32)
    k_blocks = cute.size(tCrA, mode=[2])

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
    release.advance()

    consumers = pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMERS)
    consumers.arrive_and_wait()  # every consumer thread is done reading the previous item's s_c
    for i in cutlass.range_constexpr(cute.size(acc)):
        m, n = tCcC[i]
        s_c[(m, n)] = acc[i]
    consumers.arrive_and_wait()
    return read, release


def epilogue_thread(ctid):
    """(tile row, half) of a consumer thread in the epilogue: lanes 0-15 of a warp take 16 consecutive rows'
    first halves, lanes 16-31 their second halves, so 8 lanes of one 16-byte shared load read 8 different rows."""
    lane = ctid % 32
    return (ctid // 32) * 16 + lane % 16, lane // 16


# ----------------------------------------------------------------------------------------------------------------
# The persistent kernel body
# ----------------------------------------------------------------------------------------------------------------
@cute.jit
def run_roles(cfg: cutlass.Constexpr, tidx, cta, live, sA_layout, sB_layout, tiled_mma: cute.TiledMma,
              tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, a_base: Int64,
              a_row_offset: cutlass.Constexpr, tma_atom, tma_w, w_sf, rows_per_expert, k_extent,
              epilogue: cutlass.Constexpr):
    """Every role of a wgmma GEMM over its work items (`live` routing tiles x rows_per_expert / bn column tiles):
    the copier gathers A row m of an item from `a_row_offset(item, m)` bytes past `a_base`, the weights are
    `tma_w` / `w_sf` (K = k_extent), and after each item, with the item's fp32 tile in s_c, each consumer thread
    calls `epilogue(item, s_c, r, half, row)` for its tile row r (routed row `row`, valid) and column half
    (epilogue_thread)."""
    wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
    items = live * (rows_per_expert // cfg.bn)
    sA, sB, s_c, raw_codes, raw_scales, copied, pipe = allocate(cfg, sA_layout, sB_layout)
    if wg == COPIER:
        cute.arch.setmaxregister_decrease(cfg.copier_regs)
        fill, _ = ring_states(cfg)
        for w in cutlass.range(cta, items, cfg.ctas, unroll=1):
            item = WorkItem(cfg, w, live, tile_to_expert, tile_to_mn_limit)
            fill = copy_stages(cfg, pipe, copied, sA, raw_codes, raw_scales, tidx, a_base,
                               lambda m: a_row_offset(item, m), tma_atom, tma_w, w_sf, item.expert,
                               item.n_tile * cfg.bn, rows_per_expert, k_extent, fill)
        drain_copies()
    elif wg == DECODER:
        cute.arch.setmaxregister_decrease(cfg.decoder_regs)
        publish, landed = ring_states(cfg)
        for w in cutlass.range(cta, items, cfg.ctas, unroll=1):
            landed, publish = decode_stages(cfg, pipe, copied, sB, raw_codes, raw_scales, tidx - WARPGROUP,
                                            k_extent, landed, publish)
    else:
        cute.arch.setmaxregister_increase(cfg.consumer_regs)
        ctid = tidx - FIRST_CONSUMER * WARPGROUP
        _, read = ring_states(cfg)
        _, release = ring_states(cfg)
        for w in cutlass.range(cta, items, cfg.ctas, unroll=1):
            item = WorkItem(cfg, w, live, tile_to_expert, tile_to_mn_limit)
            read, release = consume(cfg, pipe, sA, sB, s_c, tiled_mma, wg, ctid, k_extent, read, release)
            r, half = epilogue_thread(ctid)
            row = item.row0 + r
            if row < item.limit:
                epilogue(item, s_c, r, half, row)
