"""Token buckets, the autotune() context manager, the tactic cache and its file."""
import json

import pytest
import torch
from conftest import decode_problem, make_case

import moe_ext
from moe_ext.backends import op_key
from moe_ext.problem import build_problem
from moe_ext.tuning import AutoTuner, ProfilingRun, autotune, bucket_list, token_bucket


@pytest.mark.parametrize("tokens,bucket", [(1, 1), (2, 2), (3, 4), (129, 256), (256, 256), (257, 512), (2048, 2048),
                                           (2049, 2560), (4000, 4096), (4097, 8192), (16384, 16384)])
def test_token_buckets_round_up(tokens, bucket):
    assert token_bucket(tokens) == bucket


def test_bucket_list_covers_every_t():
    buckets = bucket_list(5000)
    assert buckets[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets[-1] == 8192 and 2560 in buckets and 3072 in buckets
    assert all(token_bucket(t) in buckets for t in range(1, 5001, 7))


@pytest.fixture
def tuner():
    t = AutoTuner.get()
    saved = dict(t.cache)
    t.cache.clear()
    yield t
    t.cache.clear()
    t.cache.update(saved)


def test_choose_profiles_candidates_once_per_key_and_caches_the_fastest(tuner):
    calls = []

    def run(tactic):
        calls.append(tactic)
        if tactic == (2,):
            sum(range(200000))  # the slow candidate

    key = ("op", "mode", 8)
    with autotune(True):
        assert tuner.choose(key, [(1,), (2,)], (2,), lambda: ProfilingRun(run), torch.device("cpu")) == (1,)
    assert set(calls) == {(1,), (2,)}
    calls.clear()
    # Cached: no profiling, inside or outside autotune.
    assert tuner.choose(key, [(1,), (2,)], (2,), lambda: ProfilingRun(run), torch.device("cpu")) == (1,)
    with autotune(True):
        assert tuner.choose(key, [(1,), (2,)], (2,), lambda: ProfilingRun(run), torch.device("cpu")) == (1,)
    assert calls == []
    # Not tuning and nothing cached: the backend's default, no profiling.
    assert tuner.choose(("other",), [(1,), (2,)], (2,), lambda: ProfilingRun(run), torch.device("cpu")) == (2,)
    assert calls == []


def test_cache_file_persists_across_restarts(tuner, tmp_path):
    path = tmp_path / "tactics.json"
    with autotune(True, cache=path):
        tuner.choose(("k", 1), [(3,), (4,)], (4,), lambda: ProfilingRun(lambda t: None), torch.device("cpu"))
    data = json.loads(path.read_text())
    assert data["version"] == 2 and len(data["entries"]) == 1
    tuner.cache.clear()
    with autotune(False, cache=path):
        assert tuner.lookup(("k", 1)) in ((3,), (4,))


def test_a_version_1_cache_file_is_dropped_with_a_warning_and_rewritten(tuner, tmp_path):
    """Version 1 keys have no card in them: their points retune rather than reuse another card's picks."""
    path = tmp_path / "tactics.json"
    path.write_text(json.dumps({"version": 1, "entries": [{"key": repr(("k", 1)), "tactic": [3]}]}))
    with pytest.warns(UserWarning, match="version 1 tuning cache"):
        with autotune(False, cache=path):
            assert tuner.lookup(("k", 1)) is None
    assert json.loads(path.read_text()) == {"version": 2, "entries": []}
    path.write_text(json.dumps({"version": 7, "entries": []}))
    with pytest.raises(ValueError, match="unknown tuning cache version 7"):
        tuner.load(str(path))


def test_key_separates_cards(monkeypatch):
    """The same layer and bucket on an H100 and an H200 are two cache entries (their fastest tactics differ)."""
    from moe_ext import tuning

    problem = build_problem(**make_case("w4a16", num_tokens=5).kwargs())
    on_cpu = op_key(problem, moe_ext.backends.REFERENCE, "op")
    assert on_cpu[2] == ("cpu",)
    cards = {0: ("NVIDIA H100 80GB HBM3", 132), 1: ("NVIDIA H200", 132)}
    monkeypatch.setattr(tuning, "_cuda_signature", cards.get)
    assert [tuning.device_signature(torch.device("cuda", i)) for i in cards] == list(cards.values())
    keys = set()
    for card in cards.values():
        monkeypatch.setattr(moe_ext.backends, "device_signature", lambda device, card=card: card)
        keys.add(op_key(problem, moe_ext.backends.REFERENCE, "op"))
    assert len(keys) == 2 and on_cpu not in keys
    assert {k[:2] + k[3:] for k in keys} == {on_cpu[:2] + on_cpu[3:]}  # the card is all that differs


def test_key_separates_quant_mode_activation_and_bucket():
    a = build_problem(**make_case("w4a4", num_tokens=5).kwargs())
    b = build_problem(**make_case("w4a4", "swiglu_oai", num_tokens=5).kwargs())
    c = build_problem(**make_case("w4a4", num_tokens=9).kwargs())
    d = build_problem(**make_case("w4a16", num_tokens=5).kwargs())
    keys = {op_key(p, moe_ext.backends.REFERENCE, "op") for p in (a, b, c, d)}
    assert len(keys) == 4
    assert op_key(a, moe_ext.backends.REFERENCE, "op")[-1] == 8


def test_autotune_on_the_api_records_a_tactic_and_explicit_tactic_is_used(tuner):
    case = make_case("w4a16", num_tokens=5)
    with autotune(True):
        expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    assert torch.equal(moe_ext.cute_dsl_fused_moe(**case.kwargs(tactic=(128,))), expected)
    with pytest.raises(ValueError, match="valid tactics"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(tactic=(256, ((128, 128), (1, 1), False))))


def test_hopper_default_tactic_splits_k_only_when_few_ctas_would_run():
    from moe_ext import launcher

    tiles = (8, 64)
    # DeepSeek-V3 EP8 at T=1: about one local expert hit (1.5 with the margin): 48 (GEMM1) / 84 (GEMM2) CTAs.
    assert launcher.default_tactic(1, 8, 256, 32, 4096, 7168, tiles, 132) == (8, 2, 1)
    # Qwen3-30B-A3B at T=1: 8 experts x 12 / 16 CTAs already fill the GPU.
    assert launcher.default_tactic(1, 8, 128, 128, 1536, 2048, tiles, 132) == (8, 1, 1)
    # Mixtral at T=1: at most 2 experts hit; GEMM2 has 2 x 32 CTAs -> split 2.
    assert launcher.default_tactic(1, 2, 8, 8, 28672, 4096, tiles, 132) == (8, 1, 2)
    # Prefill: the large tile, no split.
    assert launcher.default_tactic(4096, 8, 256, 256, 4096, 7168, tiles, 132) == (64, 1, 1)
    assert len(launcher.tactics(tiles)) == len(tiles) * len(launcher.K_SPLITS) ** 2
    # With every tile: the 128-token one only where an expert's rows fill it (128 per expert at T=4096 on
    # DeepSeek-V3, 1024 on Mixtral); 32 per expert (T=1024) stays on 64; below, room for twice the average rows.
    tiles = launcher.TOKEN_TILES
    assert launcher.default_tactic(4096, 8, 256, 256, 4096, 7168, tiles, 132)[0] == 128
    assert launcher.default_tactic(4096, 2, 8, 8, 28672, 4096, tiles, 132)[0] == 128
    assert launcher.default_tactic(1024, 8, 256, 256, 4096, 7168, tiles, 132)[0] == 64
    assert launcher.default_tactic(1, 8, 256, 256, 4096, 7168, tiles, 132)[0] == 8
    # At 2 rows per expert room for twice them is an 8-token tile, but GEMM1's 8192 expected CTAs (62 an SM) take
    # the 16-token mainloop (SIXTEEN_OVER_EIGHT_WAVES); EP8 at T=8 (345 CTAs) keeps 8, as Mixtral at T=1 (448).
    assert launcher.default_tactic(64, 8, 256, 256, 4096, 7168, tiles, 132) == (16, 1, 1)
    assert launcher.default_tactic(8, 8, 256, 32, 4096, 7168, tiles, 132)[0] == 8
    assert launcher.default_tactic(1, 2, 8, 8, 28672, 4096, tiles, 132)[0] == 8
    assert launcher.default_tactic(64, 8, 256, 256, 4096, 7168, tiles[:1] + tiles[2:], 132)[0] == 8  # no 16 linked
    assert launcher.default_tactic(256, 8, 256, 256, 4096, 7168, tiles, 132)[0] == 16  # 8
    assert launcher.default_tactic(256, 8, 128, 128, 1536, 2048, tiles, 132)[0] == 32  # 16
    # With the wgmma GEMMs linked, unsplit 128-token tiles run them; decode keeps the streaming kernels.
    W = launcher.WGMMA
    assert launcher.default_tactic(4096, 8, 256, 256, 4096, 7168, tiles, 132, wgmma=True) == (128, W, W)
    assert launcher.default_tactic(4096, 2, 8, 8, 28672, 4096, tiles, 132, wgmma=True) == (128, W, W)
    assert launcher.default_tactic(1, 8, 256, 32, 4096, 7168, tiles, 132, wgmma=True) == (8, 2, 1)
    # ... and from 32 rows per expert on (WGMMA_MIN_ROWS); at 16, without the narrow wgmma tiles, the streaming ones.
    assert launcher.WGMMA_MIN_ROWS == 32
    assert launcher.default_tactic(1024, 8, 256, 256, 4096, 7168, tiles, 132, wgmma=True) == (128, W, W)
    assert launcher.default_tactic(1024, 8, 256, 32, 4096, 7168, tiles, 132, wgmma=True) == (128, W, W)
    assert launcher.default_tactic(512, 8, 256, 32, 4096, 7168, tiles, 132, wgmma=True)[0] == 32
    assert launcher.default_tactic(64, 2, 8, 8, 28672, 4096, tiles, 132, wgmma=True)[0] == 32  # Mixtral T=64
    assert launcher.default_tactic(256, 8, 256, 32, 4096, 7168, tiles, 132, wgmma=True)[0] == 16
    # Both GEMMs take the wgmma kernels or neither does (their token operands are in the wgmma K order), and only
    # where neither would split K.
    assert set(launcher.tactics(tiles, wgmma=True)) - set(launcher.tactics(tiles)) == {(128, W, W)}
    assert all(launcher.is_wgmma(a) == launcher.is_wgmma(b) for _, a, b in launcher.tactics(tiles, wgmma=True))
    # 8 experts x 32 rows: GEMM2's 8 x 8 CTAs split K, so both GEMMs stream.
    assert launcher.default_tactic(256, 1, 8, 8, 2048, 1024, tiles, 132, True) == (128, 1, 2)
    # The 256-token tile runs only the wgmma GEMMs, both, and is the default from 512 rows per expert on (Mixtral
    # at T=4096: 1024); 128 rows per expert (DeepSeek-V3 at T=4096) stay on 128.
    with_256 = tiles + (launcher.WIDE_WGMMA_TILE,)
    assert set(launcher.tactics(with_256, wgmma=True)) - set(launcher.tactics(tiles, wgmma=True)) == {(256, W, W)}
    assert set(launcher.tactics(with_256, wgmma=True)) - set(launcher.tactics(tiles)) == {(128, W, W), (256, W, W)}
    assert launcher.tactics(with_256) == launcher.tactics(tiles)  # without the wgmma GEMMs linked, no 256 tactic
    assert launcher.default_tactic(4096, 2, 8, 8, 28672, 4096, with_256, 132, wgmma=True) == (256, W, W)
    assert launcher.default_tactic(4096, 8, 256, 256, 4096, 7168, with_256, 132, wgmma=True) == (128, W, W)
    assert launcher.default_tactic(4096, 2, 8, 8, 28672, 4096, with_256, 132)[0] == 128  # no wgmma: streaming
    # 256-row weight tiles (WGMMA_WIDE): on 128-token tiles, for the GEMMs whose weight rows allow them, with the
    # other GEMM on a wgmma kernel too; the default wherever both GEMMs run wgmma on 128-token tiles.
    WW = launcher.WGMMA_WIDE
    both = set(launcher.tactics(tiles, True, wide=(True, True))) - set(launcher.tactics(tiles, True))
    assert both == {(128, WW, W), (128, W, WW), (128, WW, WW)}
    assert set(launcher.tactics(tiles, True, wide=(False, True))) - set(launcher.tactics(tiles)) == {
        (128, W, W), (128, W, WW)}
    assert launcher.tactics(tiles, wide=(True, True)) == launcher.tactics(tiles)  # no wgmma linked
    dsv3 = (4096, 8, 256, 256, 4096, 7168, tiles, 132, True)
    assert launcher.default_tactic(*dsv3) == (128, W, W)  # wide=(False, False): nothing allows them
    assert launcher.default_tactic(*dsv3, wide=(True, True)) == (128, WW, WW)
    assert launcher.default_tactic(*dsv3, wide=(True, False)) == (128, WW, W)
    # ... never where a GEMM splits K, on the 256-token tile, or in decode's streaming tiles
    assert launcher.default_tactic(256, 1, 8, 8, 2048, 1024, tiles, 132, True, wide=(True, True)) == (128, 1, 2)
    assert launcher.default_tactic(4096, 2, 8, 8, 28672, 4096, with_256, 132, True, wide=(True, True)) == (256, W, W)
    assert launcher.default_tactic(1, 8, 256, 32, 4096, 7168, tiles, 132, True, wide=(True, True)) == (8, 2, 1)


def test_narrow_wgmma_tiles_run_both_gemms_on_wgmma_in_every_weight_width():
    """NARROW_WGMMA_TILES: the wgmma GEMMs on 32- and 64-token routing tiles (one m64n32 / m64n64 block), both
    GEMMs, each in the weight widths `wide` allows; offered only with the 128-token wgmma forward linked too."""
    from moe_ext import launcher

    W, WW = launcher.WGMMA, launcher.WGMMA_WIDE
    narrow = launcher.NARROW_WGMMA_TILES
    assert narrow == (32, 64)
    tiles = launcher.TOKEN_TILES
    assert launcher.gemm1_kernel("w4a16", "swiglu", 64, W) == "moe_gemm1_w4a16_swiglu_t64_wgmma"
    assert launcher.gemm2_kernel("w4a4", 64, WW) == "moe_gemm2_w4a16_t64_wgmma_n256"
    assert launcher.gemm2_kernel("w4a4", 32, WW) == "moe_gemm2_w4a16_t32_wgmma_n256"
    added = set(launcher.tactics(tiles, True, narrow_wgmma=narrow)) - set(launcher.tactics(tiles, True))
    assert added == {(32, W, W), (64, W, W)}
    wide = set(launcher.tactics(tiles, True, wide=(True, True), narrow_wgmma=(64,))) - set(
        launcher.tactics(tiles, True, wide=(True, True)))
    assert wide == {(64, W, W), (64, WW, W), (64, W, WW), (64, WW, WW)}
    assert launcher.tactics(tiles, narrow_wgmma=narrow) == launcher.tactics(tiles)  # no 128-token wgmma forward
    # The default: 64-token wgmma tiles where experts average 32-63 rows (DeepSeek-V3, EP8 and gpt-oss at T=1024),
    # 32-token ones at 12-31 rows, in the widest weight tiles allowed; 128 from 64 rows on (Qwen3 at T=1024),
    # streaming below 12.
    dsv3 = (1024, 8, 256, 256, 4096, 7168, tiles, 132, True)
    assert launcher.default_tactic(*dsv3, narrow_wgmma=narrow) == (64, W, W)
    assert launcher.default_tactic(*dsv3, wide=(True, True), narrow_wgmma=narrow) == (64, WW, WW)
    assert launcher.default_tactic(*dsv3, wide=(False, True), narrow_wgmma=narrow) == (64, W, WW)
    assert launcher.default_tactic(*dsv3, narrow_wgmma=(32,)) == (128, W, W)  # no 64-token wgmma linked
    assert launcher.default_tactic(1024, 8, 128, 128, 1536, 2048, tiles, 132, True, narrow_wgmma=narrow) == (
        128, W, W)
    assert launcher.NARROW_WGMMA_MIN_ROWS == {32: 12, 64: 32}
    for num_tokens in (384, 512, 768):  # 12, 16 and 24 rows an expert
        dsv3 = (num_tokens, 8, 256, 256, 4096, 7168, tiles, 132, True)
        assert launcher.default_tactic(*dsv3, narrow_wgmma=narrow) == (32, W, W)
        assert launcher.default_tactic(*dsv3, wide=(True, True), narrow_wgmma=narrow) == (32, WW, WW)
        assert launcher.default_tactic(*dsv3, narrow_wgmma=(64,))[1] not in (W, WW)  # no 32-token wgmma: streaming
    assert launcher.default_tactic(256, 8, 256, 256, 4096, 7168, tiles, 132, True, narrow_wgmma=narrow) == (16, 1, 1)
    assert (64, W, W) not in launcher.tactics((8, 16, 32, 128), True, narrow_wgmma=narrow)  # no 64-token tile


def test_three_cta_form_is_offered_on_8_and_32_token_tiles_and_taken_where_ctas_fill_three_an_sm(monkeypatch):
    """THREE_CTAS selects the 8- and 32-token streaming GEMMs' `_3cta` kernels, either GEMM on its own; the default
    takes it for an unsplit GEMM whose expected CTAs fill three an SM (on 8-token tiles measured faster there,
    slower at 256 CTAs)."""
    from moe_ext import launcher

    C = launcher.THREE_CTAS
    assert launcher.gemm1_kernel("w4a16", "swiglu", 8, C) == "moe_gemm1_w4a16_swiglu_t8_3cta"
    assert launcher.gemm2_kernel("w4a8", 8, C) == "moe_gemm2_w4a8_t8_3cta"
    assert launcher.gemm2_kernel("w4a8", 8, 2) == "moe_gemm2_w4a8_t8"  # a K split keeps the usual kernel
    tiles = launcher.TOKEN_TILES
    added = set(launcher.tactics(tiles, three_ctas=True)) - set(launcher.tactics(tiles))
    forms = launcher.K_SPLITS + (C,)
    assert added == {(t, a, b) for t in (8, 32) for a in forms for b in forms if C in (a, b)}
    with_wgmma = set(launcher.tactics(tiles, wgmma=True, three_ctas=True)) - set(launcher.tactics(tiles, wgmma=True))
    assert with_wgmma == added
    # DeepSeek-V3 at T=1: GEMM2's 8 x 56 expected CTAs take it, GEMM1's 8 x 32 do not; without the kernels, none.
    assert launcher.default_tactic(1, 8, 256, 256, 4096, 7168, tiles, 132, three_ctas=True) == (8, 1, C)
    assert C not in launcher.default_tactic(1, 8, 256, 256, 4096, 7168, tiles, 132, True)
    # Mixtral at T=1: GEMM1's 2 x 224 CTAs take it, GEMM2's 2 x 32 split K instead.
    assert launcher.default_tactic(1, 2, 8, 8, 28672, 4096, tiles, 132, three_ctas=True) == (8, C, 2)
    # Where GEMM1 would launch 4+ CTAs an SM the tile is 16 tokens (three CTAs an SM by form, no THREE_CTAS):
    # DeepSeek-V3 at T=8 (64 live tiles x 32) and 64, Mixtral at T=8 (8 x 224).
    assert launcher.default_tactic(8, 8, 256, 256, 4096, 7168, tiles, 132, three_ctas=True) == (16, 1, 1)
    assert launcher.default_tactic(64, 8, 256, 256, 4096, 7168, tiles, 132, True, three_ctas=True) == (16, 1, 1)
    assert launcher.default_tactic(8, 2, 8, 8, 28672, 4096, tiles, 132, three_ctas=True) == (16, 1, 1)
    # DeepSeek-V3 EP8 at T=1 splits K as before; at T=8 GEMM1's ~342 expected CTAs stay, GEMM2's ~600 take it.
    assert launcher.default_tactic(1, 8, 256, 32, 4096, 7168, tiles, 132, three_ctas=True) == (8, 2, 1)
    assert launcher.default_tactic(8, 8, 256, 32, 4096, 7168, tiles, 132, three_ctas=True) == (8, 1, C)
    # 16-token tiles have no separate form: 8 rows per expert (DeepSeek-V3 T=256) keep K splits.
    assert C not in launcher.default_tactic(256, 8, 256, 256, 4096, 7168, tiles, 132, three_ctas=True)
    # Mixtral at T=64 (16 rows an expert, 32-token tiles): GEMM1's 8 x 224 CTAs take it, GEMM2's 8 x 32 do not.
    assert launcher.default_tactic(64, 2, 8, 8, 28672, 4096, tiles, 132, True, three_ctas=True) == (32, C, 1)


def test_persistent_gemm2_is_offered_on_16_token_tiles_to_the_tuner_only():
    """launcher.PERSISTENT (GEMM2's persistent 16-token form) is a candidate beside each GEMM1 K split where the
    object is linked and the 16-token tile is; the heuristic never takes it (it won and lost by shape)."""
    from moe_ext import launcher
    from moe_ext.backends import HOPPER

    P = launcher.PERSISTENT
    assert launcher.gemm2_kernel("w4a4_pt", 16, P) == "moe_gemm2_w4a4_pt_t16_persistent"
    tiles = launcher.TOKEN_TILES
    added = set(launcher.tactics(tiles, wgmma=True, persistent=True)) - set(launcher.tactics(tiles, wgmma=True))
    assert added == {(16, s, P) for s in launcher.K_SPLITS}
    assert not set(launcher.tactics((8, 32), persistent=True)) - set(launcher.tactics((8, 32)))
    problem = build_problem(**make_case("w4a16", num_tokens=256, top_k=8, num_experts=64, hidden=1024,
                                        inter=512).kwargs(use_fused_finalize=True))
    assert "persistent" in HOPPER._forms(problem) and "persistent" not in HOPPER._default_forms(problem)


@pytest.mark.parametrize("mode,per_token", [("w4a16", False), ("w4a8", False), ("w4a4", True)])
def test_slab_tactics_are_offered_up_to_the_tokens_their_slabs_are_sized_for(monkeypatch, mode, per_token):
    """Past launcher.SLAB_MAX_TOKENS neither the tuner nor the heuristic gets a tactic whose GEMM1 reads token slabs
    (a workspace sizes them for that many tokens); the same tiles' wgmma tactics stay, and w4a4 per-token, whose
    GEMM1 stages, keeps them all."""
    from moe_ext import launcher
    from moe_ext.backends import HOPPER

    monkeypatch.setattr(launcher, "_linked_kernels", lambda: frozenset({launcher.SLAB_GATHER}))
    monkeypatch.setattr(launcher, "token_tiles", lambda mode, kind: launcher.TOKEN_TILES)
    monkeypatch.setattr(launcher, "kernel_forms", lambda *args: dict(
        wgmma=True, wide=(False, False), three_ctas=True, narrow_wgmma=(32, 64), persistent=False))
    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(launcher, "SLAB_MAX_TOKENS", 64)
    for tokens, slab_tactics_offered in ((64, True), (65, per_token)):
        kw = make_case(mode, num_tokens=tokens, top_k=2, num_experts=16, hidden=256, inter=256).kwargs()
        if per_token:
            kw["per_token_scale"] = torch.rand(tokens) + 0.5
        problem = build_problem(**kw)
        offered = HOPPER.tactics(problem)
        slab = [t for t in offered if launcher.reads_slabs(problem.kernel_mode, t[0], t[1])]
        assert bool(slab) == (slab_tactics_offered and not per_token), (tokens, slab)
        assert {(16, 1, 1), (32, 1, 1), (32, launcher.THREE_CTAS, 1)} <= set(offered) or not slab_tactics_offered
        assert (32, launcher.WGMMA, launcher.WGMMA) in offered
        assert (8, 1, 1) in offered and (64, 1, 1) in offered
        default = HOPPER.default_tactic(problem)  # 8 rows an expert: the heuristic's 16-token tile, where offered
        assert launcher.reads_slabs(problem.kernel_mode, default[0], default[1]) == (slab_tactics_offered
                                                                                     and not per_token), default


def test_wide_weight_kernels_are_named_and_offered_only_where_rows_allow(monkeypatch):
    """WGMMA_WIDE selects the `_wgmma_n256` kernels (w4a4's GEMM2 is w4a16's, as for WGMMA), and a GEMM whose
    weight rows are not a multiple of 256 (gpt-oss: 2 x 2880 W1 rows) never takes it."""
    from moe_ext import launcher

    WW = launcher.WGMMA_WIDE
    assert launcher.gemm1_kernel("w4a16", "swiglu", 128, WW) == "moe_gemm1_w4a16_swiglu_t128_wgmma_n256"
    assert launcher.gemm2_kernel("w4a4", 128, WW) == "moe_gemm2_w4a16_t128_wgmma_n256"
    assert launcher.gemm2_kernel("w4a8", 128, launcher.WGMMA) == "moe_gemm2_w4a8_t128_wgmma"
    monkeypatch.setattr(launcher, "has_wgmma", lambda mode, kind: True)
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
    assert launcher.wide_weights("w4a16", "swiglu", 4096, 7168) == (True, True)
    assert launcher.wide_weights("w4a16", "swiglu", 5760, 2944) == (False, False)
    assert launcher.wide_weights("w4a16", "relu2", 1536, 2944) == (True, False)
    monkeypatch.setattr(launcher, "has_kernel", lambda name: not name.endswith("_n256"))
    assert launcher.wide_weights("w4a16", "swiglu", 4096, 7168) == (False, False)


def test_padded_wgmma_tile_is_offered_only_when_switched_on(monkeypatch):
    """The 144-row routing tile (one m64n144 wgmma block) runs only the wgmma GEMMs, GEMM1 on 128-row weight tiles;
    workspaces and tactics include it only under OFFER_PADDED_WGMMA_TILE."""
    from moe_ext import launcher

    W = launcher.WGMMA
    assert launcher.gemm1_kernel("w4a16", "swiglu", 144, W) == "moe_gemm1_w4a16_swiglu_t144_wgmma"
    assert launcher.gemm2_kernel("w4a4", 144, W) == "moe_gemm2_w4a16_t144_wgmma"
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
    launcher.streaming_tiles.cache_clear()
    launcher._token_tiles.cache_clear()
    monkeypatch.setattr(launcher, "OFFER_PADDED_WGMMA_TILE", False)
    try:
        assert launcher.token_tiles("w4a16", "swiglu") == launcher.TOKEN_TILES + (256,)
        monkeypatch.setattr(launcher, "OFFER_PADDED_WGMMA_TILE", True)
        assert launcher.token_tiles("w4a16", "swiglu") == launcher.TOKEN_TILES + (144, 256)
    finally:
        launcher.streaming_tiles.cache_clear()
        launcher._token_tiles.cache_clear()
    tiles = launcher.TOKEN_TILES + (144,)
    assert set(launcher.tactics(tiles, wgmma=True)) - set(launcher.tactics(launcher.TOKEN_TILES, wgmma=True)) == {
        (144, W, W)}
    WW = launcher.WGMMA_WIDE  # GEMM2 only: GEMM1's gather has no registers for them at 256 weight rows
    assert set(launcher.tactics(tiles, wgmma=True, wide=(True, True))) - set(launcher.tactics(
        launcher.TOKEN_TILES, wgmma=True, wide=(True, True))) == {(144, W, W), (144, W, WW)}
    assert set(launcher.tactics(tiles, wgmma=True, wide=(True, False))) - set(launcher.tactics(
        launcher.TOKEN_TILES, wgmma=True, wide=(True, False))) == {(144, W, W)}
    assert launcher.tactics(tiles) == launcher.tactics(launcher.TOKEN_TILES)  # without the wgmma GEMMs, none


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(4096, 8, 256), (4096, 4, 128), (4096, 2, 8), (300, 8, 128),
                                                          (16384, 8, 256), (7, 1, 4)])
