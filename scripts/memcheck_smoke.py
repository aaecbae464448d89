"""Small end-to-end runs of every sm_90a kernel, for `compute-sanitizer --tool memcheck` (scripts/gpu_check.sh)."""
import sys

import torch

sys.path.insert(0, "tests")
from conftest import make_case  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext import launcher  # noqa: E402
from moe_ext.backends import HOPPER, backend_for  # noqa: E402
from moe_ext.problem import build_problem  # noqa: E402

DECODE = (launcher.DECODE_TILE, launcher.FUSED_DECODE, launcher.FUSED_DECODE)

for mode, act in (("w4a16", "situ_linear"), ("w4a16", "relu2"), ("w4a4", "swiglu"), ("w4a4_pt", "geglu_tanh"),
                  ("w4a8", "swiglu"), ("w4a8", "relu2")):
    for ep, rank in ((1, 0), (4, 3)):
        case = make_case(mode, act, num_tokens=9, top_k=3, num_experts=8, hidden=256, inter=256, ep=ep,
                         rank=rank, invalid_fraction=0.1).to("cuda")
        for fused in (True, False):
            kw = case.kwargs(use_fused_finalize=fused)
            problem = build_problem(**kw)
            assert backend_for(problem) is HOPPER
            for tactic in HOPPER.tactics(problem):  # every token tile
                out = moe_ext.cute_dsl_fused_moe(**kw, tactic=tactic)
# Localized shards on two side streams (fused and deterministic), every tactic.
streams = [torch.cuda.Stream(), torch.cuda.Stream()]
for mode in ("w4a4", "w4a16"):
    case = make_case(mode, num_tokens=9, top_k=3, num_experts=8, hidden=256, inter=256, invalid_fraction=0.1).to(
        "cuda")
    shards = moe_ext.split_localized_shards(case.prepared)
    for fused in (True, False):
        kw = case.kwargs(use_fused_finalize=fused, localized_weights=shards, localized_streams=streams)
        problem = build_problem(**kw)
        assert backend_for(problem) is HOPPER
        for tactic in HOPPER.tactics(problem):
            moe_ext.cute_dsl_fused_moe(**kw, tactic=tactic)
# The one-launch decode in each of its forms, forced through the launcher's rules (the cases above take only the
# fc2 form): partials and fc2, GEMM2 split or not, the fc2 form's deep ring; w4a4 / w4a8 have the fc2 forms only. On
# a 132-SM grid, 8 pairs on distinct experts give GEMM1 2 K ranges of its 9 steps (hidden 1152: uneven) and the split
# form 2 of GEMM2's 8 (inter 1024).
forms = [dict(split_gemm2=split, fc2_by_gemm1=fc2, deep_ring=False) for fc2 in (False, True) for split in (False, True)]
for mode in launcher.DECODE_MODES:
    for form in forms + [dict(split_gemm2=False, fc2_by_gemm1=True, deep_ring=True)]:
        if mode != "w4a16" and not form["fc2_by_gemm1"]:
            continue
        launcher.decode_fc2_by_gemm1 = lambda problem, f=form: f["fc2_by_gemm1"]
        launcher._decode_gemm2_wants_split = lambda problem, f=form: f["split_gemm2"]
        launcher.decode_deep_ring = lambda problem, f=form: f["deep_ring"]
        case = make_case(mode, "swiglu", num_tokens=2, top_k=4, num_experts=16, hidden=1152, inter=1024,
                         invalid_fraction=0.1).to("cuda")
        problem = build_problem(**case.kwargs(use_fused_finalize=True))
        name = launcher.decode_kernel("swiglu", **form, mode=mode)
        assert launcher.decode_kernel_for(problem) == name, (launcher.decode_kernel_for(problem), name)
        moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=True), tactic=DECODE)
        print("memcheck smoke: ran", name)
torch.cuda.synchronize()
print("memcheck smoke: ok")
