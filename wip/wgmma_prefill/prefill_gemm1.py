"""Prefill GEMM1 prototype (sm_90a, w4a16): gathered bf16 token rows x NVFP4 weights decoded to bf16, wgmma SS.

Scratch, not part of the package. Compile-only on the build machine; the GPU test is gpu_test_prefill_gemm1.py.

CTA = routing tile `tile` (128 permuted rows, one local expert) x weight rows [128 n_tile, 128 n_tile + 128) x all
of K (= H) in stages of 64; grid (max_tiles, N1 / 128); CTAs with tile >= num_live_tiles[0] exit at once.
Output (for now): out[row, 128 n_tile + c] = w1_alpha[expert] * acc[row, c] in fp32, valid rows only.
Shapes: H % 64 == 0 (the launcher already requires H % 128 == 0), N1 % 128 == 0, max_tiles * 128 == len(maps).

Warp roles (384 threads):
  WG0  producer   A: 16-byte cp.async gather of x rows (token = permuted_to_expanded[row] // top_k) into the
                     128B-swizzled sA stage.
                  B: cp.async of this thread's raw weight bytes (32 B of e2m1 codes + 4 B of e4m3 scales of one
                     weight row) into a small private ring, `lag` stages ahead; then decode to bf16 (value * scale,
                     exact) and st.shared 16-byte chunks into the swizzled sB stage.
                  Then cp.async.wait_group + fence.proxy.async.shared::cta + mbarrier arrive (PipelineAsync).
  WG1, WG2        wgmma m64n128k16 (bf16 x bf16 -> fp32), 64 token rows each; then acc -> fp32 smem tile
                  s_c[token_row][weight_col] (the orientation of stream.Smem.out) -> alpha -> global.

Pipelining of the producer (lag L = cfg.lag): iteration j acquires stage j and issues its copies (A(j) straight
into sA, the raw B(j) bytes into ring slot j % (L + 1)) as cp.async group j, then waits for group j - L, decodes
B(j - L) and publishes stage j - L. So L + 1 stages of copies are in flight while one is decoded, and nothing is
held in registers across iterations. Deadlock-free needs stages >= L + 2: the consumers hold up to two stages
(wgmma wait_group(1) keeps the previous stage in use).

Numerics: e2m1 codes become bf16 bit patterns of value * 2^-126 (ptx.e2m1x8_to_bf16x2), one bf16x2 multiply by
2^126 makes them the exact e2m1 values, a second by the bf16 block scale the exact value * scale (<= 6 significant
bits, range 2^-10..2688, so bf16 holds it exactly); wgmma accumulates in fp32.
"""
# (no `from __future__ import annotations`: cute.struct reads its annotations as live objects)

import os
import sys
from dataclasses import dataclass

_REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)  # this checkout's moe_ext, not an installed one
if __name__ == "__main__":  # --keep-ptx/--keep-cubin files go here; the DSL reads the variable at import
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "build"))

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import BFloat16, Float32, Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from moe_ext.kernels.sm90 import ptx  # noqa: E402
from moe_ext.kernels.sm90.fp4 import e4m3_to_f32, swizzled_sf_offset  # noqa: E402

BF16X2_ONE_P126 = 0x7E807E80  # bf16 2^126 in both halves (undoes the 2^-126 of the e2m1 bit pattern)
PRODUCERS = 128  # threads of the producer warpgroup


@dataclass(frozen=True)
class PrefillConfig:
    bm: int = 128  # token rows per CTA (= the routing tile)
    bn: int = 128  # weight rows per CTA
    bk: int = 64  # K per stage: 128 bytes of bf16 = one 128B-swizzle row
    stages: int = 4  # sA + sB ring depth (32 KB a stage)
    lag: int = 2  # producer: stages of copies in flight ahead of the one being decoded (stages >= lag + 2)
    pad: int = 8  # fp32 padding of an s_c row: 136 floats, conflict-free v2 stores from the accumulators
    producer_regs: int = 56  # setmaxnreg: 128 * 56 + 256 * 224 = 64512 <= 65536
    consumer_regs: int = 224

    @property
    def threads(self) -> int:
        return 384

    @property
    def raw_code_bytes(self) -> int:  # packed e2m1 bytes of one weight row in one stage
        return self.bk // 2

    @property
    def scale_blocks(self) -> int:  # e4m3 scales of one weight row in one stage (one 4-byte group of the 128x4 layout)
        return self.bk // 16

    def check(self) -> None:
        assert self.bm == 128 and self.bn == 128, "the thread mappings below assume a 128 x 128 tile"
        assert self.bk == 64 and self.scale_blocks == 4, "one stage must be one 4-block scale group"
        assert self.stages >= self.lag + 2, "producer lag + the consumers' two held stages must fit the ring"