def test_expected_tile_fill_matches_sampled_routings(num_tokens, top_k, num_experts):
    """routing.expected_tile_fill (routed rows over the rows a tile multiplies) against top-k of random logits."""
    from moe_ext.routing import expected_tile_fill

    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    rows = torch.cat([torch.bincount(torch.randn(num_tokens, num_experts, generator=gen).topk(top_k).indices.flatten(),
                                     minlength=num_experts) for _ in range(8)])
    for tile in (8, 64, 128, 144, 256):
        sampled = rows.sum().item() / (torch.ceil(rows / tile) * tile).sum().item()
        assert expected_tile_fill(num_tokens, top_k, num_experts, tile) == pytest.approx(sampled, abs=0.02), tile


@pytest.mark.parametrize("num_tokens,top_k,num_experts,num_local", [(1, 8, 128, 128), (8, 8, 256, 256), (8, 8, 256, 32),
                                                                    (16, 4, 128, 128), (16, 2, 8, 8), (32, 2, 8, 8)])
def test_expected_tiles_match_sampled_routings(num_tokens, top_k, num_experts, num_local):
    """routing.expected_tiles (the local experts' 8-token routing tiles) against top-k of random logits; where no
    expert averages a tile's rows it is the experts hit."""
    from moe_ext.routing import expected_experts_hit, expected_tiles

    gen = torch.Generator().manual_seed(num_tokens * num_experts + num_local)
    picks = [torch.randn(num_tokens, num_experts, generator=gen).topk(top_k).indices.flatten() for _ in range(400)]
    rows = torch.stack([torch.bincount(p, minlength=num_experts)[:num_local] for p in picks])
    sampled = torch.ceil(rows / 8).sum(dim=1).double().mean().item()
    expected = expected_tiles(num_tokens, top_k, num_experts, num_local, 8)
    assert expected == pytest.approx(sampled, rel=0.03)
    if num_tokens * top_k / num_experts <= 1:
        assert expected == pytest.approx(expected_experts_hit(num_tokens, top_k, num_experts, num_local), rel=0.01)


