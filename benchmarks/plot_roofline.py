"""Roofline PNG from the JSON of benchmarks/bench_moe.py: TFLOP/s against FLOP/byte (both log), the H200 ceilings
(4.15 TB/s, 793 TFLOP/s), colour per implementation, marker per shape. Needs matplotlib.

    python3 benchmarks/plot_roofline.py benchmarks/results/h200.json [MORE.json ...] [--out roofline.png]

The implementation is moe_ext/bench_plot.py (also what `bench_moe.py --plot` calls).
"""
import sys

from moe_ext import bench_plot


def main(argv=None):
    return bench_plot.main(argv)


if __name__ == "__main__":
    sys.exit(main())
