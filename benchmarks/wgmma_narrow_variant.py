"""The wgmma GEMMs with narrow wgmma widths on (wgmma_mainloop.NARROW_WIDTHS: an item whose 64- or 128-token tile
holds <= 32 / <= 64 live rows runs m64n32 / m64n64 wgmmas), built here without a GPU into a folder of their
objects only, exported under the shipped names: an overlay of a complete build for an A/B on the H200.

    python3 benchmarks/wgmma_narrow_variant.py .kernels_narrow
    # there: AB_DIRS=".kernels .kernels+.kernels_narrow" ... bash scripts/gpu_check.sh ab_wgmma (or ab_bench)
"""
import argparse
import os
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_ext.kernels.sm90 import build
    from moe_ext.kernels.sm90 import wgmma_mainloop as mainloop

    mainloop.NARROW_WIDTHS = True
    build._load_dsl_runtime()
    os.makedirs(args.out_dir, exist_ok=True)
    for name, compile_fn in build.specialisations():
        if "_wgmma" in name:
            start = time.perf_counter()
            compile_fn(f"--gpu-arch {build.ARCH}").export_to_c(file_path=args.out_dir, file_name=name,
                                                                function_prefix=name)
            print(f"{name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
