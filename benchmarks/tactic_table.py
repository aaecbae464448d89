"""Every tactic's whole-forward time at each point, over several routing draws: the data the launcher's heuristic
(`launcher.default_tactic`, what runs where nobody tunes) is fitted to and judged by.

    python3 benchmarks/tactic_table.py --points qwen3-30b-a3b:1,mixtral-8x7b:8 --draws 5 --out table.json
    python3 benchmarks/tactic_table.py --summarize table.json          # no GPU needed

Draw d is the benchmark's input set d (`moe_ext.bench.point_seed`), one weight copy, w4a16, fused finalize. Each
tactic's forward is captured once and replayed in rounds that visit the tactics in a rotating order; before every
replay a read of twice the L2 evicts the weights, so each sample is a cold forward as in `moe_ext.bench` (which
rotates weight copies instead: with one draw's routing fixed, a rotation would not move the experts it reads). A
read, not a write: a write leaves the L2 full of dirty lines whose write-back the next forward pays (session 31's
table, flushed by writes, read 1.09-1.16x the bench's replay times at T = 1, 3.5-13 µs more; writing back up to
the L2's 50 MB takes up to ~12 µs at the DRAM's rate).
A sample is the replay alone, between two events. The summary ranks the tactics per point by their geometric
mean over the draws (a draw's time over that draw's best): the heuristic's place in that ranking is what a
retune has to improve.
"""
import argparse
import json
import math
import statistics

import torch

import moe_ext
from moe_ext.bench import (FINALIZE, SHAPES, Point, moe_ext_inputs, point_seed, random_moe_ext_weights, random_routing,
                           routing_stats, supported_dims)
from moe_ext.tuning import l2_flush


def tactic_key(tactic) -> str:
    return ",".join(map(str, tactic))


def cold_medians_us(graphs: dict, rounds: int, flush) -> dict:
    """Median µs of each graph's replay, every replay after an L2-evicting read, in rotating order."""
    names = list(graphs)
    samples = {name: [] for name in names}
    for r in range(rounds):
        events = []
        for name in names[r % len(names):] + names[:r % len(names)]:
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def tactic_forwards(shape, num_tokens: int, draw: int, dims: tuple[int, int], device) -> tuple[dict, dict]:
    """One routing draw of a point (w4a16, fused finalize, (H, I) = dims): its record's fields (the heuristic's
    tactic among them) and a forward for every tactic the wrapper accepts, each run once (warm-up: plans, first
    launches)."""
    hidden, inter = dims
    point = Point(shape, num_tokens, "moe_ext", "w4a16", "fused", hidden, inter)
    routing = random_routing(num_tokens, shape, point_seed(0, shape, num_tokens, draw), device)
    stats = routing_stats([routing.ids], shape.num_local, shape.local_offset)
    args = dict(moe_ext_inputs(routing, hidden, "w4a16", device),
                **random_moe_ext_weights(point, device, torch.Generator(device=device).manual_seed(routing.seed)))
    wrapper = moe_ext.CuteDslMoEWrapper(
        shape.num_experts, shape.top_k, hidden, inter, use_cuda_graph=True, max_num_tokens=num_tokens,
        num_local_experts=shape.num_local, local_expert_offset=shape.local_offset, device=device,
        use_fused_finalize=FINALIZE["fused"], quant_mode="w4a16", **shape.wrapper_kwargs())
    with moe_ext.autotune(False):
        wrapper.run(**args)  # no tactic, not tuning: the heuristic's
    heuristic = list(wrapper.last_tactic)
    forwards = {}
    for tactic in wrapper.get_valid_tactics():
        forwards[tactic_key(tactic)] = lambda tactic=tactic: wrapper.run(**args, tactic=tactic)
        forwards[tactic_key(tactic)]()
    fields = dict(point.identity(), draw=draw, seed=routing.seed, local_pairs=stats.local_pairs,
                  experts_hit=stats.experts_hit, heuristic=heuristic)
    return fields, forwards


