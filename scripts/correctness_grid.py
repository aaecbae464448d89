"""The whole correctness grid of issue 3 §4 on the kernels, against the reference on the same device.

    python3 scripts/correctness_grid.py [--shard K/N] [--tokens T,..] [--top-k K,..] [--max-seconds S] [--out grid.json]

Cases: tests/conftest.py GRID_FACTORS, in full: quant mode (w4a16, w4a4, w4a4 per-token, w4a8) x activation (6;
SiTU not with w4a8) x finalize x EP (1; 8 with ranks 0, 3, 7) x T {1, 7, 128, 515, 4096} x top_k {1, 2, 8} x
(H, I), 13,200 in all, 16 experts. Each case runs the forward with the default tactic (what a user gets) on a
NaN-poisoned output and checks the gates of tests/test_hopper_kernels.py: every element written and finite,
relative L2 vs the reference within the gate of conftest.reference_and_gate (TOLERANCE; fused finalize: vs the exact
sum of the bf16 contributions, admitting bf16 accumulation-order noise), and
for the deterministic finalize a second run bitwise equal.

Weights are drawn and prepared on the device once per (mode, activation, shape, EP rank) and shared by that
group's 30 cases; activations are scaled to amax 4 so one x_global_scale serves every T. `--shard K/N` takes the
groups g with g % N == K (one device call each); `--max-seconds` stops between cases and records where. The JSON
holds a summary (cases run, failures, worst error per mode) and one record per case. `--tokens` / `--top-k` keep
only those values of the two factors (a re-check of the cases a heuristic change moves).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import (ACTIVATIONS, GRID_FACTORS, MODES, TOLERANCE, Case, grid_allowed,  # noqa: E402
                      reference_and_gate, rel_l2, routing)

import moe_ext  # noqa: E402
from moe_ext.backends import HOPPER, backend_for  # noqa: E402
from moe_ext.bench import positive_ints  # noqa: E402
from moe_ext.problem import build_problem  # noqa: E402

NUM_EXPERTS = 16
X_AMAX = 4.0


def groups() -> list[tuple]:
    """(mode, act, shape, ep) weight groups in a fixed order."""
    f = GRID_FACTORS
    return [g for g in itertools.product(f["mode"], f["act"], f["shape"], f["ep"])
            if grid_allowed({"mode": g[0], "act": g[1]})]


def prepare_group(mode, act, shape, ep, device, seed):
    hidden, inter = shape
    quant_mode, per_token = MODES[mode]
    activation_type = ACTIVATIONS[act][0]
    num_local = NUM_EXPERTS // ep[0]
    n1 = inter if act == "relu2" else 2 * inter
    g = torch.Generator(device).manual_seed(seed)
    w1 = (torch.randn(num_local, n1, hidden, generator=g, device=device) * 0.02).bfloat16()
    w2 = (torch.randn(num_local, hidden, inter, generator=g, device=device) * 0.02).bfloat16()
    prepared = moe_ext.prepare_moe_weights(w1.float(), w2.float(), quant_mode, activation_type,
                                           x_global_scale=2688.0 / X_AMAX, per_token_activation=per_token)
    return w1, w2, prepared


def make_group_case(mode, act, ep, weights, tokens, top_k, device, seed) -> Case:
    w1, w2, prepared = weights
    quant_mode, per_token = MODES[mode]
    hidden = w2.shape[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    x = (x * (X_AMAX / x.abs().max())).bfloat16().to(device)
    quantized = moe_ext.quantize_activation(x.float(), quant_mode, global_scale=2688.0 / X_AMAX, per_token=per_token)
    ids, scales = routing(tokens, top_k, NUM_EXPERTS, g, invalid_fraction=0.03)
    num_local = NUM_EXPERTS // ep[0]
    return Case(mode, act, w1, w2, x, prepared, dict(ACTIVATIONS[act][1]), quantized, ids.to(device),
                scales.to(device), NUM_EXPERTS, num_local, ep[1] * num_local)


def check(case: Case, fused: bool) -> dict:
    kw = case.kwargs(use_fused_finalize=fused)
    problem = build_problem(**kw)
    on_kernels = backend_for(problem) is HOPPER
    expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
    out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=torch.full_like(expected, float("nan")))
    finite = bool(torch.isfinite(out).all())
    rel = rel_l2(out, expected)
    bitwise = None if fused else bool(torch.equal(moe_ext.cute_dsl_fused_moe(**kw), out))
    return dict(on_kernels=on_kernels, tactic=list(HOPPER.default_tactic(problem)) if on_kernels else None,
                rel_l2=rel, gate=gate, finite=finite, bitwise=bitwise,
                ok=finite and rel <= gate and bitwise is not False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="K/N: the weight groups g with g %% N == K")
    parser.add_argument("--max-seconds", type=float, default=float("inf"))
    parser.add_argument("--tokens", type=positive_ints, default=GRID_FACTORS["tokens"],
                        help="T values, a subset of the grid's")
    parser.add_argument("--top-k", type=positive_ints, default=GRID_FACTORS["top_k"], help="top_k values, a subset")
    parser.add_argument("--limit", type=int, default=None, help="at most this many cases (smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="correctness_grid.json")
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shard.split("/"))
    start = time.perf_counter()
    records, stopped = [], None
    f = GRID_FACTORS
    for name, values in (("tokens", args.tokens), ("top_k", args.top_k)):
        if not set(values) <= set(f[name]):
            parser.error(f"--{name.replace('_', '-')} {values}: a subset of the grid's {f[name]} expected")
    for index, (mode, act, shape, ep) in enumerate(groups()):
        if index % n != k:
            continue
        if stopped:
            break
        weights = prepare_group(mode, act, shape, ep, args.device, seed=index)
        for tokens, top_k, fused in itertools.product(args.tokens, args.top_k, f["fused"]):
            if time.perf_counter() - start > args.max_seconds or (args.limit and len(records) >= args.limit):
                stopped = dict(group=index, tokens=tokens, top_k=top_k, fused=fused)
                break
            case = make_group_case(mode, act, ep, weights, tokens, top_k, args.device, seed=tokens * 10 + top_k)
            records.append(dict(mode=mode, act=act, shape=list(shape), ep=list(ep), tokens=tokens, top_k=top_k,
                                fused=fused, **check(case, fused)))
        del weights
    worst = {}
    for r in records:
        worst[r["mode"]] = max(worst.get(r["mode"], 0.0), r["rel_l2"])
    summary = dict(command="python3 scripts/correctness_grid.py " + " ".join(argv or sys.argv[1:]),
                   device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                   shard=args.shard, cases=len(records), failures=sum(not r["ok"] for r in records),
                   on_kernels=sum(r["on_kernels"] for r in records), worst_rel_l2=worst, stopped_before=stopped,
                   seconds=round(time.perf_counter() - start, 1))
    with open(args.out, "w") as fh:
        json.dump(dict(summary=summary, records=records), fh)
    print(json.dumps(summary))
    for r in records:
        if not r["ok"]:
            print("FAILED", json.dumps(r))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