def test_default_tactic_takes_the_padded_tile_where_it_multiplies_fewer_rows_by_the_margin():
    """Where offered, the 144-row tile replaces the 128-row one where expected_tile_fill gains PADDED_TILE_MIN_GAIN
    and GEMM2 keeps its 256-row weight tiles on it: DeepSeek-V3 and its EP8 shard at T=4096 (~128 rows an expert:
    0.68 -> 0.83; measured 1.04x / 1.08x); not gpt-oss-120b (the same fill, but GEMM2's 2944 rows take no 256-row
    tiles: 0.99x), not at ~256 rows an expert (Qwen3-30B-A3B T=4096, Mixtral-8x7B T=1024: 0.81 -> 0.88; Qwen3
    0.96x), at 64 (DeepSeek-V3 T=2048: 0.50 -> 0.44) or without the tile offered."""
    from moe_ext import launcher

    W, WW = launcher.WGMMA, launcher.WGMMA_WIDE
    tiles = launcher.TOKEN_TILES + (144, 256)
    default = lambda T, k, E, E_local, n1, H, tiles=tiles: launcher.default_tactic(  # noqa: E731
        T, k, E, E_local, n1, H, tiles, 132, wgmma=True, wide=(n1 % 256 == 0, H % 256 == 0))
    assert default(4096, 8, 256, 256, 4096, 7168) == (144, W, WW)
    assert default(4096, 8, 256, 32, 4096, 7168) == (144, W, WW)
    assert default(4096, 4, 128, 128, 5888, 2944) == (128, WW, W)  # gpt-oss-120b as run (2944)
    assert default(4096, 8, 128, 128, 1536, 2048)[0] == 128
    assert default(1024, 2, 8, 8, 28672, 4096)[0] == 128  # Mixtral at 256 rows an expert (from 512: 256 rows)
    assert default(2048, 8, 256, 256, 4096, 7168)[0] == 128
    assert default(4096, 8, 256, 256, 4096, 7168, tiles=launcher.TOKEN_TILES + (256,)) == (128, WW, WW)


