"""Fused-MoE performance benchmark: moe_ext against the bf16 torch._grouped_mm composite and triton_kernels, per
shape, T, quant mode and finalize, timed by CUDA-graph replay; JSON records plus a readable table.

    python3 benchmarks/bench_moe.py [--shapes ...] [--tokens ...] [--modes ...] [--out FILE.json] [--plot FILE.png]

The implementation is moe_ext/bench.py (`python3 -m moe_ext.bench` is the same benchmark); `--help` lists every
flag and the module docstring explains the method.
"""
import sys

from moe_ext import bench


def main(argv=None):
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
