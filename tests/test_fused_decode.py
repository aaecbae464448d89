"""The one-launch small-T forward (launcher.FUSED_DECODE, moe_ext/kernels/sm90/decode_fused.py) against the reference:
its in-kernel routing (experts hit by several tokens, by one token twice, by more rows than one 8-row tile, ids
outside the local range), its GEMM1 K ranges (odd step counts, fewer steps than ranges), the GEMM2 K ranges of
its split form, the counts GEMM2 waits on across many launches and CUDA-graph replays; in w4a4 and w4a8 too (x's
codes decoded in GEMM1's staging, the FC2 input quantized in its epilogue), there bit for bit against the kernel
chain. Skipped without an H100/H200 or without the kernels linked."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from conftest import (ACTS, TOLERANCE, gpu, hopper_kernels, make_case, reference_and_gate, rel_l2,
                      replays_with_new_inputs)

import moe_ext
from moe_ext import launcher
from moe_ext.backends import HOPPER
from moe_ext.problem import build_problem

pytestmark = [pytest.mark.gpu, gpu, hopper_kernels]

FUSED = (launcher.DECODE_TILE, launcher.FUSED_DECODE, launcher.FUSED_DECODE)
RUN_ARGS = ("x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf", "w1_alpha",
            "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha")  # CuteDslMoEWrapper.run's inputs


@pytest.fixture(autouse=True, params=["fc2_by_gemm2", "fc2_by_gemm1"])
def fc2_form(request, monkeypatch):
    """Every test on both ways the kernel builds GEMM2's input (decode_fused's fc2_by_gemm1: GEMM2's staging sums
    GEMM1's K ranges, or GEMM1's last range does), whichever the launcher's rule picks for the case."""
    by_gemm1 = request.param == "fc2_by_gemm1"
    missing = [name for name in (launcher.decode_kernel("swiglu", split, by_gemm1) for split in (False, True))
               if not launcher.has_kernel(name)]
    if missing:  # the launcher would quietly run the other form: a build older than this tree
        pytest.fail(f"the launcher links no {missing}: rebuild the kernels (python -m moe_ext.kernels.sm90.build)")
    monkeypatch.setattr(launcher, "decode_fc2_by_gemm1", lambda problem: by_gemm1)
    return by_gemm1


def check_variant(name: str, case) -> None:
    """check() on the FUSED_DECODE kernel variant `name` that the test forces: it must be linked and be the kernel
    the launcher picks for the case."""
    if not launcher.has_kernel(name):
        pytest.fail(f"the launcher links no {name}: rebuild the kernels (python -m moe_ext.kernels.sm90.build)")
    assert launcher.decode_kernel_for(build_problem(**case.kwargs(use_fused_finalize=True))) == name
    check(case)


def check(case, tactic=FUSED):
    kw = case.kwargs(use_fused_finalize=True)
    problem = build_problem(**kw)
    assert tactic in HOPPER.tactics(problem)
    expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
    out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=torch.full_like(expected, float("nan")), tactic=tactic)
    assert torch.isfinite(out).all(), "the kernel zeroes the output before adding into it"
    assert rel_l2(out, expected) <= gate, (rel_l2(out, expected), gate)
    return out


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 8), (3, 4), (8, 8), (16, 4), (64, 1)])
def test_fused_decode_matches_reference(act, tokens, top_k):
    """Hidden 1024 is 8 GEMM1 steps: every case splits GEMM1's K in 2-4 ranges, which GEMM2's staging must sum
    (a build that read only the first range passed every unsplit case)."""
    case = make_case("w4a16", act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=1024, inter=512,
                     seed=tokens * 10 + top_k, invalid_fraction=0.1).to("cuda")
    check(case)


@pytest.mark.parametrize("shape", [(2944, 384), (2048, 768), (7168, 256), (128, 128)], ids=str)
@pytest.mark.parametrize("ep_rank", [(1, 0), (8, 3)], ids=str)
def test_fused_decode_k_ranges_and_expert_parallelism(shape, ep_rank):
    """23 and 1 GEMM1 steps of 128 (an odd count; a single step, which no split divides), 3 and 1 GEMM2 steps,
    and an EP rank whose local experts most pairs miss."""
    hidden, inter = shape
    ep, rank = ep_rank
    case = make_case("w4a16", "swiglu", num_tokens=5, top_k=8, num_experts=64, hidden=hidden, inter=inter, ep=ep,
                     rank=rank, seed=hidden + rank, weight_scale=0.02).to("cuda")
    check(case)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a8"])
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
@pytest.mark.parametrize("tokens,top_k,shape", [(1, 8, (1024, 512)), (8, 8, (2048, 768)), (16, 4, (2944, 384)),
                                                (64, 1, (1024, 256))], ids=str)
