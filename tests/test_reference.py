"""moe_ext.reference against the independent float64 oracle, and FlashInfer's acceptance rule against the
fp32 computation on unquantized weights (semantics §6.1)."""
import itertools
import zlib

import pytest
import torch
from conftest import ACTIVATIONS, MODES, make_case, routing
from hypothesis import example, given, settings
from hypothesis import strategies as st
from oracle import oracle_moe

import moe_ext
from moe_ext.quant.swizzle import sf_bytes


def run_oracle(case, fused):
    kw = case.kwargs()
    _, _, kind, params = ACTIVATIONS[case.act]
    flat = lambda t: sf_bytes(t, t.numel())  # noqa: E731
    return oracle_moe(case.prepared.quant_mode, kw["x"], kw["x_sf"], case.ids, case.scales,
                      case.prepared.w1_weight, flat(case.prepared.w1_weight_sf), case.prepared.w1_alpha,
                      case.prepared.fc2_input_scale, case.prepared.w2_weight, flat(case.prepared.w2_weight_sf),
                      case.prepared.w2_alpha, case.num_local, case.offset, kind, params, fused,
                      case.quantized.per_token_scale)


def assert_matches_oracle(out, expected, flipped_rows: int = 0):
    """fp32 (reference) and fp64 (oracle) sums differ in the last bits; rarely that moves a value across a
    rounding point of the FC2-input quantizer and flips one code. A wrong formula gives errors of order one.
    Checked case: 2 of 1000 seeds of w4a4_pt-relu2-fused-EP(4,2) exceed the bound (870: 9.8e-3). In seed 870 exactly
    one of token 3's 128 FC2-input values rounds to another bf16 in fp32 than in fp64, its e2m1 code moves one step
    (a third of the value), and every other output row matches exactly; with 7 tokens and sparse Relu2 rows that
    one code is 1% of the output's norm. The seeds below avoid such draws; the bound stays. Random draws
    (the property test) allow `flipped_rows` output rows outside the element tolerance: one such code spreads over
    its token's whole row (hypothesis found w4a4-relu2, 9 tokens, seed 65536: 45 of token 0's 256 elements, every
    other row exact), while a wrong formula moves every row."""
    out = out.double()
    assert torch.isfinite(out).all()
    rel = (out - expected).norm() / expected.norm().clamp_min(1e-30)
    assert rel < 5e-3, f"relative L2 error {rel:.2e}"
    close = (out - expected).abs() <= 2 ** -7 * expected.abs() + 1e-3 * expected.abs().max()
    rows = close.reshape(close.shape[0], -1).float().mean(1)
    if flipped_rows:
        rows = rows.sort().values[flipped_rows:]
    assert rows.numel() == 0 or rows.mean() > 0.99, f"only {rows.mean():.4f} of elements within tolerance"


EP_SETTINGS = [(1, 0), (4, 0), (4, 2), (4, 3)]
GRID = [(m, a, f, ep) for m, a, f, ep in itertools.product(MODES, ACTIVATIONS, (True, False), EP_SETTINGS)
        if not (m == "w4a8" and a.startswith("situ"))]


@pytest.mark.parametrize("mode,act,fused,ep", GRID, ids=lambda v: str(v))
def test_reference_matches_float64_oracle(mode, act, fused, ep):
    # zlib, not hash(): str hashes change per process (PYTHONHASHSEED), which made the cases differ run to run.
    seed = zlib.crc32(repr((mode, act, fused, ep)).encode()) % 1000
    case = make_case(mode, act, num_tokens=7, top_k=3, num_experts=8, ep=ep[0], rank=ep[1], seed=seed,
                     invalid_fraction=0.1)
    out = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    assert out.shape == (7, 128) and out.dtype == torch.bfloat16
    assert_matches_oracle(out, run_oracle(case, fused))


@settings(max_examples=25, deadline=None)
@example(mode="w4a4", act="relu2", fused=False, num_tokens=9, top_k=2, hidden=256, inter=256, seed=65536,
         invalid=0.0)  # one FC2-input code flipped by fp32 vs fp64 rounding (assert_matches_oracle)
@given(mode=st.sampled_from(list(MODES)), act=st.sampled_from(["swiglu", "relu2", "geglu_tanh"]),
       fused=st.booleans(), num_tokens=st.integers(1, 12), top_k=st.integers(1, 4),
       hidden=st.sampled_from([128, 256]), inter=st.sampled_from([128, 256]), seed=st.integers(0, 2 ** 16),
       invalid=st.sampled_from([0.0, 0.3, 1.0]))
def test_reference_property_random_layers(mode, act, fused, num_tokens, top_k, hidden, inter, seed, invalid):
    case = make_case(mode, act, num_tokens=num_tokens, top_k=top_k, num_experts=6, hidden=hidden, inter=inter,
                     seed=seed, invalid_fraction=invalid)
    out = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    expected = run_oracle(case, fused)
    if invalid == 1.0:
        assert torch.equal(out, torch.zeros_like(out)), "tokens with no local expert must be zero"
    else:
        assert_matches_oracle(out, expected, flipped_rows=1)


