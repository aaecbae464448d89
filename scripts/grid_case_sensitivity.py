"""Where does a correctness-grid case differ from the reference? Rebuild one grid case and report, for every tactic,
the kernel's relative L2 against the reference; for w4a4 per-token also each stage (h, FC2 codes, scales).

    python3 scripts/grid_case_sensitivity.py w4a4_pt situ 1024,2048 8,7 1 2 [--fused]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from correctness_grid import groups, make_group_case, prepare_group  # noqa: E402
from conftest import TOLERANCE, kernel_fc2_input_per_token, reference_and_gate, rel_l2  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext.backends import HOPPER  # noqa: E402
from moe_ext.problem import build_problem  # noqa: E402


def per_token_stages(problem) -> dict:
    """w4a4 per-token, streaming tactic (8, 1, 1): the kernels' bf16 h against the reference's GEMM1 + activation,
    and their FC2 codes, scales and row scales against the reference quantizer applied to the kernels' own h."""
    import torch

    from moe_ext.reference import activate, dequantize_input, gemm1

    stages = kernel_fc2_input_per_token(problem)
    K = problem.top_k
    p2e, tile_to_expert = stages["routing"].permuted_to_expanded, stages["routing"].tile_to_expert
    x = dequantize_input(problem)
    h_ref = []
    for row in stages["live"].tolist():
        token, expert = int(p2e[row]) // K, int(tile_to_expert[row // 8])
        s1 = problem.w1_alpha[expert] * problem.per_token_scale[token]
        h_ref.append(activate(problem, s1 * gemm1(problem, x[token:token + 1], expert)).to(torch.bfloat16))
    h_kernel, h_ref = stages["h"].float(), torch.cat(h_ref).float()
    return dict(rows=len(stages["live"]), h_mismatches=int((h_kernel != h_ref).sum()),
                h_max_rel=float(((h_kernel - h_ref).abs() / h_ref.abs().clamp_min(1e-30)).max()),
                code_byte_mismatches=int((stages["codes"] != stages["ref_codes"]).sum()),
                sf_mismatches=int((stages["sf"] != stages["ref_sf"].reshape(stages["sf"].shape)).sum()),
                row_scale_kernel=stages["row_scale"].tolist(), row_scale_ref=stages["ref_row_scale"].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode")
    parser.add_argument("act")
    parser.add_argument("shape")
    parser.add_argument("ep")
    parser.add_argument("tokens", type=int)
    parser.add_argument("top_k", type=int)
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    ep = tuple(int(v) for v in args.ep.split(","))
    index = groups().index((args.mode, args.act, shape, ep))
    weights = prepare_group(args.mode, args.act, shape, ep, "cuda", seed=index)
    case = make_group_case(args.mode, args.act, ep, weights, args.tokens, args.top_k, "cuda",
                           seed=args.tokens * 10 + args.top_k)
    kw = case.kwargs(use_fused_finalize=args.fused)
    problem = build_problem(**kw)
    expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
    report = dict(case=vars(args), gate=gate, tactics={})
    for tactic in HOPPER.tactics(problem):
        out = moe_ext.cute_dsl_fused_moe(**kw, tactic=tactic)
        report["tactics"][str(tactic)] = rel_l2(out, expected)
    if problem.per_token_scale is not None:
        report["stages"] = per_token_stages(problem)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