def test_fused_decode_deep_ring_matches_reference(mode, act, tokens, top_k, shape, fc2_form, monkeypatch):
    """The unsplit fc2 form's deep-ring variant (launcher.decode_deep_ring, forced: these problems are too small to
    reach its threshold) over GEMM1 runs shorter than its 6 stages, longer, and of an odd step count."""
    if not fc2_form:
        pytest.skip("a variant of the fc2_by_gemm1 form")
    monkeypatch.setattr(launcher, "decode_deep_ring", lambda problem: True)
    hidden, inter = shape
    case = make_case(mode, act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=hidden, inter=inter,
                     seed=tokens + hidden, invalid_fraction=0.1, weight_scale=0.02).to("cuda")
    check_variant(launcher.decode_kernel("swiglu", fc2_by_gemm1=True, deep_ring=True, mode=mode), case)


def test_fused_decode_crowded_and_repeated_experts():
    """Every pair on two experts (one expert gets 40 rows: five 8-row tiles), tokens that name an expert twice,
    and a token with no local expert at all."""
    case = make_case("w4a16", "swiglu", num_tokens=16, top_k=4, num_experts=8, hidden=1024, inter=256, seed=7)
    ids = torch.tensor([[1, 1, 6, 1]] * 10 + [[6, 1, 6, 6]] * 5 + [[-1, 9, 12, -5]], dtype=torch.int32)
    check(dataclasses.replace(case, ids=ids).to("cuda"))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a8"])
def test_fused_decode_is_the_kernel_chain_bit_for_bit(mode, fc2_form):
    """With one expert a token the fused finalize adds each output row once into zeros, so the one-launch forward
    must equal the routing -> GEMM1 -> GEMM2 chain bit for bit where both sum the same K ranges in the same order:
    12 row tiles x 2 weight tiles are 24 GEMM1 items, which leave any grid of 48+ SMs room for the most ranges
    this problem's 8 steps allow (4, two steps each) - the chain's cluster split of 4 - and GEMM2 unsplit with one
    K slice (the three-CTA form). In w4a4 / w4a8 the chain decodes x in its routing launch and quantizes the FC2
    input one thread a scale block; the one launch decodes x in GEMM1's staging and shares a block's maximum
    between lanes: any difference in either shows here."""
    if mode != "w4a16" and not fc2_form:
        pytest.skip("the quantized modes' one-launch forward has the fc2_by_gemm1 forms only")
    case = make_case(mode, "swiglu", num_tokens=64, top_k=1, num_experts=8, hidden=1024, inter=128,
                     seed=3).to("cuda")
    fused = check(case)
    chain = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=True), tactic=(8, 4, launcher.THREE_CTAS))
    assert torch.equal(fused, chain), rel_l2(fused, chain)


def test_fused_decode_counts_survive_many_launches():
    """The counts GEMM2's items wait on are never reset: 300 launches in a row must each finish, none passing a
    count early (which would add GEMM2 rows from half-written partials). One expert a token: every launch is
    bitwise the same."""
    case = make_case("w4a16", "swiglu", num_tokens=64, top_k=1, num_experts=32, hidden=512, inter=256,
                     seed=9).to("cuda")
    kw = case.kwargs(use_fused_finalize=True)
    wrapper = moe_ext.CuteDslMoEWrapper(case.num_experts, 1, 512, 256, max_num_tokens=64, quant_mode="w4a16",
                                        device="cuda", use_fused_finalize=True)
    args = {k: kw[k] for k in RUN_ARGS}
    first = wrapper.run(**args, tactic=FUSED).clone()
    outs = torch.stack([wrapper.run(**args, tactic=FUSED).clone() for _ in range(300)])
    assert all(torch.equal(o, first) for o in outs)


def test_fused_decode_counts_stay_in_step_across_launches_of_other_sizes():
    """Each launch flips the readiness count of every row tile a launch could have, those its routing did not make
    included, so one wrapper's buffer serves forwards of 1-8 tokens (1-16 row tiles) in any order: each must match
    its reference (a count out of step would let GEMM2 read a tile before GEMM1 wrote it, or wait forever)."""
    wrapper = moe_ext.CuteDslMoEWrapper(16, 8, 1024, 256, max_num_tokens=8, quant_mode="w4a16", device="cuda",
                                        use_fused_finalize=True)
    for step, tokens in enumerate([1, 8, 3, 8, 1, 1, 5, 8, 2, 8] * 3):
        case = make_case("w4a16", "swiglu", num_tokens=tokens, top_k=8, num_experts=16, hidden=1024, inter=256,
                         seed=step).to("cuda")
        kw = case.kwargs(use_fused_finalize=True)
        expected, gate = reference_and_gate(build_problem(**kw), TOLERANCE["w4a16"])
        out = wrapper.run(**{k: kw[k] for k in RUN_ARGS}, tactic=FUSED)
        assert rel_l2(out, expected) <= gate, (step, tokens, rel_l2(out, expected), gate)


