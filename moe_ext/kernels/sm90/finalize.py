"""Finalize (sm_90a): combine the top-k slot outputs of each token into the layer output (semantics §2.6).

One CTA per token. Fused mode: bf16 running sum of the bf16 contributions (router weight already applied by
GEMM2), in ascending slot order. Deterministic mode: fp32 sum over ascending k of y_k * r_k, one bf16 rounding.
Slots with no local expert are skipped; a token with none gets zeros.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

THREADS = 256


@cute.kernel
def finalize_kernel(slot_output: cute.Tensor, expanded_to_permuted: cute.Tensor, token_final_scales: cute.Tensor,
                    output: cute.Tensor, hidden: Int32, top_k: Int32, fused: cutlass.Boolean):
    tid, _, _ = cute.arch.thread_idx()
    token, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    for col in cutlass.range(tid, hidden, THREADS):
        total = Float32(0.0)
        for k in cutlass.range(top_k):
            slot = token * top_k + k
            if expanded_to_permuted[slot] >= 0:
                y = Float32(slot_output[slot * hidden + col])
                if fused:
                    total = Float32((total + y).to(BFloat16))
                else:
                    total = total + y * token_final_scales[slot]
        output[token * hidden + col] = total.to(BFloat16)
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def launch_finalize(slot_output: cute.Tensor, expanded_to_permuted: cute.Tensor, token_final_scales: cute.Tensor,
                    output: cute.Tensor, hidden: Int32, top_k: Int32, fused: cutlass.Boolean, pdl: cutlass.Boolean,
                    stream: cuda.CUstream):
    num_tokens = cute.size(expanded_to_permuted) // top_k
    finalize_kernel(slot_output, expanded_to_permuted, token_final_scales, output, hidden, top_k, fused).launch(
        grid=(num_tokens, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)


def compile_finalize(options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    return cute.compile(launch_finalize, vector(BFloat16, 16), vector(Int32), vector(Float32), vector(BFloat16, 16),
                        Int32(128), Int32(1), cutlass.Boolean(True), cutlass.Boolean(True), cuda.CUstream(0),
                        options=options)