class RoutingRecorder:
    """A backend offering two tactics that records, for each run the tuner makes, the tactic, the routing tensor's
    address and a copy of the routing it held."""

    name = "recorder"

    def __init__(self):
        self.seen = []

    def tactics(self, p):
        return [(1,), (2,)]

    def default_tactic(self, p):
        return (1,)

    def run(self, p, tactic, out, workspace):
        self.seen.append((tactic, p.token_selected_experts.data_ptr(), p.token_selected_experts.clone()))


def test_tuning_times_candidates_on_stand_in_routings_not_on_the_callers(tuner):
    """A bucket's tactic must not hang on its first call's routing: with expert parallelism a T=1 call often sends
    no slot to this rank, and every tactic then ties at doing nothing. The candidates run on stand-in routings of
    the same shape (this rank gets its mean share, experts random-like loads), written before each round into one
    tensor that every candidate reads (a captured graph keeps reading it); the caller's run uses the caller's."""
    from moe_ext import backends

    case = make_case("w4a16", num_tokens=4, top_k=2, num_experts=8, ep=4, rank=1)
    kwargs = case.kwargs()
    kwargs["token_selected_experts"] = torch.zeros_like(kwargs["token_selected_experts"])  # all on rank 0
    problem = build_problem(**kwargs)
    recorder = RoutingRecorder()
    seen = recorder.seen
    with autotune(True):
        backends.select_tactic(problem, recorder, None, "op", None, None)
    assert seen, "candidates were profiled"
    assert len({ptr for _, ptr, _ in seen}) == 1  # one tensor, rewritten in place
    routings = backends.profiling_routings(problem)
    assert len(routings) == 1  # 8 slots over 8 experts: nothing random to average
    for _, _, ids in seen:
        assert torch.equal(ids, routings[0])
    local = int(((routings[0] >= case.offset) & (routings[0] < case.offset + case.num_local)).sum())
    assert local == 2  # this rank's 2 experts get one slot each
    assert all(len(set(row.tolist())) == 2 for row in routings[0])  # top-k distinct experts per token
    # T=1 (K=8 of 256 experts, 32 a rank): one slot lands on every rank, as the mean load says.
    one = build_problem(**make_case("w4a16", num_tokens=1, top_k=8, num_experts=256, ep=8, rank=5).kwargs())
    (ids,) = backends.profiling_routings(one)
    assert [int(((ids >= 32 * r) & (ids < 32 * r + 32)).sum()) for r in range(8)] == [1] * 8
    # T*K > E: random loads (mean 8 rows here, binomial spread), not 8 rows each, which would make 8-token tiles
    # look ideal; PROFILING_ROUTINGS different draws, the same ones every time, and each rank still gets its share.
    many = build_problem(**make_case("w4a16", num_tokens=256, top_k=8, num_experts=256, ep=8, rank=2).kwargs())
    draws = backends.profiling_routings(many)
    assert len(draws) == backends.PROFILING_ROUTINGS >= 2
    assert all(torch.equal(a, b) for a, b in zip(draws, backends.profiling_routings(many)))
    assert not any(torch.equal(draws[0], other) for other in draws[1:])
    for ids in draws:
        assert all(len(set(row.tolist())) == 8 for row in ids)
        loads = torch.bincount(ids.flatten().long(), minlength=256).float()
        assert loads.mean() == 8 and 4 <= loads.var() <= 16  # Binomial(256, 1/32): variance 7.75
        assert 0.3 <= float((loads > 8).float().mean()) <= 0.5  # the experts an 8-token tile streams twice
        assert (loads.reshape(8, 32).sum(1) == 256).all()  # one slot of each token on each rank: its exact share
    # Cached now: later calls do not profile again.
    seen.clear()
    with autotune(True):
        backends.select_tactic(problem, recorder, None, "op", None, None)
    assert seen == []


