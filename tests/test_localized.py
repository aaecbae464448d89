"""Localized (two-shard) execution: equal to the full-width path, and it never reads the full-width weights."""
import pytest
import torch
from conftest import hopper_kernels, make_case, rel_l2, replays_with_new_inputs

import moe_ext


def storage_less(t):
    """A copy with the full-width metadata and no data (what the seed allows when nonlocalized=False)."""
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset()) if t.dim() == 6 else t
    placeholder = flat.clone()
    placeholder.untyped_storage().resize_(0)
    return placeholder


@pytest.mark.parametrize("mode", ["w4a4", "w4a4_pt", "w4a8", "w4a16"])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_localized_equals_full_width_bitwise(mode, act):
    case = make_case(mode, act, num_tokens=11, top_k=3, hidden=256, inter=256, seed=4)
    full = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=False))
    shards = moe_ext.split_localized_shards(case.prepared)
    local = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=False, localized_weights=shards,
                                                     localized_sm_count=66))
    assert torch.equal(local, full)


def test_full_width_weights_are_not_read_when_shards_are_given():
    case = make_case("w4a4", num_tokens=7, hidden=256, inter=256)
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    shards = moe_ext.split_localized_shards(case.prepared)
    kw = case.kwargs(localized_weights=shards)
    for name in ("w1_weight", "w2_weight", "w1_weight_sf", "w2_weight_sf"):
        kw[name] = storage_less(kw[name])
    assert kw["w1_weight"].untyped_storage().nbytes() == 0
    assert torch.equal(moe_ext.cute_dsl_fused_moe(**kw), expected)
    # The placeholders really hold no data: the full-width path cannot run on them.
    kw.pop("localized_weights")
    with pytest.raises(RuntimeError):
        moe_ext.cute_dsl_fused_moe(**kw)


# ---- on the H200: the kernels run each shard on its own green-context stream -------------------------------------

@pytest.fixture(scope="module")
def domains():
    from moe_ext.streams import LocalityDomains

    return LocalityDomains.create("cuda")


@hopper_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_pt", "w4a8"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_localized_kernels_on_green_contexts_match_full_width(domains, mode, fused, act):
    """Shards built in the domains' pools, run on the green-context streams, with storage-less full-width
    placeholders (the launcher refuses null pointers, so nothing reads them). Deterministic: bitwise equal to the
    full-width kernels; fused: equal up to the order of the bf16 atomic adds."""
    from moe_ext.backends import HOPPER, backend_for
    from moe_ext.problem import build_problem

    case = make_case(mode, act, num_tokens=37, top_k=8, num_experts=32, hidden=1024, inter=512, seed=9,
                     invalid_fraction=0.05, weight_scale=0.05).to("cuda")
    full = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    shards = moe_ext.split_localized_shards(case.prepared, pools=domains.pools)
    kw = case.kwargs(use_fused_finalize=fused, localized_weights=shards, localized_streams=domains.streams,
                     localized_sm_count=domains.sm_count, localized_memset_stream=torch.cuda.Stream())
    for name in ("w1_weight", "w2_weight", "w1_weight_sf", "w2_weight_sf"):
        kw[name] = storage_less(kw[name])
    assert backend_for(build_problem(**kw)) is HOPPER
    poisoned = torch.full_like(full, float("nan"))
    local = moe_ext.cute_dsl_fused_moe(**kw, moe_output=poisoned)
    torch.cuda.synchronize()
    assert torch.isfinite(local).all()
    if fused:
        assert rel_l2(local, full) <= 5e-3
    else:
        assert torch.equal(local, full)


@hopper_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_localized_wgmma_gemms_equal_full_width_bitwise(domains, act):
    """The wgmma GEMMs (tactic (128, WGMMA, WGMMA)) on the two shards write the same bits as on full width: each
    intermediate and output column sums the same K stages in the same order."""
    from moe_ext import launcher

    tactic = (launcher.WGMMA_TILE, launcher.WGMMA, launcher.WGMMA)
    case = make_case("w4a16", act, num_tokens=300, top_k=8, num_experts=16, hidden=512, inter=256, seed=12,
                     invalid_fraction=0.05, weight_scale=0.05).to("cuda")
    full = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=False, tactic=tactic))
    shards = moe_ext.split_localized_shards(case.prepared, pools=domains.pools)
    local = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=False, localized_weights=shards,
                                                     localized_streams=domains.streams, tactic=tactic))
    torch.cuda.synchronize()
    assert torch.isfinite(full).all()
    assert torch.equal(local, full)


