"""Small end-to-end runs of every sm_90a kernel, for `compute-sanitizer --tool memcheck` (scripts/gpu_check.sh)."""
import sys

import torch

sys.path.insert(0, "tests")
from conftest import make_case  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext.backends import HOPPER, backend_for  # noqa: E402
from moe_ext.problem import build_problem  # noqa: E402

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
torch.cuda.synchronize()
print("memcheck smoke: ok")