def test_tuning_cycles_every_candidate_through_every_stand_in_routing(tuner):
    """Where loads are random each candidate is timed on each stand-in routing, a whole cycle of them per round
    set, and the routings are written before the round's samples."""
    from moe_ext import backends

    problem = build_problem(**make_case("w4a16", num_tokens=16, top_k=2, num_experts=8).kwargs())
    recorder = RoutingRecorder()
    with autotune(True):
        backends.select_tactic(problem, recorder, None, "op", None, None)
    routings = backends.profiling_routings(problem)
    warm_ups = 2
    for tactic in ((1,), (2,)):
        timed = [ids for t, _, ids in recorder.seen[warm_ups:] if t == tactic]
        assert len(timed) % len(routings) == 0 and len(timed) >= len(routings)
        for r, ids in enumerate(timed):
            assert torch.equal(ids, routings[r % len(routings)])


def test_profile_averages_each_candidates_median_over_the_routings():
    """A candidate fastest on one routing but slow on the others loses to one that is faster on average."""
    import time as _time

    from moe_ext.tuning import profile

    current = [0]
    cost = {(1,): [0.0005, 0.004], (2,): [0.0015, 0.0015]}  # (1,) wins on routing 0, (2,) on average

    def run(tactic):
        _time.sleep(cost[tactic][current[0]])

    routings = [lambda: current.__setitem__(0, 0), lambda: current.__setitem__(0, 1)]
    timings = profile(run, list(cost), torch.device("cpu"), warmup=1, repeats=3, use_cuda_graph=False,
                      max_repeats=3, routings=routings)
    assert min(timings, key=timings.get) == (2,)
    assert timings[(1,)] == pytest.approx(0.00225, rel=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_wrapper_times_its_candidates_as_graph_replays(tuner, monkeypatch):
    """A wrapper built for capture is replayed in graphs, so its tuner times graph replays: eager timings at small
    T measure host launch cost, which is the same for every tactic."""
    from conftest import RUN_ARGS

    from moe_ext import tuning

    modes = []
    real_profile = tuning.profile

    def spy(run, tactics, device, warmup, repeats, use_cuda_graph, **kwargs):
        modes.append(use_cuda_graph)
        return real_profile(run, tactics, device, 1, 1, use_cuda_graph, **kwargs)

    monkeypatch.setattr(tuning, "profile", spy)
    case = make_case("w4a16", num_tokens=4)
    kwargs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items() if k in RUN_ARGS}
    for use_cuda_graph in (True, False):
        tuner.cache.clear()
        modes.clear()
        wrapper = moe_ext.CuteDslMoEWrapper(case.num_experts, 2, 128, 128, quant_mode="w4a16", device="cuda",
                                            use_cuda_graph=use_cuda_graph, max_num_tokens=4)
        with autotune(True):
            wrapper.run(**kwargs)
        assert modes and set(modes) == {use_cuda_graph}