@hopper_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_localized_wrapper_captured_once_replays_with_new_routing(fused):
    """The wrapper keeps its green contexts, streams and shards; one capture replays 100 times with new routing
    and activations, matching eager full-width runs (deterministic: bitwise)."""
    E, K, H, I, T = 32, 8, 1024, 512, 48
    base = make_case("w4a4", num_tokens=T, top_k=K, num_experts=E, hidden=H, inter=I, seed=3).to("cuda")
    wrapper = moe_ext.CuteDslMoEWrapper(E, K, H, I, use_cuda_graph=True, max_num_tokens=T, quant_mode="w4a4",
                                        device="cuda", use_fused_finalize=fused, localized=True)
    assert wrapper.domains is not None and len(wrapper.domains.streams) == 2
    wrapper.localize(base.prepared)
    for step, captured, eager in replays_with_new_inputs(wrapper, base, fused):
        if fused:
            assert rel_l2(captured, eager) <= 5e-3, step
        else:
            assert torch.equal(captured, eager), f"replay {step} differs from the eager full-width run"


def test_allow_nonlocalized_offers_the_full_width_path_as_tactics(monkeypatch):
    """With localized_allow_nonlocalized=True the Hopper tactics come in both widths (4th element 1: shards,
    0: full width) and the tuner may pick either; a full-width tactic runs the full-width weights. Without it
    only the shards' tactics exist, so nothing can read the full-width tensors."""
    from moe_ext import launcher
    from moe_ext.backends import HOPPER, op_key
    from moe_ext.problem import build_problem

    if not launcher.token_tiles("w4a4", "swiglu"):
        pytest.skip("the launcher was built without the kernels")
    case = make_case("w4a4", num_tokens=7, hidden=256, inter=256)
    shards = moe_ext.split_localized_shards(case.prepared)
    only_local = build_problem(**case.kwargs(localized_weights=shards))
    both = build_problem(**case.kwargs(localized_weights=shards, localized_allow_nonlocalized=True))
    base = HOPPER.tactics(only_local)
    assert all(len(t) == 3 for t in base)
    assert HOPPER.tactics(both) == [t + (1,) for t in base] + [t + (0,) for t in base]
    monkeypatch.setattr(launcher, "num_sms", lambda device: 132)
    assert HOPPER.default_tactic(both)[3] == 1
    assert op_key(only_local, HOPPER, "op") != op_key(both, HOPPER, "op")
    seen = []
    monkeypatch.setattr(launcher, "forward", lambda problem, *a, **k: seen.append(problem.shards))
    HOPPER.run(both, base[0] + (0,), torch.empty(7, 256, dtype=torch.bfloat16))
    HOPPER.run(both, base[0] + (1,), torch.empty(7, 256, dtype=torch.bfloat16))
    assert seen[0] is None and seen[1] is not None


def test_relu2_shards_of_partial_weight_tiles_run_on_the_reference(monkeypatch):
    """The GEMMs take whole 128-row weight tiles. A Relu2 shard holds I / 2 rows of W1, so with I = 384 a user's
    own 192-row shards (valid in the format; split_localized_shards only makes 128-row multiples) would leave 64
    rows unwritten on the kernels: such a layer warns and runs on the reference path."""
    import dataclasses

    from moe_ext import launcher
    from moe_ext.backends import HOPPER
    from moe_ext.problem import build_problem

    monkeypatch.setattr(launcher, "hopper_device", lambda device: True)
    monkeypatch.setattr(launcher, "token_tiles", lambda mode, kind: (8,))
    case = make_case("w4a16", "relu2", num_tokens=3, hidden=256, inter=512)
    problem = build_problem(**case.kwargs(localized_weights=moe_ext.split_localized_shards(case.prepared)))
    assert HOPPER.supports(problem)  # 256-row shards
    with pytest.warns(UserWarning, match="multiple of 128"):
        assert not HOPPER.supports(dataclasses.replace(problem, intermediate_size=384))  # the supports() check only
