"""Summarise an `ncu --page source --csv --print-source sass` export (gpu_check.sh part ncu_source): warp-stall
samples by reason over the whole kernel, then the instructions with the most samples and their main reasons.

    python3 benchmarks/ncu_stalls.py REPORT.sass.csv [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import csv


def load(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    return rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    header, rows = load(args.csv)
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    col = {h: i for i, h in enumerate(header)}
    number = lambda row, h: float(row[col[h]] or 0)  # noqa: E731
    totals = collections.Counter({r: sum(number(row, r) for row in rows) for r in reasons})
    samples = sum(totals.values())
    print(f"{len(rows)} instructions, {samples:.0f} stall samples")
    for reason, n in totals.most_common(12):
        print(f"  {reason:24s} {n / samples:6.1%}")
    print(f"top {args.top} instructions by samples:")
    ranked = sorted(rows, key=lambda row: -sum(number(row, r) for r in reasons))
    for row in ranked[:args.top]:
        mine = collections.Counter({r: number(row, r) for r in reasons})
        total = sum(mine.values())
        main_reasons = ", ".join(f"{r[6:]} {n / total:.0%}" for r, n in mine.most_common(3) if n)
        print(f"  {total / samples:5.1%}  {row[col['Source']].strip()[:60]:60s} {main_reasons}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
