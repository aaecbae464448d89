"""The sm_90a kernels end to end against the reference on the same GPU: every quant mode and activation, both
finalize modes, expert parallelism, poisoned outputs, CUDA-graph replays and torch.compile. Skipped without an
H100/H200 or without the kernels linked into moe_ext._C.

Gates (issue 3): relative L2 error vs the reference <= 5e-3 for w4a16 and <= 2e-2 for w4a4/w4a8, where the
kernels' fast ex2/rcp and their summation order can move an FC2-input value across a rounding point."""

import dataclasses

import pytest
import torch
from conftest import (ACTS, GRID_FACTORS, TOLERANCE, forward_in_fresh_buffers, gpu, grid_allowed, hopper_kernels,
                      kernel_fc2_input_per_token, make_case, reference_and_gate, rel_l2, replays_with_new_inputs)

import moe_ext
from moe_ext import launcher
from moe_ext.backends import HOPPER, backend_for
from moe_ext.problem import build_problem
from moe_ext.quant.block import nvfp4_dequantize
from moe_ext.reference import reference_moe

pytestmark = [
    pytest.mark.gpu, gpu, hopper_kernels,
]

W, WW = launcher.WGMMA, launcher.WGMMA_WIDE  # the wgmma GEMMs' k_splits
PADDED = launcher.PADDED_WGMMA_TILE


def check_against_reference(case, fused, every_tile=True, **over):
    kw = case.kwargs(use_fused_finalize=fused, **over)
    problem = build_problem(**kw)
    assert backend_for(problem) is HOPPER
    expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
    outs = []
    tiles = sorted({t[0] for t in HOPPER.tactics(problem) if t[0] in launcher.TOKEN_TILES
                    and t[1] in launcher.K_SPLITS})  # the streaming ones
    # every routing tile unsplit, and cluster split-K on both GEMMs with both tiles
    chosen = [(t, 1, 1) for t in tiles] + [(tiles[0], 4, 2), (tiles[-1], 2, 4)]
    if not every_tile:  # the smallest tile unsplit and the largest split: both kernels' paths, half the runs
        chosen = [(tiles[0], 1, 1), (tiles[-1], 2, 4)]
    wgmma = [t for t in [(launcher.WGMMA_TILE, W, W), (launcher.WIDE_WGMMA_TILE, W, W), (launcher.WGMMA_TILE, WW, WW),
                         (PADDED, W, W), (PADDED, W, WW)]
             + [(t, s, s) for t in launcher.NARROW_WGMMA_TILES for s in (W, WW)]
             if t in HOPPER.tactics(problem)]  # the wgmma GEMMs (both)
    # Past SLAB_MAX_TOKENS the streaming tactics whose GEMM1 reads token slabs are not offered.
    slab_tiles_gone = problem.num_tokens > launcher.SLAB_MAX_TOKENS and launcher.reads_slabs(problem.kernel_mode, 32, 1)
    assert (launcher.WGMMA_TILE, W, W) in wgmma, "every mode links the wgmma GEMMs"  # and the 256 ones, when built
    assert {(32, W, W), (64, W, W)} <= set(wgmma), "every mode links the 32- and 64-token wgmma GEMMs"
    chosen += wgmma
    C = launcher.THREE_CTAS  # the three-CTA forms: both GEMMs, and each beside a K split; 32-token tiles too
    three = [(8, C, C), (8, C, 2), (8, 4, C)] + ([] if slab_tiles_gone else [(32, C, C)])
    assert all(t in HOPPER.tactics(problem) for t in three), "every mode links the three-CTA form"
    chosen += three if every_tile else three[:1]
    persistent = (16, 2, launcher.PERSISTENT)  # beside a GEMM1 K split; w4a4_pt's alone: the others' 16-token
    if case.mode == "w4a4_pt" and 16 in tiles:  # FC2 input is token slabs, which its mainloop does not read
        assert persistent in HOPPER.tactics(problem), "the build links the persistent GEMM2"
        chosen.append(persistent)
    for tactic in chosen:
        poisoned = torch.full_like(expected, float("nan"))
        out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=poisoned, tactic=tactic)
        assert torch.isfinite(out).all(), f"every output element must be written (tile {tactic})"
        assert rel_l2(out, expected) <= gate, (tactic, rel_l2(out, expected), gate)
        if not fused:
            again = moe_ext.cute_dsl_fused_moe(**kw, tactic=tactic)
            assert torch.equal(again, out), "deterministic finalize must be bitwise reproducible"
        outs.append(out)
    assert len(tiles) == len(launcher.TOKEN_TILES) - (len(launcher.SLAB_TILES) if slab_tiles_gone else 0)
    return outs[0]


