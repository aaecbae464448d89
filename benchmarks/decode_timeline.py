"""Where the one-launch decode's time goes, CTA by CTA: runs the timeline build of decode_fused.py (each CTA's thread 0
writes the SM clock at fixed points, decode_fused.TIMELINE) at a few (shape, T) points and prints, per point, when
the CTAs reach each point (medians over forwards of the median and the last CTA), how long each piece of an
item takes (start -> first token staging -> first stages landed -> mainloop done -> epilogue done) and a mainloop
step once its first stages are in.

    python3 benchmarks/decode_phase_variants.py .kernels_phase --variants timeline       # here, no GPU
    # there: a complete build with .kernels_phase/timeline/* over it installed, then
    python3 benchmarks/decode_timeline.py --points qwen3-30b-a3b:1,deepseek-v3-ep8:1 --out $OUT/timeline.json

Each forward is eager, after a read of twice the L2 (weights cold, as the benchmark's rotation makes them; a read
leaves no dirty lines to write back: tuning.l2_flush), with the benchmark's own layers and routing (moe_ext.bench).
Clock counts become ns at the SM clock read after the run (nvidia-smi); CTAs are lined up by the GPU's global
timer, whose resolution may be coarser than the clocks, so the per-CTA durations are exact and the offsets between
CTAs approximate. The build's extra stores cost a little (a few local-memory spills outside the mainloop): compare
its whole-forward time with the shipped kernel's.
"""
import argparse
import json
import os
import statistics
import sys

TIMELINE_WORDS = 32  # decode_fused.TIMELINE_WORDS (not imported: the GPU machine may lack CuTe-DSL)
SLOTS = dict(start_ns_lo=0, start_ns_hi=1, sm=2, start=3, waited=4, routed=5, zeroed=6, barrier_passed=7,
             end=24, end_ns_lo=25, end_ns_hi=26, gemm1_issued=27, gemm1_loaded=28, gemm2_issued=29,
             gemm2_loaded=30)  # decode_fused.TIMELINE
# decode_fused.TIMELINE_PHASE: clock marks, then two counts
PHASE_WORDS = ("item", "staged", "landed", "first_done", "last_done", "end", "items", "steps")
PHASE_MARKS = PHASE_WORDS[:-2]
PHASES = ("gemm1", "gemm2")


def decode_cta(words: list, clock_mhz: float) -> dict:
    """One CTA's TIMELINE words -> its SM, its start on the global timer (ns), and each clock mark as ns since its
    own start (None where the CTA never reached it: no item in that phase, or a word left 0)."""
    start = words[SLOTS["start"]]

    def since_start(word):
        value = words[word]
        return None if value == 0 else ((value - start) % 2**32) * 1e3 / clock_mhz

    cta = dict(sm=words[SLOTS["sm"]], start_ns=words[SLOTS["start_ns_lo"]] | words[SLOTS["start_ns_hi"]] << 32,
               end_ns=words[SLOTS["end_ns_lo"]] | words[SLOTS["end_ns_hi"]] << 32)
    for name in ("waited", "routed", "zeroed", "barrier_passed", "end"):
        cta[name] = since_start(SLOTS[name])
    for p, phase in enumerate(PHASES):
        base = 8 + 8 * p
        items = words[base + PHASE_WORDS.index("items")]
        cta[f"{phase}_items"] = items
        cta[f"{phase}_steps"] = words[base + PHASE_WORDS.index("steps")]
        for i, name in enumerate(PHASE_MARKS):
            cta[f"{phase}_{name}"] = since_start(base + i) if items else None
        for name in ("issued", "loaded"):  # 0 where the build does not write them
            cta[f"{phase}_{name}"] = since_start(SLOTS[f"{phase}_{name}"]) if items else None
    return cta


