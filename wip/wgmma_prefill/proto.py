# Scratch prototype (compile-only here; no GPU on this box).
# CTA = 1 producer WG (cp.async gather of A + 4-bit decode of B) + 2 consumer WGs (wgmma SS).
import os, sys
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

BM, BK = 128, 64
BN = int(os.environ.get("BN", "256"))
STAGES = int(os.environ.get("STAGES", "4"))
PAD = 4


class Proto:
    def __init__(self):
        pass

    def _setup(self):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16,
            OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32,
            (2, 1, 1),            # 2 consumer warpgroups stacked along M
            tiler_mn=(64, BN),    # = wgmma instruction shape M x N (M must be 64)
        )
        self.tile_mnk = (BM, BN, BK)
        self.sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, cutlass.BFloat16, STAGES)
        self.sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, cutlass.BFloat16, STAGES)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mIdx: cute.Tensor, mBq: cute.Tensor, mLut: cute.Tensor, mC: cute.Tensor):
        self._setup()
        if cutlass.const_expr(os.environ.get("PRINT")):
            print("tiled_mma", self.tiled_mma)
            print("sA_layout", self.sA_layout)
            print("sB_layout", self.sB_layout)

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            lut: cute.struct.MemRange[cutlass.Float32, 16]
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.sB_layout)], 1024]
            if cutlass.const_expr(not os.environ.get("ALIAS")):
                sC: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BM * (BN + PAD)], 16]
        self.storage = Storage
        print("smem bytes", Storage.size_in_bytes(), "need sC", BM * (BN + PAD) * 4)
        grid_n = cute.size(mC, mode=[1]) // BN
        self.kernel(mA, mIdx, mBq, mLut, mC, self.tiled_mma, self.sA_layout, self.sB_layout).launch(
            grid=[grid_n, 1, 1], block=[384, 1, 1], smem=Storage.size_in_bytes())

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIdx: cute.Tensor, mBq: cute.Tensor, mLut: cute.Tensor, mC: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        sA = st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)   # (BM, BK, STAGES)
        sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)   # (BN, BK, STAGES)
        if cutlass.const_expr(os.environ.get("ALIAS")):
            # fp32 epilogue tile aliases the (contiguous) sA+sB stage buffers; no swizzle on the new ptr
            sC = cute.make_tensor(cute.recast_ptr(sA.iterator, None, dtype=cutlass.Float32),
                                  cute.make_layout((BM, BN), stride=(BN + PAD, 1)))
        else:
            sC = st.sC.get_tensor(cute.make_layout((BM, BN), stride=(BN + PAD, 1)))
        sLut = st.lut.get_tensor(cute.make_layout(16))
        if tidx < 16:
            sLut[tidx] = mLut[tidx]

        PipeCls = pipeline.PipelineCpAsync if cutlass.const_expr(os.environ.get("PCA")) else pipeline.PipelineAsync
        ab_pipe = PipeCls.create(
            barrier_storage=st.mbar.data_ptr(),
            num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
        )  # defer_sync=False -> mbarrier_init_fence + CTA sync inside create()

        k_tiles = cute.size(mA, mode=[1]) // BK

        if wg_idx == 0:
            # ---------------- producer warpgroup ----------------
            cute.arch.setmaxregister_decrease(int(os.environ.get("PREG", "40")))
            ptid = tidx
            # 16B chunk assignment: 8 threads per 64-element row, 16 rows per pass
            cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                          cutlass.BFloat16, num_bits_per_copy=128)
            r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
            thr_layout = cute.make_layout((16, 8), stride=(8, 1))
            val_layout = cute.make_layout((1, 8))
            g2s = cute.make_tiled_copy_tv(cp_atom, thr_layout, val_layout)
            r2s = cute.make_tiled_copy_tv(r2s_atom, thr_layout, val_layout)
            thr_g2s = g2s.get_slice(ptid)
            thr_r2s = r2s.get_slice(ptid)
            tAsA = thr_g2s.partition_D(sA)                       # (CPY, CPY_M, CPY_K, STAGES)
            tAcA = thr_g2s.partition_D(cute.make_identity_tensor((BM, BK)))  # (CPY, CPY_M, CPY_K) coords
            tBsB = thr_r2s.partition_D(sB)                       # (CPY, CPY_N, CPY_K, STAGES)
            tBcB = thr_r2s.partition_D(cute.make_identity_tensor((BN, BK)))
            rB = cute.make_rmem_tensor(tBsB[(None, None, None, 0)].shape, cutlass.BFloat16)
            if cutlass.const_expr(os.environ.get("PRINT")):
                print("tAsA", tAsA.layout, "tAcA", tAcA.layout, "tBsB", tBsB.layout, "rB", rB.layout)

            rows = cute.make_rmem_tensor((cute.size(tAsA, mode=[1]),), cutlass.Int32)   # gathered token rows, hoisted
            for i in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
                rows[i] = mIdx[tAcA[(0, i, 0)][0]]
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            pub = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipe.producer_acquire(prod)
                # ---- A: gathered rows via cp.async (16B each) ----
                for i in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
                    m, k = tAcA[(0, i, 0)]
                    gsrc = cute.local_tile(mA[(rows[i], None)], (8,), (kt * (BK // 8) + k // 8,))
                    cute.copy(cp_atom, gsrc, tAsA[(None, i, 0, prod.index)])
                cute.arch.cp_async_commit_group()
                # ---- B: 4-bit codes -> bf16 in registers -> st.shared ----
                for i in cutlass.range_constexpr(cute.size(tBsB, mode=[1])):
                    n, k = tBcB[(0, i, 0)]
                    if cutlass.const_expr(os.environ.get("DECODE") == "int4"):
                        # mBq: Int4 tensor (N, K); 8 consecutive codes = 32 bits
                        g8 = cute.local_tile(mBq[(bidx * BN + n, None)], (8,), (kt * (BK // 8) + k // 8,))
                        r8 = cute.make_rmem_tensor((8,), cutlass.Int4)
                        cute.autovec_copy(g8, r8)
                        if cutlass.const_expr(os.environ.get("FAST")):
                            v = cute.arch.cvt_i4x8_to_bf16x8(r8.load())   # lop3/prmt/fma.bf16x2 path, no arch check
                            rB[(None, i, 0)].store(cute.TensorSSA(v, (8,), cutlass.BFloat16))
                        else:
                            rB[(None, i, 0)].store(r8.load().to(cutlass.BFloat16))
                    else:
                        w = mBq[(bidx * BN + n, kt * (BK // 8) + k // 8)]   # one Uint32 = 8 codes
                        for j in cutlass.range_constexpr(8):
                            code = (w >> cutlass.Uint32(4 * j)) & cutlass.Uint32(0xF)
                            rB[(j, i, 0)] = sLut[cutlass.Int32(code)].to(cutlass.BFloat16)
                        if cutlass.const_expr(os.environ.get("PERCHUNK")):
                            # store each 16B chunk right away: keeps only 4 live regs of decoded data
                            cute.copy(r2s_atom, rB[(None, i, 0)], tBsB[(None, i, 0, prod.index)])
                if cutlass.const_expr(not os.environ.get("PERCHUNK")):
                    cute.copy(r2s, rB, tBsB[(None, None, None, prod.index)])
                if cutlass.const_expr(os.environ.get("LAG")):
                    # keep this stage's cp.async group in flight; publish the previous stage
                    if kt > 0:
                        cute.arch.cp_async_wait_group(1)
                        cute.arch.fence_view_async_shared()
                        ab_pipe.producer_commit(pub)
                        pub.advance()
                elif cutlass.const_expr(os.environ.get("PCA")):
                    # PipelineCpAsync: producer_commit = cp.async.mbarrier.arrive.noinc (fires when this
                    # thread's cp.asyncs land). st.shared of B must be fenced first.
                    cute.arch.fence_view_async_shared()
                    ab_pipe.producer_commit(prod)
                else:
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_view_async_shared()      # generic-proxy writes -> visible to wgmma (async proxy)
                    ab_pipe.producer_commit(prod)
                prod.advance()
            if cutlass.const_expr(os.environ.get("LAG")):
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                ab_pipe.producer_commit(pub)
            ab_pipe.producer_tail(prod)
        else:
            # ---------------- consumer warpgroups ----------------
            cute.arch.setmaxregister_increase(int(os.environ.get("CREG", "232")))
            ctid = tidx - 128
            thr_mma_wg = tiled_mma.get_slice((wg_idx - 1) * 128)   # warpgroup-level slice for A/B descriptors
            tCsA = thr_mma_wg.partition_A(sA)
            tCsB = thr_mma_wg.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)        # (MMA, MMA_M, MMA_K, STAGES) smem descriptors
            tCrB = tiled_mma.make_fragment_B(tCsB)
            thr_mma = tiled_mma.get_slice(ctid)            # per-thread slice for accumulator coords
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            if cutlass.const_expr(os.environ.get("PRINT")):
                print("tCsA", tCsA.layout, "tCrA", tCrA.layout, "tCrB", tCrB.layout, "acc", acc.layout, "tCcC", tCcC.layout)
            num_kb = cute.size(tCrA, mode=[2])

            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipe.consumer_wait(cons)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(num_kb):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, cons.index)], tCrB[(None, None, kb, cons.index)], acc)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)    # the previous k-tile's wgmmas are done -> release its stage
                if kt > 0:
                    ab_pipe.consumer_release(rel)
                    rel.advance()
                cons.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(rel)
            if cutlass.const_expr(os.environ.get("ALIAS")):
                cute.arch.barrier(barrier_id=2, number_of_threads=256)   # both consumer WGs finished reading sA/sB
            # ---- epilogue: acc -> fp32 smem [BM][BN+PAD] via identity-tensor coords ----
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                sC[(m, n)] = acc[i]
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            for i in cutlass.range(ctid, BM * BN, 256):
                m = i // BN
                n = i % BN
                mC[(m, bidx * BN + n)] = sC[(m, n)]


if __name__ == "__main__":
    T, K, N = 1024, 512, 2 * BN
    a = make_fake_compact_tensor(cutlass.BFloat16, (T, K), stride_order=(1, 0), assumed_align=16)
    idx = make_fake_compact_tensor(cutlass.Int32, (BM,))
    bq = (make_fake_compact_tensor(cutlass.Int4, (N, K), stride_order=(1, 0), assumed_align=16)
          if os.environ.get("DECODE") == "int4" else
          make_fake_compact_tensor(cutlass.Uint32, (N, K // 8), stride_order=(1, 0), assumed_align=16))
    lut = make_fake_compact_tensor(cutlass.Float32, (16,))
    c = make_fake_compact_tensor(cutlass.Float32, (BM, N), stride_order=(1, 0), assumed_align=16)
    p = Proto()
    opts = os.environ.get("OPTS", "")
    f = cute.compile(p, a, idx, bq, lut, c, options=opts) if opts else cute.compile(p, a, idx, bq, lut, c)
    print("COMPILED OK")