DEFAULT = PrefillConfig()


# --------------------------------------------------------------------------------------------------------------
# Shared memory
# --------------------------------------------------------------------------------------------------------------
def smem_layouts(cfg: PrefillConfig):
    """128B-swizzled K-major stage layouts of A (bm x bk) and B (bn x bk), `stages` deep; call inside a jit."""
    tile = (cfg.bm, cfg.bn, cfg.bk)
    a = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, BFloat16, cfg.stages)
    b = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, BFloat16, cfg.stages)
    return a, b


def make_storage(cfg: PrefillConfig, sA_layout, sB_layout):
    raw_ring = cfg.lag + 1

    @cute.struct
    class Storage:
        mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]  # full[stages], empty[stages]
        # Producer-private ring of raw weight bytes: [slot][half][thread] 16 B (halves apart: conflict-free
        # 16-byte loads) and [slot][thread] 4 scale bytes.
        raw_codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_ring * 2 * PRODUCERS * 16], 16]
        raw_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_ring * PRODUCERS * 4], 16]
        sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
        sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]
        sC: cute.struct.Align[cute.struct.MemRange[Float32, cfg.bm * (cfg.bn + cfg.pad)], 16]

    return Storage


# --------------------------------------------------------------------------------------------------------------
# Producer helpers (warpgroup 0, 128 threads)
# --------------------------------------------------------------------------------------------------------------
def a_copy_partition(cfg: PrefillConfig, sA, ptid):
    """16-byte chunks of the A stage per producer thread: 8 threads per 64-element row, 16 rows per pass, so
    thread p copies chunk p % 8 of rows p // 8 + 16 i (i < 8). Returns (cp.async atom, sA partition
    ((8,1), 8, 1, stages), coordinates (m, k) of each chunk)."""
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
    thr = cute.make_layout((16, 8), stride=(8, 1))
    val = cute.make_layout((1, 8))
    g2s = cute.make_tiled_copy_tv(cp_atom, thr, val).get_slice(ptid)
    return cp_atom, g2s.partition_D(sA), g2s.partition_D(cute.make_identity_tensor((cfg.bm, cfg.bk)))


def b_store_partition(cfg: PrefillConfig, sB, ptid):
    """16-byte chunks of the B stage per producer thread: thread p owns weight row p, all 8 chunks. A quarter
    warp (8 consecutive rows) storing chunk c hits chunks c ^ (row % 8) of 8 rows: conflict-free.
    Returns (st.shared atom, sB partition ((8,1), 1, 8, stages))."""
    r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    thr = cute.make_layout((cfg.bn, 1))
    val = cute.make_layout((1, 8))
    r2s = cute.make_tiled_copy_tv(r2s_atom, thr, val).get_slice(ptid)
    return r2s_atom, r2s.partition_D(sB)


def gathered_row_offsets(cfg, tAcA, permuted_to_expanded, row0, limit, top_k, hidden) -> cute.Tensor:
    """Byte offset in x of each A chunk this thread copies, at K = 0 (64-bit: T * H can pass 2^31).
    Rows at or past the tile's limit read row limit - 1 (a valid token): each output row depends only on its
    own A row, and the epilogue drops them."""
    offsets = cute.make_rmem_tensor((cute.size(tAcA, mode=[1]),), Int64)
    for i in range(cute.size(tAcA, mode=[1])):
        m, k = tAcA[(0, i, 0)]
        row = cute.math.min(row0 + m, limit - 1)
        token = permuted_to_expanded[row] // top_k
        offsets[i] = (Int64(token) * Int64(hidden) + Int64(k)) * Int64(2)
    return offsets