@pytest.fixture
def split_gemm2(monkeypatch):
    """The launcher allowed to take the kernel form that splits GEMM2's K (launcher.DECODE_SPLIT_GEMM2)."""
    monkeypatch.setattr(launcher, "DECODE_SPLIT_GEMM2", True)


def splits_gemm2(case) -> bool:
    """Whether the launcher runs `case` on the kernel form that splits GEMM2's K."""
    return "_split2" in launcher.decode_kernel_for(build_problem(**case.kwargs(use_fused_finalize=True)))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 8), (3, 4), (8, 8)])
@pytest.mark.parametrize("inter", [1024, 2944])
def test_fused_decode_gemm2_k_ranges_match_reference(split_gemm2, act, tokens, top_k, inter):
    """Few GEMM2 items (4 hidden tiles a row tile) split GEMM2's 8 or 23 K steps (an odd count) in 2-5 ranges;
    the range that arrives last sums their fp32 tiles in rank order before the fused finalize's bf16 add."""
    case = make_case("w4a16", act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=512, inter=inter,
                     seed=tokens * 10 + top_k + inter, invalid_fraction=0.1).to("cuda")
    assert splits_gemm2(case)
    check(case)


def test_fused_decode_gemm2_k_ranges_meet_before_one_bf16_add(split_gemm2):
    """GEMM2's 16 K steps in 4 ranges (4 hidden tiles of a few row tiles). With one expert a token every launch
    is bitwise the same, and 100 launches also check that the arrival counts return to zero (a stale count would
    pick a range that arrives early, adding a partial sum)."""
    case = make_case("w4a16", "swiglu", num_tokens=8, top_k=1, num_experts=4, hidden=512, inter=2048,
                     seed=11).to("cuda")
    assert splits_gemm2(case)
    first = check(case)
    kw = case.kwargs(use_fused_finalize=True)
    for _ in range(100):
        assert torch.equal(moe_ext.cute_dsl_fused_moe(**kw, tactic=FUSED), first)


@pytest.mark.parametrize("inter", [256, 2048], ids=["gemm2_unsplit", "gemm2_split"])
def test_fused_decode_in_a_captured_wrapper_replays_new_routing(split_gemm2, inter):
    """The wrapper's captured forward replayed with new routing and activations each step, against an eager
    forward of the same tactic on the same inputs: they differ only in the order of the bf16 atomic adds. (Against
    the kernel chain the bf16 intermediate also rounds differently: 5.05e-3 at one step of the H200 run.) Both
    kernel forms: the split one also leaves its arrival counts at zero for the next replay."""
    base = make_case("w4a16", num_tokens=4, top_k=8, num_experts=32, hidden=512, inter=inter, seed=0).to("cuda")
    assert splits_gemm2(base) == (inter == 2048)
    wrapper = moe_ext.CuteDslMoEWrapper(32, 8, 512, inter, use_cuda_graph=True, max_num_tokens=4,
                                        quant_mode="w4a16", device="cuda", use_fused_finalize=True)
    wrapper.run = _with_tactic(wrapper.run, FUSED)
    for step, captured, eager in replays_with_new_inputs(wrapper, base, fused=True, steps=30, tactic=FUSED):
        assert rel_l2(captured, eager) <= 5e-3, step


def _with_tactic(run, tactic):
    def wrapped(*args, **kwargs):
        return run(*args, **kwargs, tactic=tactic)
    return wrapped


@pytest.mark.parametrize("over,why", [
    (dict(use_fused_finalize=False), "deterministic finalize"),
    (dict(num_tokens=9, top_k=8), "72 pairs"),
])
def test_fused_decode_is_offered_only_where_it_runs(over, why):
    over = dict(over)  # the parameter's dict is shared by both forms' runs
    tokens, top_k = over.pop("num_tokens", 4), over.pop("top_k", 8)
    case = make_case("w4a16", num_tokens=tokens, top_k=top_k, num_experts=16, hidden=256, inter=256).to("cuda")
    problem = build_problem(**case.kwargs(**over))
    assert FUSED not in HOPPER.tactics(problem), why
    with pytest.raises(ValueError, match="not valid"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(**over), tactic=FUSED)


def test_fused_decode_is_not_offered_for_per_token_activation_scales():
    case = make_case("w4a4_pt", num_tokens=2, top_k=8, num_experts=16, hidden=256, inter=256).to("cuda")
    assert FUSED not in HOPPER.tactics(build_problem(**case.kwargs(use_fused_finalize=True)))
    with pytest.raises(ValueError, match="not valid"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=True), tactic=FUSED)