def measure_draw(shape, num_tokens: int, draw: int, dims: tuple[int, int], rounds: int, flush) -> dict:
    """One routing draw of a point at (H, I) = dims: every valid tactic's cold forward (median µs), and the
    heuristic's choice."""
    fields, forwards = tactic_forwards(shape, num_tokens, draw, dims, torch.device("cuda"))
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    for key, forward in forwards.items():
        graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[key], pool=pool):
            forward()
    torch.cuda.synchronize()
    return dict(fields, rounds=rounds, us=cold_medians_us(graphs, rounds, flush))


def summarize(records: list[dict]) -> list[dict]:
    """Per (shape, T): each tactic's geometric mean over the draws of (its time / the draw's best), best first,
    and where the heuristic's tactic stands."""
    points = {}
    for r in records:
        points.setdefault((r["shape"], r["T"]), []).append(r)
    out = []
    for (shape, num_tokens), draws in points.items():
        common = set.intersection(*(set(d["us"]) for d in draws))
        score = {t: math.exp(statistics.fmean(math.log(d["us"][t] / min(d["us"].values())) for d in draws))
                 for t in common}
        ranked = sorted(score, key=score.get)
        heuristics = {tactic_key(d["heuristic"]) for d in draws}
        heuristic = heuristics.pop() if len(heuristics) == 1 else None
        out.append(dict(shape=shape, T=num_tokens, draws=len(draws), best=ranked[0], best_score=score[ranked[0]],
                        heuristic=heuristic, heuristic_score=score.get(heuristic),
                        heuristic_rank=ranked.index(heuristic) + 1 if heuristic in score else None,
                        top=[(t, round(score[t], 4)) for t in ranked[:5]]))
    return out


def print_summary(rows: list[dict]) -> None:
    print(f"{'shape':18s} {'T':>5s} {'draws':>5s}  {'heuristic':12s} {'x best':>7s} {'rank':>4s}  "
          "best (x each draw's best)")
    for row in rows:
        score = row["heuristic_score"]
        print(f"{row['shape']:18s} {row['T']:5d} {row['draws']:5d}  {str(row['heuristic']):12s} "
              f"{score if score is None else f'{score:.3f}':>7} {str(row['heuristic_rank']):>4s}  "
              + "  ".join(f"{t} {s:.3f}" for t, s in row["top"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default=",".join(f"{s}:{t}" for s in SHAPES for t in (1, 8, 64, 256)),
                        help="shape:T,... (default: the issue-4 decode points, every shape at T = 1, 8, 64, 256)")
    parser.add_argument("--draws", type=int, default=5, help="routing draws (input sets 0 .. draws-1) a point")
    parser.add_argument("--rounds", type=int, default=15, help="cold replays of each tactic a draw")
    parser.add_argument("--out", default="tactic_table.json")
    parser.add_argument("--summarize", metavar="JSON", help="print the summary of a written table and exit")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print_summary(summarize(json.load(f)))
        return
    flush = l2_flush(torch.device("cuda", torch.cuda.current_device()))
    records = []
    for spec in args.points.split(","):
        name, num_tokens = spec.split(":")
        dims = supported_dims(SHAPES[name], "w4a16", "cuda")  # the benchmark's (H, I), searched once a point
        for draw in range(args.draws):
            record = measure_draw(SHAPES[name], int(num_tokens), draw, dims, args.rounds, flush)
            records.append(record)
            best = min(record["us"], key=record["us"].get)
            print(f"{name} T={num_tokens} draw {draw} ({record['local_pairs']:g} local pairs): heuristic "
                  f"{tactic_key(record['heuristic'])} {record['us'][tactic_key(record['heuristic'])]:.1f} µs, best "
                  f"{best} {record['us'][best]:.1f} µs, {len(record['us'])} tactics", flush=True)
            with open(args.out, "w") as f:  # every finished draw on disk, in case the call is cut short
                json.dump(records, f, indent=1)
            torch.cuda.empty_cache()
    print_summary(summarize(records))


if __name__ == "__main__":
    main()