GRID = [(m, a) for m in ("w4a16", "w4a4", "w4a4_pt", "w4a8") for a in ACTS if not (m == "w4a8" and "situ" in a)]


@pytest.mark.parametrize("mode,act", GRID, ids=str)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (128, 8), (515, 8)])
def test_kernels_match_reference(mode, act, fused, tokens, top_k):
    case = make_case(mode, act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=256, inter=512,
                     seed=tokens + top_k, invalid_fraction=0.05).to("cuda")
    check_against_reference(case, fused)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_pt", "w4a8"])
@pytest.mark.parametrize("shape", [(1024, 2048), (2048, 768), (4096, 1536), (7168, 2048)], ids=str)
@pytest.mark.parametrize("ep_rank", [(1, 0), (8, 0), (8, 3), (8, 7)], ids=str)
def test_kernels_shapes_and_expert_parallelism(mode, shape, ep_rank):
    hidden, inter = shape
    ep, rank = ep_rank
    case = make_case(mode, "swiglu", num_tokens=37, top_k=8, num_experts=32, hidden=hidden, inter=inter, ep=ep,
                     rank=rank, seed=ep * 10 + rank, weight_scale=0.02).to("cuda")
    for fused in (True, False):
        check_against_reference(case, fused)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_pt", "w4a8"])
def test_kernels_large_token_count(mode):
    """T = 4096 with top-k 8 over 64 experts: every tile full, many tiles per expert."""
    case = make_case(mode, "swiglu", num_tokens=4096, top_k=8, num_experts=64, hidden=512, inter=256, seed=5,
                     invalid_fraction=0.02).to("cuda")
    check_against_reference(case, fused=False)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_streaming_ring_with_odd_step_counts_and_every_k_split(mode):
    """The streaming mainloop takes its K steps in whole passes over the ring (unrolled), then whole groups of
    stages_per_wait, then single steps: gpt-oss's padded hidden size 2944 is 23 steps of 128 (GEMM1: 11 groups of
    two, a single step), and an intermediate size of 384 gives GEMM2 3 steps, which a split of 4 leaves one CTA of
    the cluster none. Every streaming tile with each K split and the three-CTA forms, against the reference."""
    case = make_case(mode, "swiglu", num_tokens=37, top_k=4, num_experts=8, hidden=2944, inter=384, seed=11,
                     weight_scale=0.02).to("cuda")
    kw = case.kwargs(use_fused_finalize=False)
    problem = build_problem(**kw)
    expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
    C = launcher.THREE_CTAS
    chosen = [(t, s, s) for t in launcher.TOKEN_TILES for s in launcher.K_SPLITS]
    chosen += [(8, C, C), (32, C, C), (8, C, 4), (8, 2, C)]
    for tactic in chosen:
        assert tactic in HOPPER.tactics(problem), tactic
        out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=torch.full_like(expected, float("nan")), tactic=tactic)
        assert torch.isfinite(out).all(), tactic
        assert rel_l2(out, expected) <= gate, (tactic, rel_l2(out, expected), gate)


def case_with_expert_rows(mode: str, rows: list, seed: int):
    """A top-1 case on the GPU whose local expert e routes rows[e] tokens (in shuffled token order); one more expert
    gets none."""
    tokens = sum(rows)
    case = make_case(mode, "swiglu", num_tokens=tokens, top_k=1, num_experts=len(rows) + 1, hidden=256, inter=256,
                     seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))[torch.randperm(tokens, generator=g)]
    return dataclasses.replace(case, ids=ids.view(tokens, 1).to(torch.int32)).to("cuda")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_pt", "w4a8"])
def test_part_filled_routing_tiles_at_their_edges(mode):
    """Experts whose rows leave an expert's last routing tile holding 1, 17, 32 / 33, 64 / 65 or 128 rows (and
    129, 160, 193: a second tile), on every tactic: padding rows of a tile must never reach an output row."""
    case = case_with_expert_rows(mode, [1, 17, 32, 33, 64, 65, 128, 129, 160, 193], seed=3)
    for fused in (True, False):
        check_against_reference(case, fused, every_tile=False)


