"""Summarise an `ncu --page source --csv --print-source sass` export (gpu_check.sh part ncu_source): warp-stall
samples by reason over the whole kernel, then the instructions with the most samples and their main reasons;
`--opcodes`: executed instructions and samples per opcode (what the decode, the MMAs and the loads cost);
`--regions`: the same per execution count, which separates code by how often it runs (per K step, per token
chunk, per CTA). A gzipped export is read as is.

    python3 benchmarks/ncu_stalls.py REPORT.sass.csv[.gz] [--top 30] [--opcodes] [--regions]
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def load(path: str) -> tuple[list[str], list[list[str]]]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    return rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--opcodes", action="store_true", help="executed instructions and samples per opcode")
    parser.add_argument("--regions", action="store_true", help="... per execution count (code run equally often)")
    args = parser.parse_args(argv)
    header, rows = load(args.csv)
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    col = {h: i for i, h in enumerate(header)}
    number = lambda row, h: float(row[col[h]] or 0)  # noqa: E731
    stalled = lambda row: sum(number(row, r) for r in reasons)  # noqa: E731
    totals = collections.Counter({r: sum(number(row, r) for row in rows) for r in reasons})
    samples = sum(totals.values())
    print(f"{len(rows)} instructions, {samples:.0f} stall samples")
    for reason, n in totals.most_common(12):
        print(f"  {reason:24s} {n / samples:6.1%}")
    print(f"top {args.top} instructions by samples:")
    ranked = sorted(rows, key=lambda row: -stalled(row))
    for row in ranked[:args.top]:
        mine = collections.Counter({r: number(row, r) for r in reasons})
        total = sum(mine.values())
        main_reasons = ", ".join(f"{r[6:]} {n / total:.0%}" for r, n in mine.most_common(3) if n)
        print(f"  {total / samples:5.1%}  {row[col['Source']].strip()[:60]:60s} {main_reasons}")
    executed = lambda row: int(row[col["Instructions Executed"]] or 0)  # noqa: E731
    by_opcode = lambda row: opcode(row[col["Source"]])  # noqa: E731
    for flag, title, key in ((args.opcodes, "opcode", by_opcode), (args.regions, "executions", executed)):
        if flag:
            print_shares(title, rows, key, executed, stalled, samples)
    return 0


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: `@P2 IMAD.HI.U32 R1, ...` -> IMAD."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def print_shares(title: str, rows: list, key, executed, stalled, samples: float, top: int = 20) -> None:
    """Executed instructions and stall samples of the rows grouped by key(row), largest sample share first."""
    counts, stalls = collections.Counter(), collections.Counter()
    for row in rows:
        k = key(row)
        counts[k] += executed(row)
        stalls[k] += stalled(row)
    total = max(1, sum(counts.values()))
    print(f"by {title}: executed instructions, stall samples")
    for k, n in stalls.most_common(top):
        print(f"  {str(k):>10s}  {counts[k] / total:6.1%}  {n / max(1.0, samples):6.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
