"""Finalize (sm_90a): combine the top-k slot outputs of each token into the layer output (semantics §2.6).

The deterministic finalize (the fused one is GEMM2's reduce-add). CTA (token, part): 256 threads, 8 columns each
(16-byte loads and stores); fp32 sum over ascending k of y_k * r_k, one bf16 rounding.
Slots with no local expert are skipped; a token with none gets zeros.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from . import ptx

THREADS = 256
VEC = 8  # bf16 columns per thread: one 16-byte load per slot


def _unpack_bf16x2(word: Int32):
    return (word << 16).bitcast(Float32), (word & Int32(-65536)).bitcast(Float32)


@cute.kernel
def finalize_kernel(slot_output: cute.Tensor, expanded_to_permuted: cute.Tensor, token_final_scales: cute.Tensor,
                    output: cute.Tensor, hidden: Int32, top_k: Int32):
    tid, _, _ = cute.arch.thread_idx()
    token, part, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    col = (part * THREADS + tid) * VEC
    if col < hidden:
        total = cute.make_rmem_tensor((VEC,), Float32)
        total.fill(0.0)
        for k in cutlass.range(top_k):
            slot = token * top_k + k
            if expanded_to_permuted[slot] >= 0:
                words = ptx.ld_global_v4(slot_output.iterator.toint() + (Int64(slot) * Int64(hidden) + Int64(col)) * 2)
                r = token_final_scales[slot]
                for i in cutlass.range_constexpr(VEC // 2):
                    lo, hi = _unpack_bf16x2(words[i])
                    total[2 * i] = total[2 * i] + lo * r
                    total[2 * i + 1] = total[2 * i + 1] + hi * r
        packed = [ptx.pack_bf16x2(total[2 * i], total[2 * i + 1]) for i in range(VEC // 2)]
        ptx.st_global_v4(output.iterator.toint() + (Int64(token) * Int64(hidden) + Int64(col)) * 2, *packed)
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_finalize(slot_output: cute.Tensor, expanded_to_permuted: cute.Tensor, token_final_scales: cute.Tensor,
                    output: cute.Tensor, hidden: Int32, top_k: Int32, pdl: cutlass.Boolean,
                    stream: cuda.CUstream):
    num_tokens = cute.size(expanded_to_permuted) // top_k
    parts = (hidden + THREADS * VEC - 1) // (THREADS * VEC)
    finalize_kernel(slot_output, expanded_to_permuted, token_final_scales, output, hidden, top_k).launch(
        grid=(num_tokens, parts, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)


def compile_finalize(options: str):
    from .fake_args import vector

    return cute.compile(launch_finalize, vector(BFloat16, 16), vector(Int32), vector(Float32), vector(BFloat16, 16),
                        Int32(128), Int32(1), cutlass.Boolean(True), cuda.CUstream(0),
                        options=options)