@pytest.mark.parametrize("shape", [(7168, 384), (2048, 640), (1024, 2048), (2944, 2944)], ids=str)
def test_persistent_gemm2_equals_the_unsplit_one_bit_for_bit(shape):
    """The persistent 16-token GEMM2 (GEMM2's tactic launcher.PERSISTENT; w4a4_pt's, whose 16-token FC2 input is
    row-major) takes the same K steps of each item in the same order as the unsplit streaming GEMM2, so the
    deterministic finalize's output is the same bits; fused, it matches the reference. K = 3, 5, 16 and 23 steps
    (padding in the first copies, in the last pass, none, one stage), and 56 x ~20 items at H = 7168: more items
    than the 396 persistent CTAs, so CTAs take several."""
    hidden, inter = shape
    case = make_case("w4a4_pt", "swiglu", num_tokens=64, top_k=4, num_experts=16, hidden=hidden, inter=inter,
                     seed=hidden + inter, weight_scale=0.02, invalid_fraction=0.05).to("cuda")
    expected, gate = reference_and_gate(build_problem(**case.kwargs(use_fused_finalize=True)), TOLERANCE["w4a4_pt"])
    outs = {}
    for split2 in (1, launcher.PERSISTENT):
        for fused in (False, True):
            kw = case.kwargs(use_fused_finalize=fused)
            assert (16, 1, split2) in HOPPER.tactics(build_problem(**kw)), "the build links the persistent GEMM2"
            out = moe_ext.cute_dsl_fused_moe(**kw, tactic=(16, 1, split2),
                                             moe_output=torch.full_like(expected, float("nan")))
            assert torch.isfinite(out).all(), (split2, fused)
            outs[split2, fused] = out
    assert torch.equal(outs[launcher.PERSISTENT, False], outs[1, False])
    assert rel_l2(outs[launcher.PERSISTENT, True], expected) <= gate


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_pt", "w4a8"])
def test_padded_wgmma_tile_at_its_edges(mode):
    """The 144-row routing tile (one m64n144 wgmma block; its epilogue covers rows 128-143 in a second pass), GEMM2
    with 128 and with 256 weight rows: experts of 1, 16, 17, 127, 128, 143, 144, 145, 160, 288 and 289 rows, against
    the reference, both finalizes."""
    case = case_with_expert_rows(mode, [1, 16, 17, 127, 128, 143, 144, 145, 160, 288, 289], seed=9)
    for fused in (True, False):
        kw = case.kwargs(use_fused_finalize=fused)
        problem = build_problem(**kw)
        expected, gate = reference_and_gate(problem, TOLERANCE[case.mode])
        for tactic in ((PADDED, W, W), (PADDED, W, WW)):  # GEMM2 with 128 and 256 weight rows
            assert tactic in HOPPER.tactics(problem), "the build links the 144-row wgmma GEMMs"
            out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=torch.full_like(expected, float("nan")), tactic=tactic)
            assert torch.isfinite(out).all(), tactic
            assert rel_l2(out, expected) <= gate, (tactic, fused, rel_l2(out, expected), gate)


@pytest.mark.parametrize("kind", ["swiglu", "relu2"])
@pytest.mark.parametrize("tactic", [(tile, W, W) for tile in (64, launcher.WGMMA_TILE, PADDED)]
                         + [(launcher.WGMMA_TILE, WW, WW)], ids=str)
def test_wgmma_gemm1_writes_its_padding_rows_as_zeros(tactic, kind):
    """On 64-, 128- and 144-token tiles the wgmma GEMM1 stores the padding rows of its FC2 input as zeros (its own
    padding token rows are zero-filled too), so the wgmma GEMM2 multiplies zeros there: padding then draws less
    power, which the forwards at the H200's power cap run faster for (WgmmaConfig.zero_padding). No output depends
    on it."""
    case = make_case("w4a16", kind, num_tokens=300, top_k=2, num_experts=8, hidden=256, inter=256, seed=6).to("cuda")
    problem = build_problem(**case.kwargs())
    I, tile = problem.intermediate_size, tactic[0]
    routing, buffers = forward_in_fresh_buffers(problem, tile, tactic[1:], intermediate_fill=3.0)
    live = int(routing.num_live_tiles.item()) * tile
    h = buffers.intermediate_bf16[:live * I].view(live, I)
    padding = routing.permuted_to_expanded[:live] < 0
    assert padding.any(), "the case must leave padding rows in its live tiles"
    assert (h[padding] == 0).all()
    assert (h[~padding] != 3.0).any(dim=1).all(), "every live row written"