def issue_a_stage(cfg, cp_atom, tAsA, x_addr: Int64, a_offsets: cute.Tensor, kt, stage):
    """cp.async 16 B of each of this thread's A chunks of K stage kt into sA[..., stage]."""
    k_bytes = Int64(kt) * Int64(cfg.bk * 2)
    for i in range(cute.size(tAsA, mode=[1])):
        src = cute.make_tensor(cute.make_ptr(BFloat16, x_addr + a_offsets[i] + k_bytes, cute.AddressSpace.gmem,
                                             assumed_align=16), cute.make_layout(((8, 1),)))
        cute.copy(cp_atom, src, tAsA[(None, i, 0, stage)])


class RawRing:
    """Shared addresses of this thread's slots in the raw weight ring (no swizzle: private, read back by the
    thread that wrote it, so it needs no barrier)."""

    def __init__(self, codes_base: Int32, scales_base: Int32, ptid):
        self.codes = codes_base + ptid * 16
        self.scales = scales_base + ptid * 4

    def codes_at(self, slot, half) -> Int32:
        return self.codes + (slot * 2 + half) * (PRODUCERS * 16)

    def scales_at(self, slot) -> Int32:
        return self.scales + slot * (PRODUCERS * 4)


def issue_b_stage(cfg, ring: RawRing, w_row: Int64, sf_row: Int64, kt, slot):
    """cp.async this thread's weight row for K stage kt: 32 code bytes (two 16-byte halves) and the 4 scale bytes
    (scale blocks 4 kt .. 4 kt + 3 are one contiguous group of the 128x4 layout; the next group is 512 B on)."""
    src = w_row + Int64(kt) * Int64(cfg.raw_code_bytes)
    ptx.cp_async_16(ring.codes_at(slot, 0), src)
    ptx.cp_async_16(ring.codes_at(slot, 1), src + Int64(16))
    ptx.cp_async_4(ring.scales_at(slot), sf_row + Int64(kt) * Int64(512))


def e2m1x8_to_bf16x8(word: Int32, scale2: Int32) -> list:
    """8 e2m1 codes (element j in bits 4j..4j+3, i.e. two codes per byte with the even element low) -> 4 bf16x2
    registers in natural order (x0 x1)(x2 x3)(x4 x5)(x6 x7), each value * scale exactly."""
    p = ptx.e2m1x8_to_bf16x2(word, Int32(BF16X2_ONE_P126))  # (x0 x4)(x1 x5)(x2 x6)(x3 x7), exact e2m1 values
    natural = [ptx.prmt(p[0], p[1], 0x5410), ptx.prmt(p[2], p[3], 0x5410),
               ptx.prmt(p[0], p[1], 0x7632), ptx.prmt(p[2], p[3], 0x7632)]
    return [ptx.mul_bf16x2(v, scale2) for v in natural]


