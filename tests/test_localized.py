"""Localized (two-shard) execution: equal to the full-width path, and it never reads the full-width weights."""
import pytest
import torch
from conftest import make_case

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