def test_profile_takes_more_samples_of_short_runs_and_few_of_long_ones():
    """A stable median at decode needs many samples of a tens-of-microseconds forward; a long forward is timed
    only the minimum number of times."""
    import time as _time

    from moe_ext.tuning import profile

    calls = []

    def quick(tactic):
        calls.append(tactic)

    profile(quick, [(1,)], torch.device("cpu"), warmup=1, repeats=3, use_cuda_graph=False)
    assert len(calls) == 1 + 25

    calls.clear()

    def slow(tactic):
        calls.append(tactic)
        _time.sleep(0.003)

    profile(slow, [(1,)], torch.device("cpu"), warmup=1, repeats=3, use_cuda_graph=False)
    assert len(calls) == 1 + 3


def test_profile_samples_the_candidates_in_rotating_rounds():
    """Every round runs each candidate once, starting one further along each time, so a clock that drifts during
    tuning (a power-capped GPU) slows all candidates alike; each candidate's time is the median of its own
    samples."""
    import time as _time

    from moe_ext.tuning import profile

    calls = []
    cost = {(1,): 0.003, (2,): 0.001, (3,): 0.002}

    def run(tactic):
        calls.append(tactic)
        _time.sleep(cost[tactic])

    timings = profile(run, list(cost), torch.device("cpu"), warmup=1, repeats=3, use_cuda_graph=False)
    assert calls[:3] == [(1,), (2,), (3,)]  # the warm-up runs
    assert calls[3:] == [(1,), (2,), (3,), (2,), (3,), (1,), (3,), (1,), (2,)]
    assert min(timings, key=timings.get) == (2,) and max(timings, key=timings.get) == (1,)


