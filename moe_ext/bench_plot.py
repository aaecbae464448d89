"""Roofline plot of `moe_ext.bench` results: achieved TFLOP/s against arithmetic intensity (FLOPs per byte moved),
under the H200's two ceilings, one colour per implementation and one marker per shape.

    python benchmarks/plot_roofline.py RESULTS.json [MORE.json ...] [--out roofline.png]

matplotlib is an optional dependency (`pip install matplotlib`); without it the plot is refused with that advice.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_ext.bench import IMPLS, PEAK_BF16_FLOPS, PEAK_READ_BYTES_PER_S, SHAPES

MARKERS = "osD^vP*Xph"


class MatplotlibMissing(RuntimeError):
    """The plot needs matplotlib, which is not installed."""


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a GPU node)."""
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing("the roofline plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plottable(records: list[dict]) -> list[dict]:
    """Measured records with both bytes and FLOPs (skips, errors and host-overhead records have no point)."""
    return [r for r in records if r.get("tflops") and r.get("bytes") and r.get("flops")]


def plot_roofline(records: list[dict], out_path: str | Path, title: str | None = None) -> Path:
    """Write the roofline PNG of `records` to out_path and return the path."""
    plt = _pyplot()
    points = plottable(records)
    if not points:
        raise ValueError("no measured records (with bytes, flops and tflops) to plot")
    intensity = [r["flops"] / r["bytes"] for r in points]
    ridge = PEAK_BF16_FLOPS / PEAK_READ_BYTES_PER_S  # FLOP/byte where the two ceilings meet
    x_lo, x_hi = min(min(intensity), ridge) / 4, max(max(intensity), ridge) * 4
    fig, ax = plt.subplots(figsize=(10, 6.5))
    xs = [x_lo, ridge, x_hi]
    ax.plot(xs, [min(x * PEAK_READ_BYTES_PER_S, PEAK_BF16_FLOPS) / 1e12 for x in xs], color="black", lw=1.5,
            label=f"ceiling: {PEAK_READ_BYTES_PER_S / 1e12:.2f} TB/s, {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s")
    impls = [i for i in IMPLS if any(r["impl"] == i for r in points)] + sorted(
        {r["impl"] for r in points} - set(IMPLS))
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in points)] + sorted(
        {r["shape"] for r in points} - set(SHAPES))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    markers = {shape: MARKERS[i % len(MARKERS)] for i, shape in enumerate(shapes)}
    for r, x in zip(points, intensity):
        ax.scatter(x, r["tflops"], color=colors[r["impl"]], marker=markers[r["shape"]], s=36, alpha=0.85)
    for impl in impls:  # legend entries: colour = implementation, marker = shape
        ax.scatter([], [], color=colors[impl], marker="o", label=impl)
    for shape in shapes:
        ax.scatter([], [], color="grey", marker=markers[shape], label=shape)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title or "fused MoE forward: roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Roofline PNG from a moe_ext.bench JSON file")
    parser.add_argument("results", nargs="+", help="JSON lists written by python -m moe_ext.bench (plotted together)")
    parser.add_argument("--out", help="PNG path (default: the first JSON path with .png)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    out = args.out or str(Path(args.results[0]).with_suffix(".png"))
    try:
        records = [r for path in args.results for r in json.loads(Path(path).read_text())]
        print(plot_roofline(records, out, args.title))
    except (MatplotlibMissing, ValueError, OSError) as exc:
        print(f"plot_roofline: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