def decode_b_stage(cfg, ring: RawRing, r2s_atom, tBsB, slot, stage):
    """Raw ring slot -> bf16 (value * scale) -> this thread's weight row of sB[..., stage], one 16-byte chunk at a
    time (only 4 decoded registers live at once)."""
    words = [ptx.ld_shared_v4(ring.codes_at(slot, h)) for h in range(2)]
    scale_word = ptx.ld_shared_b32(ring.scales_at(slot))
    chunk = cute.make_rmem_tensor(tBsB[(None, 0, 0, 0)].shape, BFloat16)  # 8 bf16 = one 16-byte chunk
    chunk_words = cute.recast_tensor(chunk, Int32)
    for blk in range(cfg.scale_blocks):  # 16 K values = 2 chunks per scale
        s = e4m3_to_f32((scale_word >> (8 * blk)) & 0xFF)
        s2 = ptx.pack_bf16x2(s, s)
        for half in range(2):
            c = 2 * blk + half  # chunk index = K / 8 inside the stage
            values = e2m1x8_to_bf16x8(words[c // 4][c % 4], s2)
            for j in range(4):
                chunk_words[j] = values[j]
            cute.copy(r2s_atom, chunk, tBsB[(None, 0, c, stage)])


# --------------------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------------------
def make_kernel(cfg: PrefillConfig = DEFAULT):
    cfg.check()

    @cute.kernel
    def prefill_gemm1_kernel(x_bf16: cute.Tensor, w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
                             permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor,
                             tile_to_mn_limit: cute.Tensor, num_live_tiles: cute.Tensor, out: cute.Tensor,
                             hidden: Int32, n1: Int32, top_k: Int32, tiled_mma: cute.TiledMma,
                             sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        tile, n_tile, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        cute.arch.griddepcontrol_wait()
        if tile < num_live_tiles[0]:
            expert = tile_to_expert[tile]
            limit = tile_to_mn_limit[tile]
            row0 = tile * cfg.bm
            k_tiles = hidden // cfg.bk

            st = cutlass.memory.SmemAllocator().allocate(make_storage(cfg, sA_layout, sB_layout))
            sA = st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)  # (bm, bk, stages), swizzle in ptr
            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)  # (bn, bk, stages)
            s_c = st.sC.get_tensor(cute.make_layout((cfg.bm, cfg.bn), stride=(cfg.bn + cfg.pad, 1)))

            # Full barriers: 128 producer arrivals (each thread after its own wait_group + proxy fence); empty
            # barriers: 256 consumer arrivals. create() inits, fences the init and syncs all 384 threads.
            pipe = pipeline.PipelineAsync.create(
                barrier_storage=st.mbar.data_ptr(), num_stages=cfg.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256))

            if wg == 0:
                cute.arch.setmaxregister_decrease(cfg.producer_regs)
                produce(cfg, pipe, sA, sB, st.raw_codes.data_ptr().toint(), st.raw_scales.data_ptr().toint(),
                        tidx, x_bf16, w1, w1_sf, permuted_to_expanded, expert, n_tile, row0, limit, top_k, hidden,
                        n1, k_tiles)
            else:
                cute.arch.setmaxregister_increase(cfg.consumer_regs)
                ctid = tidx - 128
                acc = consume(cfg, pipe, tiled_mma, sA, sB, wg, ctid, k_tiles)
                store_tile(cfg, tiled_mma, acc, s_c, ctid, out, w1_alpha[expert], row0, limit, n_tile, n1)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch(x_bf16: cute.Tensor, w1: cute.Tensor, w1_sf: cute.Tensor, w1_alpha: cute.Tensor,
               permuted_to_expanded: cute.Tensor, tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor,
               num_live_tiles: cute.Tensor, out: cute.Tensor, hidden: Int32, n1: Int32, top_k: Int32,
               stream: cuda.CUstream):
        # MMA and smem layouts build IR, so they are made here (inside the jit), not at module level.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (2, 1, 1),  # two consumer warpgroups stacked along M (token rows)
            tiler_mn=(64, cfg.bn))  # the wgmma instruction: m64 n128 k16
        sA_layout, sB_layout = smem_layouts(cfg)
        storage = make_storage(cfg, sA_layout, sB_layout)
        if cutlass.const_expr(os.environ.get("PREFILL_PRINT")):
            print("prefill_gemm1: smem bytes", storage.size_in_bytes())
            print("  tiled_mma", tiled_mma)
            print("  sA", sA_layout, "\n  sB", sB_layout)
        prefill_gemm1_kernel(x_bf16, w1, w1_sf, w1_alpha, permuted_to_expanded, tile_to_expert, tile_to_mn_limit,
                             num_live_tiles, out, hidden, n1, top_k, tiled_mma, sA_layout, sB_layout).launch(
            grid=(cute.size(tile_to_expert), n1 // cfg.bn, 1), block=(cfg.threads, 1, 1),
            smem=storage.size_in_bytes(), stream=stream)

    return launch


@cute.jit
def produce(cfg: cutlass.Constexpr, pipe, sA, sB, raw_codes: Int32, raw_scales: Int32, ptid, x_bf16, w1, w1_sf,
            permuted_to_expanded, expert, n_tile, row0, limit, top_k, hidden, n1, k_tiles):
    """Warpgroup 0: fill stage j (A gather + raw B copies), then decode and publish stage j - lag."""
    cp_atom, tAsA, tAcA = a_copy_partition(cfg, sA, ptid)
    r2s_atom, tBsB = b_store_partition(cfg, sB, ptid)
    a_offsets = gathered_row_offsets(cfg, tAcA, permuted_to_expanded, row0, limit, top_k, hidden)
    x_addr = x_bf16.iterator.toint()
    if cutlass.const_expr(os.environ.get("PREFILL_PRINT")):
        print("  producer: tAsA", tAsA.layout, "tAcA", tAcA.layout, "tBsB", tBsB.layout)

    # This thread's weight row (row n = ptid of the CTA's 128) and its scale group at K = 0.
    w_row_index = n_tile * cfg.bn + ptid
    w_row = w1.iterator.toint() + (Int64(expert) * Int64(n1) + Int64(w_row_index)) * Int64(hidden // 2)
    sf_row = w1_sf.iterator.toint() + Int64(swizzled_sf_offset(expert, w_row_index, 0, n1, hidden // 16))
    ring = RawRing(raw_codes, raw_scales, ptid)

    fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
    publish = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
    for j in cutlass.range(k_tiles + cfg.lag, unroll=1):
        if j < k_tiles:
            pipe.producer_acquire(fill)  # the consumers have released this stage
            issue_a_stage(cfg, cp_atom, tAsA, x_addr, a_offsets, j, fill.index)
            issue_b_stage(cfg, ring, w_row, sf_row, j, j % (cfg.lag + 1))
            fill.advance()
        # One group per iteration, empty ones included, so "group j - lag done" is always wait_group(lag).
        cute.arch.cp_async_commit_group()
        if j >= cfg.lag:
            d = j - cfg.lag
            cute.arch.cp_async_wait_group(cfg.lag)  # this thread's A(d) chunks and raw B(d) have landed
            decode_b_stage(cfg, ring, r2s_atom, tBsB, d % (cfg.lag + 1), publish.index)
            # cp.async and st.shared write through the generic proxy; wgmma reads through the async proxy.
            cute.arch.fence_view_async_shared()
            pipe.producer_commit(publish)  # one of the 128 arrivals the full barrier counts
            publish.advance()
    pipe.producer_tail(fill)  # don't exit with consumer releases still in flight


@cute.jit
def consume(cfg: cutlass.Constexpr, pipe, tiled_mma: cute.TiledMma, sA, sB, wg, ctid, k_tiles):
    """Warpgroups 1-2: acc (64 token rows x 128 weight rows per warpgroup) += sA . sB^T over all K stages."""
    thr_wg = tiled_mma.get_slice((wg - 1) * 128)  # warpgroup slice: the smem descriptors of A and B
    tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))  # (MMA, MMA_M, MMA_K, stages) descriptors
    tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
    tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    acc = cute.make_rmem_tensor(tCcC.shape, Float32)  # ((2,2,16),1,1): 64 fp32 per thread
    k_blocks = cute.size(tCrA, mode=[2])  # 4 wgmma k16 per stage

    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)  # first wgmma of the tile overwrites acc
    for kt in cutlass.range(k_tiles, unroll=1):
        pipe.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        # At most this stage's wgmmas still run: the previous stage's smem is no longer read -> release it.
        cute.nvgpu.warpgroup.wait_group(1)
        if kt > 0:
            pipe.consumer_release(release)
            release.advance()
        read.advance()
    cute.nvgpu.warpgroup.wait_group(0)
    pipe.consumer_release(release)
    return acc


@cute.jit
def store_tile(cfg: cutlass.Constexpr, tiled_mma: cute.TiledMma, acc, s_c, ctid, out, alpha, row0, limit, n_tile,
               n1):
    """acc -> s_c[token_row, weight_col] (fp32, pitch bn + pad) -> alpha * s_c to out[row, 128 n_tile + col] for
    rows below the tile's limit (one warp per 512-byte output row segment, 16-byte stores)."""
    tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    for i in cutlass.range_constexpr(cute.size(acc)):
        m, n = tCcC[i]
        s_c[(m, n)] = acc[i]
    pipeline.NamedBarrier(barrier_id=1, num_threads=256).arrive_and_wait()  # the two consumer warpgroups

    vectors_per_row = cfg.bn // 4
    s_c_addr = s_c.iterator.toint()
    out_addr = out.iterator.toint()
    for i in cutlass.range_constexpr(cfg.bm * vectors_per_row // 256):
        index = ctid + 256 * i
        r = index // vectors_per_row
        v = index % vectors_per_row
        row = row0 + r
        if row < limit:
            words = ptx.ld_shared_v4(s_c_addr + (r * (cfg.bn + cfg.pad) + v * 4) * 4)
            scaled = [(w.bitcast(Float32) * alpha).bitcast(Int32) for w in words]
            col = n_tile * cfg.bn + v * 4
            ptx.st_global_v4(out_addr + (Int64(row) * Int64(n1) + Int64(col)) * Int64(4), *scaled)


# --------------------------------------------------------------------------------------------------------------
# Compile (fake tensors, no GPU)
# --------------------------------------------------------------------------------------------------------------
def compile_prefill_gemm1(options: str, cfg: PrefillConfig = DEFAULT, tvm_ffi: bool = False):
    """Compile for the flat-tensor signature
        (x bf16 [T*H], w1 u8 [E*N1*H/2], w1_sf u8 (128x4 swizzled), w1_alpha f32 [E], permuted_to_expanded i32,
         tile_to_expert i32 [max_tiles], tile_to_mn_limit i32, num_live_tiles i32 [1], out f32 [rows*N1],
         hidden, n1, top_k, stream).
    tvm_ffi: call the result with torch tensors and the current torch stream (the path that ran on the H200)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    u8 = cutlass.Uint8
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else cuda.CUstream(0)
    if tvm_ffi:
        options = f"{options} --enable-tvm-ffi"
    return cute.compile(make_kernel(cfg), vector(BFloat16, 16), vector(u8, 16), vector(u8, 4), vector(Float32),
                        vector(Int32), vector(Int32), vector(Int32), vector(Int32), vector(Float32, 16),
                        Int32(1024), Int32(256), Int32(1), stream, options=options)


def _ptxas_report(ptx_path: str) -> str:
    """Registers and spills from the local ptxas (CUDA 13.0 takes PTX ISA up to 9.0; the DSL writes 9.4, which
    this kernel does not need, so the .version line is rewritten on a copy)."""
    import glob
    import re
    import subprocess
    import tempfile

    candidates = sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))
    if not candidates:
        return "no local ptxas"
    text = open(ptx_path).read()
    text = re.sub(r"^\.version \d+\.\d+", ".version 9.0", text, count=1, flags=re.M)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(text)
    result = subprocess.run([candidates[-1], "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                            capture_output=True, text=True)
    return (result.stdout + result.stderr).strip()


def main() -> None:
    import argparse
    import dataclasses
    import glob
    import time

    from moe_ext.kernels.sm90 import build

    parser = argparse.ArgumentParser(description="compile the prefill GEMM1 prototype for sm_90a (no GPU needed)")
    for field in dataclasses.fields(PrefillConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--tvm-ffi", action="store_true", help="compile the TVM-FFI flavour the GPU test uses")
    args = parser.parse_args()
    cfg = PrefillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PrefillConfig)})
    print(cfg)

    os.environ.setdefault("CUTE_DSL_ARCH", build.ARCH)
    build._load_dsl_runtime()
    dump = os.environ["CUTE_DSL_DUMP_DIR"]
    os.makedirs(dump, exist_ok=True)
    os.environ["PREFILL_PRINT"] = "1"
    for old in glob.glob(os.path.join(dump, "*.ptx")) + glob.glob(os.path.join(dump, "*.cubin")):
        os.remove(old)
    start = time.perf_counter()
    compile_prefill_gemm1(f"--gpu-arch {build.ARCH} --keep-ptx --keep-cubin", cfg, tvm_ffi=args.tvm_ffi)
    print(f"compiled for {build.ARCH} in {time.perf_counter() - start:.1f} s")
    ptx_files = sorted(glob.glob(os.path.join(dump, "*.ptx")), key=os.path.getmtime)
    if ptx_files:
        print("ptx:", ptx_files[-1])
        print(_ptxas_report(ptx_files[-1]))


if __name__ == "__main__":
    main()