def test_profile_evicts_before_every_timed_sample_but_not_the_warm_ups():
    """Each timed sample starts from a flushed cache (a served layer's weights come from DRAM); the warm-up runs
    need none."""
    from moe_ext.tuning import profile

    events = []
    profile(lambda tactic: events.append(tactic), [(1,), (2,)], torch.device("cpu"), warmup=1, repeats=3,
            use_cuda_graph=False, max_repeats=3, flush=lambda: events.append("flush"))
    assert events[:2] == [(1,), (2,)]
    assert events[2:] == ["flush", (1,), "flush", (2,), "flush", (2,), "flush", (1,), "flush", (1,), "flush", (2,)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_default_flush_reads_twice_the_l2_and_writes_nothing(monkeypatch):
    from moe_ext import tuning

    device = torch.device("cuda", torch.cuda.current_device())
    flush = tuning.l2_flush(device)
    clean = flush.args[0]
    assert clean.numel() * 4 == 2 * tuning.l2_bytes(device) == 2 * torch.cuda.get_device_properties(
        device).L2_cache_size
    flush()
    assert clean.count_nonzero() == 0
    flushes = []
    monkeypatch.setattr(tuning, "l2_flush", lambda d: lambda: flushes.append(d))
    tuning.profile(lambda tactic: None, [(1,)], device, warmup=1, repeats=2, use_cuda_graph=False, max_repeats=2)
    assert flushes == [device, device]
    monkeypatch.setattr(tuning, "FLUSH_L2_BETWEEN_SAMPLES", False)
    tuning.profile(lambda tactic: None, [(1,)], device, warmup=1, repeats=2, use_cuda_graph=False, max_repeats=2)
    assert len(flushes) == 2


def test_hopper_default_tactic_takes_the_fused_decode_up_to_seven_gemm1_tiles_an_sm():
    """FUSED_DECODE where it runs and GEMM1's expected weight tiles fit one an SM (measured 1.25-1.74x there), and up
    to seven an SM unless GEMM2's few long items would idle the grid unsplit (gpt-oss-120b T=1 0.90x unsplit). Seven
    is where the tuner's picks split since the token slabs sped the chain up: it kept the one-launch forward at
    0.5-5.9 tiles an SM and took a chain at 7.4 and more (H100), and the chain won at T=8 on every shape on the H200,
    1.11-1.22x at 10-13.9 tiles an SM (launcher.FUSED_DECODE_TILES_PER_SM). Tiles count an expert's 8-token routing
    tiles, not just whether it is hit: Mixtral's experts average 8 rows at T=32.
    """
    from moe_ext import launcher

    tiles, fused = launcher.TOKEN_TILES, (8, launcher.FUSED_DECODE, launcher.FUSED_DECODE)

    def default(*shape, fits=True, idle=False):
        return launcher.default_tactic(*shape, tiles, 132, fused_decode=fits, decode_gemm2_idle=idle)

    assert default(1, 8, 128, 128, 1536, 2048) == fused  # Qwen3 T=1: 8 experts x 12 tiles
    assert default(1, 8, 128, 128, 1536, 2048, fits=False) != fused  # deterministic finalize, w4a4, ...
    assert default(2, 8, 128, 128, 1536, 2048) == fused  # ~15.5 experts x 12
    assert default(4, 8, 128, 128, 1536, 2048) == fused  # ~29 x 12
    assert default(8, 8, 128, 128, 1536, 2048) == fused  # ~52 x 12 (4.7 an SM): the H100's tuner kept it
    assert default(4, 8, 256, 32, 4096, 7168) == fused  # DeepSeek-V3 EP8 T=4: ~3.8 local experts x 32
    assert default(8, 8, 256, 32, 4096, 7168) == fused  # ~7.1 x 32
    assert default(2, 8, 256, 256, 4096, 7168) == fused  # DeepSeek-V3 T=2: ~15.5 x 32 (3.8 an SM): 1.24x
    assert default(4, 8, 256, 256, 4096, 7168) == (16, 1, 1)  # T=4: ~30.5 x 32 (7.4 an SM): the H100's tuner
    assert default(8, 8, 256, 256, 4096, 7168) == (16, 1, 1)  # T=8: ~57 x 32 (13.9 an SM): H200 1.22x
    assert default(2, 4, 128, 128, 5760, 2880) == fused  # gpt-oss-120b T=2: ~7.9 x 45
    assert default(4, 4, 128, 128, 5760, 2880) == fused  # T=4: ~15.2 x 45 (5.2 an SM)
    assert default(8, 4, 128, 128, 5760, 2880) != fused  # T=8: ~28.5 x 45 (9.7 an SM): H200 1.11x
    assert default(16, 4, 128, 128, 5760, 2880) != fused  # T=16: ~51 x 45 (17.4 an SM)
    assert default(1, 4, 128, 128, 5760, 2880, idle=True) != fused  # T=1: 4 x 45, GEMM2 4 x 23 items: 0.90x
    assert default(1, 4, 128, 128, 5760, 2880) == fused  # ... where its split form takes GEMM2 (40.6 vs 41.0 us)
    assert default(1, 8, 256, 32, 4096, 7168, idle=True) == fused  # EP8 T=1 (one tile an SM): 1.25x even unsplit
    assert default(1, 2, 8, 8, 28672, 4096) == fused  # Mixtral T=1: 2 x 224 (3.4 an SM): 1.28x
    assert default(2, 2, 8, 8, 28672, 4096) == fused  # T=2: ~3.5 x 224 (5.9 an SM): the H100's tuner kept it
    assert default(4, 2, 8, 8, 28672, 4096) != fused  # T=4: ~5.5 x 224 (9.3 an SM): the H100's tuner took a chain
    assert default(8, 2, 8, 8, 28672, 4096) != fused  # T=8: ~7.2 x 224 (12.2 an SM): H200 1.18x
    assert default(64, 1, 4096, 4096, 128, 128) == fused  # 64 (token, expert) pairs fit the kernel's routing ...
    assert default(72, 1, 4096, 4096, 128, 128) != fused  # ... 72 do not


def test_fused_decode_form_and_idle_gemm2_follow_the_split_switch(monkeypatch):
    """decode_kernel_for takes the split_gemm2 form where decode_splits_gemm2 wants it, DECODE_SPLIT_GEMM2 is on and
    the form is linked; decode_gemm2_idle is the rest of the cases where it wants it (GEMM2 would run unsplit)."""
    from moe_ext import launcher

    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(launcher, "DECODE_FC2_BY_GEMM1", False)
    linked = {True}
    monkeypatch.setattr(launcher, "has_kernel", lambda name: "_split2" not in name or True in linked)
    gpt_oss, qwen3 = decode_problem(1, 4, 128, 128, 2944, 2880), decode_problem(1, 8, 128, 128, 2048, 768)
    for switch, form, idle in ((False, "moe_decode_w4a16_swiglu", True),
                               (True, "moe_decode_w4a16_swiglu_split2", False)):
        monkeypatch.setattr(launcher, "DECODE_SPLIT_GEMM2", switch)
        assert launcher.decode_kernel_for(gpt_oss) == form and launcher.decode_gemm2_idle(gpt_oss) == idle
        # Qwen3 T=1's 6-step GEMM2 never wants the split: unsplit and not idle, whatever the switch
        assert launcher.decode_kernel_for(qwen3) == "moe_decode_w4a16_swiglu"
        assert not launcher.decode_gemm2_idle(qwen3)
    linked.clear()  # the switch on but the form not linked: unsplit, idle
    assert launcher.decode_kernel_for(gpt_oss) == "moe_decode_w4a16_swiglu" and launcher.decode_gemm2_idle(gpt_oss)


@pytest.mark.parametrize("point,ranges,fc2", [
    ((1, 8, 128, 128, 2048, 768), 2, False),  # Qwen3-30B-A3B T=1: 96 weight tiles, 2 ranges of 8 steps
    ((2, 8, 128, 128, 2048, 768), 1, True),
    ((1, 8, 256, 32, 7168, 2048), 8, False),  # DeepSeek-V3 EP8 T=1: one expected tile, 8 ranges of 7 steps
    ((2, 8, 256, 32, 7168, 2048), 4, True),  # 14 steps a range
    ((4, 8, 256, 32, 7168, 2048), 2, True),
    ((1, 4, 128, 128, 2944, 2944), 1, True),  # gpt-oss-120b T=1
], ids=["qwen3_t1", "qwen3_t2", "ep8_t1", "ep8_t2", "ep8_t4", "gpt_oss_t1"])
def test_fused_decode_builds_the_fc2_input_in_gemm1_but_where_short_k_ranges_meet(monkeypatch, point, ranges, fc2):
    """decode_kernel_for takes the fc2_by_gemm1 form (session 39: 1-3 µs faster at most decode points) unless
    GEMM1's expected K ranges split a weight tile into ranges under DECODE_FC2_MIN_RANGE_STEPS steps (the two points
    where it lost); never with DECODE_FC2_BY_GEMM1 off or the form not linked."""
    from moe_ext import launcher

    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
    problem = decode_problem(*point)
    assert launcher.decode_gemm1_ranges(*point[:5], problem.n1, 264) == ranges
    form = launcher.decode_kernel_for(problem)
    assert form.endswith("_fc2") == fc2 and form.startswith("moe_decode_w4a16_swiglu")
    monkeypatch.setattr(launcher, "has_kernel", lambda name: not name.endswith("_fc2"))
    assert not launcher.decode_kernel_for(problem).endswith("_fc2")
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)  # linked, but switched off
    monkeypatch.setattr(launcher, "DECODE_FC2_BY_GEMM1", False)
    assert not launcher.decode_kernel_for(problem).endswith("_fc2")


@pytest.mark.parametrize("mode", ["w4a4", "w4a8"])
def test_quantized_fused_decode_takes_the_fc2_forms_only(monkeypatch, mode):
    """w4a4 / w4a8 have the fc2_by_gemm1 forms alone (their GEMM1 epilogue quantizes the FC2 input): they take them
    where w4a16 takes the partials form (Qwen3-30B-A3B T=1: 2 short GEMM1 ranges), split GEMM2's K where w4a16
    would (gpt-oss-120b T=1), take the deep ring where w4a16 would (Qwen3 T=8), and are not offered where their
    objects are not linked or with per-token activation scales (w4a4_pt)."""
    from moe_ext import launcher

    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
    qwen3, gpt_oss = (1, 8, 128, 128, 2048, 768), (1, 4, 128, 128, 2944, 2880)
    assert launcher.decode_kernel_for(decode_problem(*qwen3)) == "moe_decode_w4a16_swiglu"
    assert launcher.decode_kernel_for(decode_problem(*qwen3, mode)) == f"moe_decode_{mode}_swiglu_fc2"
    assert launcher.decode_kernel_for(decode_problem(*gpt_oss, mode)) == f"moe_decode_{mode}_swiglu_split2_fc2"
    assert launcher.decode_kernel_for(decode_problem(8, 8, 128, 128, 2048, 768, mode)) == (
        f"moe_decode_{mode}_swiglu_fc2_ring{launcher.DECODE_DEEP_RING_STAGES}")
    assert launcher.offers_fused_decode(mode, "swiglu", True, False, (8, 16))
    assert not launcher.offers_fused_decode("w4a4_pt", "swiglu", True, False, (8, 16))
    monkeypatch.setattr(launcher, "has_kernel", lambda name: not name.startswith(f"moe_decode_{mode}"))
    assert not launcher.offers_fused_decode(mode, "swiglu", True, False, (8, 16))