def forward_summary(ctas: list) -> dict:
    """One forward's CTAs -> when the median and the last CTA reach each mark (ns since the first CTA started, by
    the global timer plus the CTA's clock) and the median and longest of each piece of its first items."""
    first = min(c["start_ns"] for c in ctas)
    out = dict(span_ns=max(c["end_ns"] for c in ctas) - first,
               start_spread_ns=max(c["start_ns"] for c in ctas) - first)
    marks = ["waited", "routed", "zeroed"] + [f"gemm1_{n}" for n in PHASE_MARKS] + ["barrier_passed"] + [
        f"gemm2_{n}" for n in PHASE_MARKS] + ["end"]
    for mark in marks:
        at = sorted(c["start_ns"] - first + c[mark] for c in ctas if c[mark] is not None)
        if at:
            out[f"at_{mark}"] = dict(median=statistics.median(at), last=at[-1], ctas=len(at))
    pieces = dict(issue=("item", "issued"), loads=("item", "loaded"), staging=("item", "staged"),
                  landed=("item", "landed"), mainloop=("item", "first_done"), epilogue=("last_done", "end"))
    for phase in PHASES:
        for piece, (a, b) in pieces.items():
            spans = sorted(c[f"{phase}_{b}"] - c[f"{phase}_{a}"] for c in ctas
                           if c[f"{phase}_{a}"] is not None and c[f"{phase}_{b}"] is not None)
            if spans:
                out[f"{phase}_{piece}"] = dict(median=statistics.median(spans), longest=spans[-1])
        # The mainloop's steps after its first group of two landed: a step's time once data is there (latency-
        # bound rings wait at each refill; issue-bound ones take the decode's instructions a step)
        per_step = sorted((c[f"{phase}_first_done"] - c[f"{phase}_landed"]) / (c[f"{phase}_steps"] - 2) for c in ctas
                          if c[f"{phase}_landed"] is not None and c[f"{phase}_first_done"] is not None
                          and c[f"{phase}_steps"] > 2)
        if per_step:
            out[f"{phase}_per_step"] = dict(median=statistics.median(per_step), longest=per_step[-1])
    # GEMM2's waits: the latest GEMM1 end against the first wait to pass (before it where a tile's GEMM2 items go on
    # while other tiles' GEMM1 items run).
    arrive = [c["start_ns"] - first + c["gemm1_end"] for c in ctas if c["gemm1_end"] is not None]
    leave = [c["start_ns"] - first + c["barrier_passed"] for c in ctas if c["barrier_passed"] is not None]
    if arrive and leave:
        out["gemm2_wait_ns"] = min(leave) - max(arrive)
    # SMs whose two CTAs both had GEMM1 work: they run their items at half the issue rate each.
    busy = {}
    for c in ctas:
        if c["gemm1_items"] and c["gemm1_item"] is not None:
            busy[c["sm"]] = busy.get(c["sm"], 0) + 1
    out["sms_with_two_gemm1_ctas"] = sum(1 for n in busy.values() if n > 1)
    return out


def summarize(forwards: list) -> dict:
    """Medians over forwards of forward_summary's numbers (each a forward's median / last / longest)."""
    keys = set().union(*forwards)
    out = {}
    for key in sorted(keys):
        values = [f[key] for f in forwards if key in f]
        if isinstance(values[0], dict):
            out[key] = {k: statistics.median(v[k] for v in values) for k in values[0]}
        else:
            out[key] = statistics.median(values)
    out["forwards"] = len(forwards)
    return out


def format_summary(name: str, s: dict) -> str:
    lines = [f"{name}: span {s['span_ns'] / 1e3:.2f} us (CTA starts spread {s['start_spread_ns'] / 1e3:.2f} us), "
             f"{s['forwards']} forwards; SMs with two GEMM1 CTAs {s['sms_with_two_gemm1_ctas']:.0f}"]
    for key, v in s.items():
        if key.startswith("at_"):
            lines.append(f"    {key[3:]:22s} median CTA {v['median'] / 1e3:7.2f} us  last {v['last'] / 1e3:7.2f} us  "
                         f"({v['ctas']:.0f} CTAs)")
    for key, v in s.items():
        if isinstance(v, dict) and "longest" in v:
            lines.append(f"    {key:22s} median {v['median'] / 1e3:7.2f} us  longest {v['longest'] / 1e3:7.2f} us")
    if "gemm2_wait_ns" in s:
        lines.append(f"    first GEMM2 wait passed {s['gemm2_wait_ns'] / 1e3:.2f} us after the last GEMM1 item's end")
    return "\n".join(lines)