@pytest.mark.parametrize("act,shape,ep_rank,tokens,top_k", [
    ("swiglu", (256, 512), (1, 0), 128, 8),
    ("situ", (1024, 2048), (1, 0), 1, 2),  # the grid's failing shape while the reference used exact reciprocals
    ("swiglu_oai", (1024, 2048), (8, 3), 37, 8),
    ("geglu_tanh", (2048, 768), (1, 0), 515, 2),
], ids=str)
def test_per_token_fc2_quantization_is_the_reference_quantizer_bit_for_bit(act, shape, ep_rank, tokens, top_k,
                                                                        monkeypatch):
    """Semantics §2.4b: the kernels quantize their own bf16 h with rcp.approx reciprocals and keep it decoded (code
    * SF, which GEMM2 reads); the reference quantizer, given that h, must give the same values and row scales."""
    hidden, inter = shape
    case = make_case("w4a4_pt", act, num_tokens=tokens, top_k=top_k, num_experts=16, hidden=hidden, inter=inter,
                     ep=ep_rank[0], rank=ep_rank[1], seed=tokens * 10 + top_k, weight_scale=0.02).to("cuda")
    stages = kernel_fc2_input_per_token(build_problem(**case.kwargs()), monkeypatch)
    assert stages["expanded"].numel() > 0
    ref = stages["ref"]
    assert torch.equal(stages["row_scale"], ref.row_scale.reshape(stages["row_scale"].shape))
    assert torch.equal(stages["decoded"].float(), nvfp4_dequantize(ref.data, ref.scale))
    assert not torch.equal(stages["decoded"], stages["h"])  # the quantizer ran: e2m1 codes cannot hold every h


def test_unsupported_shape_falls_back_to_the_reference_with_a_warning():
    case = make_case("w4a16", num_tokens=3, hidden=256, inter=64).to("cuda")
    problem = build_problem(**case.kwargs())
    with pytest.warns(UserWarning, match="I % 128"):
        assert backend_for(problem) is not HOPPER


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a8"])
@pytest.mark.parametrize("T", [40, 160])
def test_wrapper_graph_capture_replays_with_new_routing(mode, T):
    """40 tokens (10 rows per expert) run the streaming GEMMs, 160 (40 rows) the wgmma ones: in w4a4 / w4a8 the
    routing launch then decodes the new activations of each replay."""
    E, K, H, I = 32, 8, 512, 256
    base = make_case(mode, num_tokens=T, top_k=K, num_experts=E, hidden=H, inter=I, seed=0).to("cuda")
    wgmma = any(launcher.is_wgmma(split) for split in HOPPER.default_tactic(build_problem(**base.kwargs()))[1:])
    assert wgmma == (T == 160)
    for fused in (False, True):
        wrapper = moe_ext.CuteDslMoEWrapper(E, K, H, I, use_cuda_graph=True, max_num_tokens=T, quant_mode=mode,
                                            device="cuda", use_fused_finalize=fused)
        for step, captured, eager in replays_with_new_inputs(wrapper, base, fused):
            if fused:  # bf16 atomic adds: the order of the K contributions may differ (semantics §2.6)
                assert rel_l2(captured, eager) <= 5e-3, step
            else:
                assert torch.equal(captured, eager), f"replay {step} differs from the eager run"


def test_op_under_torch_compile_reduce_overhead():
    torch._dynamo.reset()
    case = make_case("w4a16", num_tokens=16, top_k=2, hidden=256, inter=256).to("cuda")
    p = case.prepared

    def layer(x, ids, scales):
        return torch.ops.moe.fused(x * 1.0, None, ids, scales, p.w1_weight, p.w1_weight_sf, p.w1_alpha, None,
                                   p.w2_weight, p.w2_weight_sf, p.w2_alpha, case.num_experts, 2,
                                   quant_mode="w4a16", use_fused_finalize=False)

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    x, ids, scales = case.quantized.x, case.ids, case.scales
    expected = layer(x, ids, scales)
    for _ in range(3):
        got = compiled(x, ids, scales)
    assert torch.equal(got, expected)