@pytest.mark.parametrize("point,deep", [
    ((2, 8, 128, 128, 2048, 768), False),  # Qwen3-30B-A3B T=2: 1.4 GEMM1 tiles an SM (0.35 µs slower deep)
    ((4, 8, 128, 128, 2048, 768), True),  # T=4: 2.6 (2.0% faster)
    ((8, 8, 128, 128, 2048, 768), True),  # T=8: 4.7 (3.4%)
    ((4, 8, 256, 32, 7168, 2048), False),  # DeepSeek-V3 EP8 T=4: 0.9 (1.85 µs slower)
    ((8, 8, 256, 32, 7168, 2048), False),  # T=8: 1.7 (level)
    ((1, 8, 256, 256, 7168, 2048), False),  # DeepSeek-V3 T=1: 1.9
    ((2, 8, 256, 256, 7168, 2048), True),  # T=2: 3.8 (0.6%)
    ((8, 8, 256, 256, 7168, 2048), True),  # T=8: 13.9 (1.65%)
    ((2, 2, 8, 8, 4096, 14336), False),  # Mixtral T=2: GEMM2 splits K (no deep-ring variant)
    ((8, 2, 8, 8, 4096, 14336), True),  # T=8: 12.2 (1.0%)
], ids=["qwen3_t2", "qwen3_t4", "qwen3_t8", "ep8_t4", "ep8_t8", "dsv3_t1", "dsv3_t2", "dsv3_t8", "mixtral_t2",
        "mixtral_t8"])
def test_fused_decode_takes_the_deep_ring_where_ctas_stream_several_items(monkeypatch, point, deep):
    """decode_kernel_for takes the unsplit fc2 form's deep-ring variant from DECODE_DEEP_RING_TILES_PER_SM GEMM1
    weight tiles an SM (where it measured faster, h100_session44_checks.md), never for the other forms, with
    DECODE_DEEP_RING off or the object not linked."""
    from moe_ext import launcher

    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
    problem = decode_problem(*point)
    form = launcher.decode_kernel_for(problem)
    assert form.endswith("_fc2_ring6") == deep, form
    if deep:
        monkeypatch.setattr(launcher, "has_kernel", lambda name: not name.endswith("_ring6"))
        assert launcher.decode_kernel_for(problem).endswith("_fc2")
        monkeypatch.setattr(launcher, "has_kernel", lambda name: True)
        monkeypatch.setattr(launcher, "DECODE_DEEP_RING", False)
        assert launcher.decode_kernel_for(problem).endswith("_fc2")


def test_fused_decode_splits_gemm2_where_few_items_of_a_long_k_leave_the_grid_idle():
    """The split-GEMM2 form where the expected GEMM2 items (a tile an expert hit x 128 hidden rows) leave room for
    two K ranges of 4+ steps each on the two-CTA grid of 132 SMs: the points session 36 measured faster split
    (DeepSeek-V3 EP8 T=1 / 2, gpt-oss-120b T=1, Mixtral T=1 / 2), not those it measured slower (Qwen3-30B-A3B T=1:
    its 6 K steps make ranges of 3; every shape from T=4, where the items fill the grid)."""
    from moe_ext import launcher

    def split(T, top_k, experts, local, hidden, inter):
        return launcher.decode_splits_gemm2(T, top_k, experts, local, hidden, inter, 264)

    assert [split(T, 8, 256, 32, 7168, 2048) for T in (1, 2, 4, 8)] == [True, True, False, False]  # EP8
    assert [split(T, 4, 128, 128, 2880, 2880) for T in (1, 2)] == [True, False]  # gpt-oss-120b
    assert [split(T, 2, 8, 8, 4096, 14336) for T in (1, 2, 4)] == [True, True, False]  # Mixtral
    assert not any(split(T, 8, 128, 128, 2048, 768) for T in (1, 2, 4, 8))  # Qwen3-30B-A3B
    assert not split(1, 8, 256, 256, 7168, 2048)  # DeepSeek-V3: 8 x 56 items
    assert not split(1, 1, 4, 4, 512, 896)  # 7 K steps: one range of 4 at most


def test_finalists_are_the_few_near_the_fastest_of_long_forwards_only(monkeypatch):
    """Prefill-length forwards: the candidates within the margin of the fastest sample, fastest first, at most
    SUSTAINED_CANDIDATES of them; a decode-length forward gets none (its samples already time it as served)."""
    from moe_ext import tuning

    ms = 1e-3
    timings = {(1,): 6.2 * ms, (2,): 5.8 * ms, (3,): 6.0 * ms, (4,): 6.5 * ms, (5,): 6.3 * ms, (6,): 5.9 * ms}
    assert tuning.finalists(timings) == [(2,), (6,), (3,), (1,)]  # 6.5 is past 1.10 x 5.8; (5,) is the fifth
    monkeypatch.setattr(tuning, "SUSTAINED_CANDIDATES", 8)
    assert tuning.finalists(timings) == [(2,), (6,), (3,), (1,), (5,)]
    short = {tactic: seconds / 100 for tactic, seconds in timings.items()}  # 58-65 µs
    assert tuning.finalists(short) == []


def test_long_forwards_are_picked_by_their_time_back_to_back(tuner, monkeypatch):
    """A candidate that is fastest alone but slows down run after run (a power-capped card's clock under a tile
    that draws more power) loses to one that holds its pace: the samples, which alternate the candidates, rank it
    first, the back-to-back bursts second. A decode-length forward keeps the samples' pick."""
    import time as _time

    from moe_ext import tuning

    monkeypatch.setattr(tuning, "SUSTAINED_WARM_S", 0.03)
    monkeypatch.setattr(tuning, "SUSTAINED_TIMED_S", 0.03)
    cost = {"seconds": 1e-3, "other": 1.05}  # (2,)'s pace against (1,)'s alone
    streak = {"tactic": None, "runs": 0}

    def run(tactic):
        streak["runs"] = streak["runs"] + 1 if streak["tactic"] == tactic else 1
        streak["tactic"] = tactic
        hot = tactic == (1,) and streak["runs"] > 3  # (1,): 1.0x alone, 2.0x after three in a row
        _time.sleep(cost["seconds"] * (2.0 if hot else 1.0 if tactic == (1,) else cost["other"]))

    key = ("op", "prefill", 4096)
    with autotune(True):
        assert tuner.choose(key, [(1,), (2,)], (1,), lambda: ProfilingRun(run), torch.device("cpu")) == (2,)
    cost.update(seconds=1e-4, other=1.5)  # both under SUSTAINED_MIN_S: no bursts, the samples decide
    with autotune(True):
        assert tuner.choose(("op", "decode", 1), [(1,), (2,)], (2,), lambda: ProfilingRun(run),
                            torch.device("cpu")) == (1,)


def test_sustained_bursts_rotate_the_candidates_and_the_routings(monkeypatch):
    """Each round sets its stand-in routing, then runs every candidate as a warm-up burst followed by a timed one
    (sized from its sampled time), the candidates' order rotating from round to round."""
    from moe_ext import tuning

    monkeypatch.setattr(tuning, "SUSTAINED_WARM_S", 1.0)  # over sampled times of 0.5 s: 2 runs, then 3 timed
    monkeypatch.setattr(tuning, "SUSTAINED_TIMED_S", 1.5)
    events = []
    routings = [lambda: events.append("routing 0"), lambda: events.append("routing 1")]
    timings = tuning.sustained(events.append, {(1,): 0.5, (2,): 0.5}, torch.device("cpu"), routings)
    burst = lambda tactic: [tactic] * (2 + 3)  # noqa: E731 (2 warm-up runs, 3 timed)
    assert events == ["routing 0", *burst((1,)), *burst((2,)), "routing 1", *burst((2,)), *burst((1,))]
    assert set(timings) == {(1,), (2,)}