def test_non_local_slots_contribute_exactly_zero():
    full = make_case("w4a16", num_tokens=6, top_k=2, num_experts=8, ep=2, rank=1, seed=3)
    out = moe_ext.cute_dsl_fused_moe(**full.kwargs(use_fused_finalize=False))
    # Drop every non-local slot by hand: routing it to -1 instead must give the same bits.
    local = (full.ids >= full.offset) & (full.ids < full.offset + full.num_local)
    masked = moe_ext.cute_dsl_fused_moe(**full.kwargs(use_fused_finalize=False,
                                                      token_selected_experts=torch.where(local, full.ids, -1)))
    assert torch.equal(out, masked)
    all_remote = torch.zeros_like(full.ids)  # expert 0 belongs to rank 0
    zero = moe_ext.cute_dsl_fused_moe(**full.kwargs(token_selected_experts=all_remote))
    assert torch.equal(zero, torch.zeros_like(zero))


def flashinfer_check(out, ref, percent=0.97):
    """Semantics §6.1: >= 97% of elements within atol = max(0.05, 1.5 std(ref)) or relative error < 0.5."""
    atol = max(0.05, 1.5 * float(ref.std()))
    diff = (out.float() - ref).abs()
    ok = (diff < atol) | (diff / ref.abs().clamp_min(1e-12) < 0.5)
    return float(ok.float().mean()) >= percent


def fp32_unquantized_reference(case, fused=True):
    """FlashInfer's test reference: fp32 on the bf16 weights (and dequantized x for w4a4/w4a8), FC2 input
    quantize-dequantized like the kernel's mode, finalize in fp32."""
    from moe_ext.problem import build_problem
    from moe_ext.reference import dequantize_input, quantize_fc2_input

    problem = build_problem(**case.kwargs())
    x = dequantize_input(problem)
    if case.prepared.quant_mode == "w4a4" and case.quantized.per_token_scale is None:
        x = x / case.prepared.x_global_scale
    if case.quantized.per_token_scale is not None:
        x = x * case.quantized.per_token_scale[:, None]
    _, _, kind, params = ACTIVATIONS[case.act]
    out = torch.zeros(x.shape[0], case.bf16_w2.shape[1])
    for t in range(x.shape[0]):
        for k in range(case.ids.shape[1]):
            e = int(case.ids[t, k]) - case.offset
            if not 0 <= e < case.num_local:
                continue
            g = case.bf16_w1[e].float() @ x[t]
            if problem.activation.gated:
                half = g.shape[0] // 2
                h = problem.activation.apply(g[:half], g[half:])
            else:
                h = problem.activation.apply(None, g)
            # The FC2-input quantizer of the mode, with the global scale divided back out.
            hq, pts2 = quantize_fc2_input(problem, h[None])
            scale = 1.0 / float(problem.fc2_input_scale) if (problem.quant_mode == "w4a4" and pts2 is None) else 1.0
            hq = hq[0] * scale * (float(pts2[0]) if pts2 is not None else 1.0)
            out[t] += case.scales[t, k] * (case.bf16_w2[e].float() @ hq)
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("act", ["swiglu", "relu2", "swiglu_oai", "geglu_tanh"])
@pytest.mark.parametrize("fused", [True, False])
def test_flashinfer_acceptance_rule_against_unquantized_fp32(mode, act, fused):
    case = make_case(mode, act, num_tokens=16, top_k=2, num_experts=8, hidden=256, inter=256, seed=42)
    out = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    ref = fp32_unquantized_reference(case)
    assert flashinfer_check(out, ref)
    # The rule must be able to fail: a wrong answer (another layer's output) does not pass it.
    other = make_case(mode, act, num_tokens=16, top_k=2, num_experts=8, hidden=256, inter=256, seed=7)
    assert not flashinfer_check(moe_ext.cute_dsl_fused_moe(**other.kwargs()), ref)


def test_fused_and_deterministic_differ_only_by_rounding():
    case = make_case("w4a16", num_tokens=32, top_k=4, seed=5)
    fused = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=True)).float()
    det = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=False)).float()
    assert ((fused - det).norm() / det.norm()) < 1e-2


def test_routing_maps_follow_the_spec():
    from moe_ext.routing import compute_routing, max_num_tiles

    g = torch.Generator().manual_seed(0)
    ids, _ = routing(37, 4, 16, g, invalid_fraction=0.2)
    r = compute_routing(ids, 8, 4, 16)  # local experts 4..11
    local = ids - 4
    is_local = (local >= 0) & (local < 8)
    assert torch.equal(r.local_expert, torch.where(is_local, local, -1).int())
    assert torch.equal((r.expanded_to_permuted >= 0), is_local)
    assert r.permuted_to_expanded.numel() == max_num_tiles(37, 4, 8, 16) * 16
    rows = r.expanded_to_permuted[is_local].long()
    assert rows.unique().numel() == rows.numel()
    for e in range(8):
        start, count = int(r.expert_offsets[e]), int(r.expert_counts[e])
        assert start % 16 == 0
        block = r.permuted_to_expanded[start:start + count].long()
        assert torch.equal(local.reshape(-1)[block], torch.full((count,), e))
        assert torch.equal(block, block.sort().values), "rows of one expert keep expanded order"
    assert torch.equal(r.permuted_to_expanded[r.expanded_to_permuted[is_local].long()].long(),
                       torch.nonzero(is_local.reshape(-1)).reshape(-1))
    live = int(r.num_live_tiles)
    assert live == int(((r.expert_counts + 15) // 16).sum())
    for tile in range(live):
        e = int(r.tile_to_expert[tile])
        assert int(r.expert_offsets[e]) <= tile * 16 < int(r.expert_offsets[e + 1])
        assert int(r.tile_to_mn_limit[tile]) == min(int(r.expert_offsets[e]) + int(r.expert_counts[e]),
                                                    (tile + 1) * 16)
