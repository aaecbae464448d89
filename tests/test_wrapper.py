"""CuteDslMoEWrapper: FlashInfer's constructor, preallocated workspaces reused across runs, capacity errors."""
import inspect

import pytest
import torch
from conftest import RUN_ARGS, make_case

import moe_ext
from moe_ext import CuteDslMoEWrapper


def run_kwargs(case, **over):
    kw = {k: v for k, v in case.kwargs(**over).items() if k in RUN_ARGS + ("per_token_scale",)}
    return kw


def wrapper_for(case, **over):
    cfg = dict(num_experts=case.num_experts, top_k=case.ids.shape[1], hidden_size=128, intermediate_size=128,
               num_local_experts=case.num_local, local_expert_offset=case.offset, device="cpu",
               quant_mode=case.prepared.quant_mode, activation_type=case.prepared.activation_type)
    cfg.update(case.activation_kwargs)
    cfg.update(over)
    return CuteDslMoEWrapper(**cfg)


def test_constructor_signature_matches_flashinfer():
    """FlashInfer's positional parameters, in order; our additions (localized execution) are keyword-only."""
    signature = inspect.signature(CuteDslMoEWrapper).parameters
    params = [n for n, p in signature.items() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert [n for n, p in signature.items() if p.kind == inspect.Parameter.KEYWORD_ONLY] == [
        "localized", "localized_sm_count"]
    assert params == ["num_experts", "top_k", "hidden_size", "intermediate_size", "use_cuda_graph", "max_num_tokens",
                      "num_local_experts", "local_expert_offset", "tile_size", "sf_vec_size", "output_dtype",
                      "device", "enable_pdl", "activation_type", "swiglu_alpha", "swiglu_beta", "swiglu_limit",
                      "situ_beta", "situ_linear_beta", "use_fused_finalize", "quant_mode"]
    run = list(inspect.signature(CuteDslMoEWrapper.run).parameters)
    assert run == ["self", *RUN_ARGS, "tactic", "per_token_scale"]


@pytest.mark.parametrize("mode", ["w4a4", "w4a4_pt", "w4a8", "w4a16"])
@pytest.mark.parametrize("fused", [True, False])
def test_wrapper_matches_functional_api_and_reuses_its_buffers(mode, fused):
    wrapper = wrapper_for(make_case(mode), max_num_tokens=32, use_fused_finalize=fused)
    workspace = wrapper.workspace
    buffers = {"output": lambda w: w.output, "expanded_to_permuted": lambda w: w.expanded_to_permuted,
               "permuted_to_expanded": lambda w: w.permuted_to_expanded,
               "slot_output": lambda w: w.kernel_buffers.slot_output}
    pointers = {name: get(workspace).data_ptr() for name, get in buffers.items()}
    for num_tokens, seed in ((32, 0), (5, 1), (17, 2), (1, 3)):
        case = make_case(mode, num_tokens=num_tokens, seed=seed, invalid_fraction=0.1)
        expected = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
        out = wrapper.run(**run_kwargs(case))
        assert torch.equal(out, expected)
        assert out.data_ptr() == pointers["output"], "output must be the preallocated buffer"
        assert wrapper.workspace is workspace
        assert {name: get(workspace).data_ptr() for name, get in buffers.items()} == pointers
        # The routing maps the run used were written into the workspace.
        assert torch.equal(workspace.expanded_to_permuted[:num_tokens] >= 0,
                           (case.ids >= 0) & (case.ids < case.num_experts))


def test_run_above_max_num_tokens_is_a_clear_error():
    wrapper = wrapper_for(make_case("w4a16"), max_num_tokens=8)
    with pytest.raises(ValueError, match="exceeds this wrapper's max_num_tokens=8"):
        wrapper.run(**run_kwargs(make_case("w4a16", num_tokens=9)))


def test_without_max_num_tokens_the_workspace_grows_by_bucket():
    wrapper = wrapper_for(make_case("w4a16"))
    assert wrapper.workspace is None
    wrapper.run(**run_kwargs(make_case("w4a16", num_tokens=5)))
    assert wrapper.workspace.max_num_tokens == 8
    first = wrapper.workspace
    wrapper.run(**run_kwargs(make_case("w4a16", num_tokens=3)))
    assert wrapper.workspace is first
    wrapper.run(**run_kwargs(make_case("w4a16", num_tokens=300)))
    assert wrapper.workspace.max_num_tokens == 512


def test_wrapper_rejects_weights_of_another_layer():
    wrapper = wrapper_for(make_case("w4a16"), hidden_size=256)
    with pytest.raises(ValueError, match="this wrapper was built for"):
        wrapper.run(**run_kwargs(make_case("w4a16")))


@pytest.mark.parametrize("over,match", [
    (dict(quant_mode="int4"), "quant_mode"), (dict(activation_type=10), "Situ"), (dict(tile_size=100), "tile_size"),
    (dict(max_num_tokens=0), "max_num_tokens"), (dict(output_dtype=torch.float16), "output_dtype"),
    (dict(situ_beta=-1.0), "situ_beta"),
])
def test_constructor_validation(over, match):
    with pytest.raises((TypeError, ValueError), match=match):
        wrapper_for(make_case("w4a16"), **over)


def test_valid_tactics_are_accepted_and_others_rejected():
    case = make_case("w4a16", num_tokens=4)
    wrapper = wrapper_for(case, max_num_tokens=4)
    for tactic in wrapper.get_valid_tactics():
        assert torch.equal(wrapper.run(**run_kwargs(case), tactic=tactic),
                           moe_ext.cute_dsl_fused_moe(**case.kwargs()))
    with pytest.raises(ValueError, match="valid tactics"):
        wrapper.run(**run_kwargs(case), tactic=(7,))


def test_wrapper_tile_size_sets_the_routing_padding():
    case = make_case("w4a16", num_tokens=20, top_k=2)
    wrapper = wrapper_for(case, tile_size=64, max_num_tokens=20)
    wrapper.run(**run_kwargs(case))
    offsets = wrapper.workspace.expert_offsets
    assert (offsets % 64 == 0).all() and int(offsets[-1]) > 0


def test_localized_wrapper_keeps_its_shards_and_matches_full_width():
    """On CPU (no green contexts) the shards run one after the other on the reference path: deterministic results
    equal the full-width wrapper's bitwise, and the shards are built once and reused."""
    case = make_case("w4a4", num_tokens=6, top_k=2, hidden=256, inter=256, seed=2)
    cfg = dict(hidden_size=256, intermediate_size=256, use_fused_finalize=False)
    full = wrapper_for(case, **cfg).run(**run_kwargs(case))
    local = wrapper_for(case, **cfg, localized=True)
    assert local.domains is None  # CPU: no SM partitions
    shards = local.localize(case.prepared)
    assert local.localized_weights is shards and len(shards) == 2
    assert torch.equal(local.run(**run_kwargs(case)), full)
    with pytest.raises(ValueError, match="localized=True"):
        wrapper_for(case, **cfg).localize(case.prepared)
    with pytest.raises(ValueError, match="localized_sm_count was given without localized=True"):
        wrapper_for(case, **cfg, localized_sm_count=32)