def run_point(shape, num_tokens: int, reps: int, min_local_pairs: int, tactic: tuple) -> tuple[list, float]:
    """`reps` eager forwards of the timeline build; each forward's CTAs decoded, and the SM clock used."""
    import torch

    import moe_ext
    from moe_ext import launcher
    from moe_ext.bench import Point, gpu_state, moe_ext_inputs, random_moe_ext_weights, supported_dims
    from moe_ext.tuning import l2_flush

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from profile_kernels import routing_with_local_pairs

    device = torch.device("cuda")
    hidden, inter = supported_dims(shape, "w4a16", "cuda")
    point = Point(shape, num_tokens, "moe_ext", "w4a16", "fused", hidden, inter)
    routing, index, local = routing_with_local_pairs(shape, num_tokens, min_local_pairs, "cuda")
    print(f"{shape.name} T={num_tokens}: input set {index}, {local} local (token, expert) pairs", flush=True)
    inputs = dict(moe_ext_inputs(routing, hidden, "w4a16", "cuda"), **random_moe_ext_weights(
        point, "cuda", torch.Generator(device="cuda").manual_seed(routing.seed)))
    wrapper = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, hidden, inter, max_num_tokens=num_tokens,
                                        num_local_experts=shape.num_local, local_expert_offset=shape.local_offset,
                                        quant_mode="w4a16", device="cuda", use_fused_finalize=True,
                                        **shape.wrapper_kwargs())
    pairs = num_tokens * shape.top_k
    ctas = launcher.DECODE_CTAS_PER_SM * launcher.num_sms(device)
    first = launcher.decode_count_words(pairs, point.n1, hidden)
    buffers = wrapper.workspace.kernel_buffers
    buffers.decode_counts = torch.zeros(first + ctas * TIMELINE_WORDS, dtype=torch.int32, device=device)
    flush = l2_flush(device)
    for _ in range(3):
        wrapper.run(**inputs, tactic=tactic)
    forwards = []
    for _ in range(reps):
        buffers.decode_counts[first:].zero_()
        flush()
        wrapper.run(**inputs, tactic=tactic)
        torch.cuda.synchronize()
        words = buffers.decode_counts[first:].view(ctas, TIMELINE_WORDS).cpu().to(torch.int64) % 2**32
        if not words[:, SLOTS["start"]].all():
            raise RuntimeError("no timeline words written: the installed decode kernel is not the timeline build "
                               "(benchmarks/decode_phase_variants.py --variants timeline), or the forward did not "
                               "run FUSED_DECODE")
        forwards.append(words.tolist())
    clock_mhz = gpu_state(device).get("sm_clock_mhz") or 1980.0
    return forwards, clock_mhz


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="qwen3-30b-a3b:1,deepseek-v3-ep8:1")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--min-local-pairs", type=int, default=1)
    parser.add_argument("--split-gemm2", action="store_true", help="let FUSED_DECODE take the split_gemm2 form")
    parser.add_argument("--out", default=None, help="JSON: each point's summary and its first forward's CTAs")
    args = parser.parse_args()
    from moe_ext import launcher
    from moe_ext.bench import SHAPES

    launcher.DECODE_SPLIT_GEMM2 = args.split_gemm2
    tactic = (launcher.DECODE_TILE, launcher.FUSED_DECODE, launcher.FUSED_DECODE)
    records = []
    for text in args.points.split(","):
        name, num_tokens = text.split(":")
        forwards, clock_mhz = run_point(SHAPES[name], int(num_tokens), args.reps, args.min_local_pairs, tactic)
        decoded = [[decode_cta(words, clock_mhz) for words in forward] for forward in forwards]
        summary = summarize([forward_summary(ctas) for ctas in decoded])
        print(format_summary(f"{name} T={num_tokens} (SM clock {clock_mhz:.0f} MHz)", summary), flush=True)
        records.append(dict(shape=name, T=int(num_tokens), split_gemm2=args.split_gemm2, clock_mhz=clock_mhz,
                            summary=summary, first_forward=decoded[0]))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
