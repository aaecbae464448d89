"""Measurement variants of the one-launch forward (moe_ext/kernels/sm90/decode_fused.py), built here without a GPU
and exported under the shipped kernels' names, so an overlay folder of one swaps it into a complete kernel build.

Phase variants skip one or both GEMM phases' items (routing, zeroing and the grid barrier always run); whole-forward
times of the variants (wrong outputs, right schedule) split a forward into its phases by difference:

    python3 benchmarks/decode_phase_variants.py .kernels_phase        # writes .kernels_phase/<variant>/*.{h,o}
    # on the H200, for each variant v: a copy of a complete build with .kernels_phase/v/* over it, then
    AB_DIRS=".kernels_full .kernels_no_gemm2 .kernels_no_gemm1 .kernels_neither" AB_BENCH_TACTIC=8,-3,-3 \\
        AB_SHAPES=qwen3-30b-a3b,deepseek-v3-ep8,deepseek-v3 AB_TOKENS=1,8 AB_ENERGY_SECONDS=0 \\
        OUT=$OUT bash scripts/gpu_check.sh ab_bench

The unsplit variants (full and without GEMM2's items) give every GEMM1 weight tile one K range, however few tiles
fill the grid: against full / no_gemm2 they say how much of GEMM1's phase is a per-item cost (perf notes, session
55: the scoping of a decode without the grid barrier, whose items would be longer).

The timeline variant is the full kernel, every form (split_gemm2, fc2_by_gemm1), writing each CTA's timeline
(decode_fused.TIMELINE) past the barrier words; benchmarks/decode_timeline.py runs it and reads them:

    python3 benchmarks/decode_phase_variants.py .kernels_phase --variants timeline
"""
import argparse
import contextlib
import os
import sys
import time

# variant -> (decode_fused.compile_decode keyword arguments of each exported form)
VARIANTS = {
    "full": [dict(gemms=(True, True))],
    "no_gemm2": [dict(gemms=(True, False))],
    "no_gemm1": [dict(gemms=(False, True))],
    "neither": [dict(gemms=(False, False))],
    "timeline": [dict(timeline=True, split_gemm2=split, fc2_by_gemm1=fc2) for split in (False, True)
                 for fc2 in (False, True)] + [dict(timeline=True, fc2_by_gemm1=True, deep_ring=True)],
    # traced under TRACE_PATCHES' changes to decode_fused
    "unsplit": [dict(gemms=(True, True))],
    "no_gemm2_unsplit": [dict(gemms=(True, False))],
}
PHASES = "full,no_gemm2,no_gemm1,neither"


@contextlib.contextmanager
def one_gemm1_range(decode_fused):
    """decode_fused.splits at 1 while a kernel traces (the unsplit forms only call it for GEMM1's K ranges)."""
    splits = decode_fused.splits
    decode_fused.splits = lambda ctas, items, steps, min_steps: decode_fused.Int32(1)
    try:
        yield
    finally:
        decode_fused.splits = splits


# variant -> what it changes in decode_fused while its forms trace
TRACE_PATCHES = {"unsplit": one_gemm1_range, "no_gemm2_unsplit": one_gemm1_range}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kinds", default="swiglu", help="activations to build (comma-separated)")
    parser.add_argument("--variants", default=PHASES, help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_ext import launcher
    from moe_ext.kernels.sm90 import build, decode_fused

    build._load_dsl_runtime()
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        folder = os.path.join(args.out_dir, variant)
        os.makedirs(folder, exist_ok=True)
        for kind in args.kinds.split(","):
            for form in VARIANTS[variant]:
                name = launcher.decode_kernel(kind, form.get("split_gemm2", False), form.get("fc2_by_gemm1", False),
                                              form.get("deep_ring", False))
                start = time.perf_counter()
                with TRACE_PATCHES.get(variant, lambda module: contextlib.nullcontext())(decode_fused):
                    compiled = decode_fused.compile_decode(kind, f"--gpu-arch {build.ARCH}", **form)
                compiled.export_to_c(file_path=folder, file_name=name, function_prefix=name)
                print(f"{variant}: {name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