def test_weights_over_2_gib_are_addressed_with_64_bit_offsets():
    """DeepSeek-V3 with all 256 experts on one GPU: w1 holds 3.76e9 bytes, past int32 indexing. Tokens are
    routed to the last experts, whose rows lie beyond 2^31 bytes."""
    E, K, H, I = 256, 8, 7168, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    u8 = dict(dtype=torch.uint8, device="cuda", generator=g)
    w1 = torch.randint(0, 256, (E, 2 * I, H // 2), **u8)
    w2 = torch.randint(0, 256, (E, H, I // 2), **u8)
    assert w1.numel() > 2 ** 31
    # e4m3 scales between 2^-5 and 2^-3 keep the sums of random e2m1 codes in a moderate range.
    sf1 = torch.randint(0x10, 0x20, (moe_ext.quant.swizzled_size(E, 2 * I, H // 16),), **u8)
    sf2 = torch.randint(0x10, 0x20, (moe_ext.quant.swizzled_size(E, H, I // 16),), **u8)
    ids = torch.tensor([list(range(248, 256)), list(range(8)), list(range(128, 136)), [255, 0, 200, 100, 50, 25, 12, 6]],
                       dtype=torch.int32, device="cuda")
    alpha = torch.ones(E, device="cuda")
    kw = dict(x=(torch.randn(4, H, device="cuda", generator=g) * 0.1).bfloat16(), x_sf=None,
              token_selected_experts=ids, token_final_scales=torch.full((4, K), 1.0 / K, device="cuda"),
              w1_weight=w1, w1_weight_sf=sf1, w1_alpha=alpha, fc2_input_scale=None, w2_weight=w2, w2_weight_sf=sf2,
              w2_alpha=alpha, num_experts=E, top_k=K, quant_mode="w4a16", use_fused_finalize=False)
    problem = build_problem(**kw)
    assert backend_for(problem) is HOPPER
    expected = reference_moe(problem)
    out = moe_ext.cute_dsl_fused_moe(**kw)
    assert torch.isfinite(out).all()
    assert rel_l2(out, expected) <= 5e-3, rel_l2(out, expected)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a8"])
@pytest.mark.parametrize("act", ["swiglu", "relu2", "swiglu_oai", "geglu_tanh"])
@pytest.mark.parametrize("fused", [True, False])
def test_flashinfer_acceptance_rule_on_the_kernels(mode, act, fused):
    """Semantics §6.1 on the GPU: the kernels' output against fp32 on the unquantized weights, with a negative
    control showing the rule can fail."""
    from test_reference import flashinfer_check, fp32_unquantized_reference

    case = make_case(mode, act, num_tokens=16, top_k=2, num_experts=8, hidden=256, inter=256, seed=42)
    gpu_case = case.to("cuda")
    kw = gpu_case.kwargs(use_fused_finalize=fused)
    assert backend_for(build_problem(**kw)) is HOPPER
    out = moe_ext.cute_dsl_fused_moe(**kw).cpu()
    ref = fp32_unquantized_reference(case)
    assert flashinfer_check(out, ref)
    other = make_case(mode, act, num_tokens=16, top_k=2, num_experts=8, hidden=256, inter=256, seed=7).to("cuda")
    assert not flashinfer_check(moe_ext.cute_dsl_fused_moe(**other.kwargs()).cpu(), ref)


def test_fused_finalize_zeroes_the_output_on_an_aux_stream():
    """With aux_stream the output memset runs there, overlapping GEMM1, and GEMM2 waits for it: a poisoned output
    is fully overwritten and the result matches the in-order memset (up to the atomic order)."""
    case = make_case("w4a4", num_tokens=33, top_k=8, num_experts=32, hidden=1024, inter=512, seed=4).to("cuda")
    kw = case.kwargs(use_fused_finalize=True)
    in_order = moe_ext.cute_dsl_fused_moe(**kw)
    poisoned = torch.full_like(in_order, float("nan"))
    aux = torch.cuda.Stream()
    out = moe_ext.cute_dsl_fused_moe(**kw, moe_output=poisoned, aux_stream=aux)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_l2(out, in_order) <= 5e-3


def pairwise_cases(factors: dict, allowed) -> list[dict]:
    """A deterministic greedy covering array: every pair of values of every two factors appears in some case
    (restricted to allowed combinations), in far fewer cases than the full product."""
    import itertools

    names = list(factors)
    uncovered = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        for va in factors[a]:
            for vb in factors[b]:
                if allowed({a: va, b: vb}):
                    uncovered.add((i, va, j, vb))
    cases = []
    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    candidates = [c for c in candidates if allowed(c)]
    while uncovered:
        def gain(case):
            return sum((i, case[a], j, case[b]) in uncovered
                       for (i, a), (j, b) in itertools.combinations(enumerate(names), 2))
        best = max(candidates, key=gain)
        cases.append(best)
        uncovered -= {(i, best[a], j, best[b]) for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)}
    return cases


# The correctness grid of issue 3 (conftest.GRID_FACTORS), covered pairwise here; scripts/correctness_grid.py runs
# all of it.
PAIRWISE = pairwise_cases(GRID_FACTORS, grid_allowed)


@pytest.mark.parametrize("grid", PAIRWISE, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_kernels_pairwise_grid(grid):
    hidden, inter = grid["shape"]
    ep, rank = grid["ep"]
    case = make_case(grid["mode"], grid["act"], num_tokens=grid["tokens"], top_k=grid["top_k"], num_experts=16,
                     hidden=hidden, inter=inter, ep=ep, rank=rank, seed=len(PAIRWISE),
                     invalid_fraction=0.03, weight_scale=0.02).to("cuda")
    check_against_reference(case, grid["fused"], every_tile=False)