def test_wrapper_lists_the_fused_decode_tactic_with_fused_finalize_only():
    def tactics(**kw):
        return moe_ext.CuteDslMoEWrapper(16, 8, 256, 256, device="cuda", **kw).get_valid_tactics()

    for mode in ("w4a16", "w4a4", "w4a8"):
        assert FUSED in tactics(quant_mode=mode, use_fused_finalize=True), mode
        assert FUSED not in tactics(quant_mode=mode, use_fused_finalize=False), mode


QUANTIZED = ["w4a4", "w4a8"]


@pytest.fixture
def quantized_form(fc2_form):
    """The quantized modes' tests run once: their one-launch forward has the fc2_by_gemm1 forms only (the launcher
    takes them whatever decode_fc2_by_gemm1 says)."""
    if not fc2_form:
        pytest.skip("the quantized modes' one-launch forward has the fc2_by_gemm1 forms only")


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 4), (8, 8), (64, 1)])
def test_quantized_fused_decode_matches_reference(quantized_form, mode, act, tokens, top_k):
    """NVFP4 / MXFP8 activations decoded in GEMM1's staging and the FC2 input quantized in GEMM1's epilogue (scale
    blocks of 16 / 32 values over 8 / 16 lanes, 4 / 8 for ReLU2), hidden 1024 split in 2-4 K ranges."""
    if mode == "w4a8" and act.startswith("situ"):
        pytest.skip("SiTU is rejected for w4a8 (semantics §1.1)")
    case = make_case(mode, act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=1024, inter=512,
                     seed=tokens * 10 + top_k, invalid_fraction=0.1).to("cuda")
    assert launcher.decode_kernel_for(build_problem(**case.kwargs(use_fused_finalize=True))).startswith(
        f"moe_decode_{mode}_")
    check(case)


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("shape,ep_rank,tokens", [((512, 2944), (1, 0), 2), ((2944, 384), (8, 3), 5),
                                                  ((7168, 256), (8, 0), 1), ((128, 128), (1, 0), 8)], ids=str)
def test_quantized_fused_decode_k_ranges_and_expert_parallelism(quantized_form, split_gemm2, mode, shape, ep_rank,
                                                                tokens):
    """GEMM2's 23 K steps split into ranges (the split form), 23 and 56 GEMM1 steps, single steps, and EP ranks
    whose local experts most pairs miss."""
    hidden, inter = shape
    ep, rank = ep_rank
    case = make_case(mode, "swiglu", num_tokens=tokens, top_k=8, num_experts=64, hidden=hidden, inter=inter, ep=ep,
                     rank=rank, seed=hidden + rank, weight_scale=0.02).to("cuda")
    assert splits_gemm2(case) == (inter == 2944)
    check(case)


@pytest.mark.parametrize("mode", QUANTIZED)
def test_quantized_fused_decode_in_a_captured_wrapper_replays_new_routing(quantized_form, mode):
    """A captured w4a4 / w4a8 forward replayed with new routing and activations (new codes and scales) each step,
    against an eager forward of the same tactic."""
    base = make_case(mode, num_tokens=4, top_k=8, num_experts=32, hidden=512, inter=256, seed=0).to("cuda")
    wrapper = moe_ext.CuteDslMoEWrapper(32, 8, 512, 256, use_cuda_graph=True, max_num_tokens=4, quant_mode=mode,
                                        device="cuda", use_fused_finalize=True)
    wrapper.run = _with_tactic(wrapper.run, FUSED)
    for step, captured, eager in replays_with_new_inputs(wrapper, base, fused=True, steps=20, tactic=FUSED):
        assert rel_l2(captured, eager) <= 5e-3, step


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["w4a16", "w4a4", "w4a8"]),
       act=st.sampled_from(["swiglu", "swiglu_oai", "geglu_tanh", "relu2"]), tokens=st.integers(1, 16),
       top_k=st.integers(1, 8), hidden=st.sampled_from([128, 384, 1024, 2944]), inter=st.sampled_from([128, 384, 768]),
       num_experts=st.sampled_from([8, 16, 64]), ep_rank=st.sampled_from([(1, 0), (8, 5)]),
       seed=st.integers(0, 2 ** 16), invalid=st.sampled_from([0.0, 0.2]))
def test_fused_decode_property_random_layers(mode, act, tokens, top_k, hidden, inter, num_experts, ep_rank, seed,
                                             invalid):
    """Any layer the one-launch forward takes (T * top_k <= 64, every mode, gated or not, EP ranks with one to
    eight local experts) matches the reference, in whichever form the launcher picks for it."""
    assume(tokens * top_k <= launcher.DECODE_MAX_PAIRS and top_k <= num_experts)
    ep, rank = ep_rank
    case = make_case(mode, act, num_tokens=tokens, top_k=top_k, num_experts=num_experts, hidden=hidden, inter=inter,
                     ep=ep, rank=rank, seed=seed, invalid_fraction=invalid, weight_scale=0.05).to("cuda")
    check(case)
