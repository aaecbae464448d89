"""Per-token NVFP4 quantization of the FC2 input (sm_90a, w4a4 with per_token_scale; semantics §2.4b).

One CTA per permuted row; padding rows (permuted_to_expanded = -1) are skipped. The row max over the whole
bf16 row gives pts2 = rowamax * fc2_input_scale (stored for GEMM2) and the encode scale enc = 1/pts2; each block
of 16 then gets SF = e4m3(enc * amax/6) and codes e2m1(h / (SF / enc)), and code * SF is written back over h:
both GEMM2s read the FC2 input as bf16, and multiply by pts2 in their epilogue. With `k_permuted` set the rows are
in the wgmma GEMMs' token K order (wgmma_mainloop.stage_position): a thread takes a 64-value group, whose four blocks
it reads, quantizes and writes back in that order.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from . import ptx, quantize
from .wgmma_mainloop import K_GROUP, stage_position, write_k_permuted

THREADS = 128
FLT_MAX = 3.4028234663852886e38


def make_fc2_quant():
    @cute.kernel
    def fc2_quant_kernel(h: cute.Tensor, permuted_to_expanded: cute.Tensor, fc2_input_scale: cute.Tensor,
                         row_scale: cute.Tensor, inter: Int32, k_permuted: Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        partial = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        if permuted_to_expanded[row] >= 0:
            amax = Float32(0.0)
            for col in cutlass.range(tid, inter, THREADS):
                amax = cute.math.max(amax, cute.math.abs(Float32(h[row * inter + col])))
            amax = cute.arch.warp_reduction_max(amax)
            if lane == 0:
                partial[warp] = amax
            cute.arch.sync_threads()
            row_amax = partial[0]
            for w in cutlass.range_constexpr(1, THREADS // 32):
                row_amax = cute.math.max(row_amax, partial[w])
            pts2 = row_amax * fc2_input_scale[0]
            enc = Float32(FLT_MAX)
            if row_amax > Float32(0.0):
                enc = cute.arch.rcp_approx(pts2)
            if tid == 0:
                row_scale[row] = pts2
            if k_permuted != 0:
                for grp in cutlass.range(tid, inter // K_GROUP, THREADS):
                    base = row * inter + grp * K_GROUP
                    values = [Float32(h[base + stage_position(o)]) for o in range(K_GROUP)]
                    words = []
                    for blk in cutlass.range_constexpr(K_GROUP // 16):
                        words += quantize.dequantized_nvfp4_per_token(values[16 * blk:16 * blk + 16], enc)
                    write_k_permuted(h.iterator.toint() + Int64(base) * Int64(2), words, 0)
            else:
                for blk in cutlass.range(tid, inter // 16, THREADS):
                    values = [Float32(h[row * inter + blk * 16 + i]) for i in range(16)]
                    ptx.write_words(h.iterator.toint() + (Int64(row) * Int64(inter) + Int64(blk * 16)) * Int64(2),
                                    quantize.dequantized_nvfp4_per_token(values, enc))
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def launch_fc2_quant(h: cute.Tensor, permuted_to_expanded: cute.Tensor, fc2_input_scale: cute.Tensor,
                         row_scale: cute.Tensor, inter: Int32, k_permuted: Int32, pdl: cutlass.Boolean,
                         stream: cuda.CUstream):
        fc2_quant_kernel(h, permuted_to_expanded, fc2_input_scale, row_scale, inter, k_permuted).launch(
            grid=(cute.size(permuted_to_expanded), 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)

    return launch_fc2_quant


def compile_fc2_quant(options: str):
    from .fake_args import vector

    return cute.compile(make_fc2_quant(), vector(BFloat16, 16), vector(Int32), vector(Float32), vector(Float32),
                        Int32(128), Int32(0), cutlass.Boolean(True), cuda.CUstream(0), options=options)
