"""Every bad argument fails before any work, with a TypeError/ValueError that names it, and moe_output is left
untouched."""
import math

import pytest
import torch
from conftest import make_case

import moe_ext

W4A4 = make_case("w4a4", num_tokens=5, top_k=2)
W4A16 = make_case("w4a16", num_tokens=5, top_k=2)
W4A8 = make_case("w4a8", num_tokens=5, top_k=2)


def bad(case, error, match, **over):
    return pytest.param(case, error, match, over, id=f"{case.mode}-{match}-{'-'.join(over)}")


CASES = [
    bad(W4A4, TypeError, "x must have dtype uint8", x=W4A4.quantized.x.float()),
    bad(W4A4, ValueError, "x must be 2-D", x=W4A4.quantized.x[None]),
    bad(W4A16, ValueError, "x must be contiguous", x=torch.randn(128, 5).bfloat16().t()),
    bad(W4A4, TypeError, "x_sf must be a torch.Tensor", x_sf=None),
    bad(W4A16, ValueError, "x_sf must be None", x_sf=W4A4.quantized.x_sf),
    bad(W4A4, ValueError, "x_sf must be linear", x_sf=W4A4.quantized.x_sf[:, :4]),
    bad(W4A8, TypeError, "x_sf must have dtype", x_sf=W4A8.quantized.x_sf.float()),
    bad(W4A4, TypeError, "token_selected_experts must have dtype", token_selected_experts=W4A4.ids.float()),
    bad(W4A4, ValueError, "token_selected_experts must have 5 rows", token_selected_experts=W4A4.ids[:4]),
    bad(W4A4, ValueError, "top_k", top_k=3),
    bad(W4A4, TypeError, "token_final_scales must have dtype float32", token_final_scales=W4A4.scales.bfloat16()),
    bad(W4A4, ValueError, "token_final_scales must have shape", token_final_scales=W4A4.scales[:, :1]),
    bad(W4A4, ValueError, "w1_weight must have shape", w1_weight=W4A4.prepared.w1_weight[:7]),
    bad(W4A4, TypeError, "w1_weight must have dtype uint8", w1_weight=W4A4.prepared.w1_weight.float()),
    bad(W4A4, ValueError, "w1_weight_sf", w1_weight_sf=torch.zeros(100, dtype=torch.uint8)),
    bad(W4A4, TypeError, "w2_weight_sf must have dtype", w2_weight_sf=torch.zeros(4096, dtype=torch.float32)),
    bad(W4A8, TypeError, "w1_weight_sf must have dtype",
        w1_weight_sf=W4A8.prepared.w1_weight_sf.view(torch.float8_e4m3fn)),
    bad(W4A4, ValueError, "w1_alpha must have shape", w1_alpha=W4A4.prepared.w1_alpha[:3]),
    bad(W4A4, TypeError, "w2_alpha must have dtype float32", w2_alpha=W4A4.prepared.w2_alpha.double()),
    bad(W4A4, TypeError, "fc2_input_scale must be a torch.Tensor", fc2_input_scale=None),
    bad(W4A16, ValueError, "fc2_input_scale must be None", fc2_input_scale=torch.ones(1)),
    bad(W4A16, ValueError, "per_token_scale is only supported", per_token_scale=torch.ones(5)),
    bad(W4A4, ValueError, "per_token_scale must have shape", per_token_scale=torch.ones(4)),
    bad(W4A4, ValueError, "local_expert_offset", local_expert_offset=1),
    bad(W4A4, ValueError, "num_experts must be >= 1", num_experts=0),
    bad(W4A4, TypeError, "num_local_experts must be an int", num_local_experts=8.0),
    bad(W4A4, ValueError, "Situ", activation_type=10),
    bad(W4A4, ValueError, "activation_type must be one of", activation_type=2),
    bad(W4A4, TypeError, "activation_type must be an int", activation_type="3"),
    bad(W4A4, ValueError, "situ_beta must be finite and > 0", situ_beta=0.0),
    bad(W4A4, ValueError, "situ_beta must be finite and > 0", situ_beta=math.inf),
    bad(W4A4, ValueError, "situ_linear_beta must be finite and > 0", situ_beta=1.0, situ_linear_beta=math.nan),
    bad(W4A4, ValueError, "situ_linear_beta requires situ_beta", situ_linear_beta=1.0),
    bad(W4A4, ValueError, "situ_beta selects SiTU", situ_beta=1.0, activation_type=6),
    bad(W4A8, ValueError, "not supported with quant_mode='w4a8'", situ_beta=1.0),
    bad(W4A4, ValueError, "swiglu_alpha must not be NaN", swiglu_alpha=math.nan),
    bad(W4A4, ValueError, "quant_mode must be one of", quant_mode="fp8"),
    bad(W4A4, ValueError, "output_dtype must be torch.bfloat16", output_dtype=torch.float16),
    bad(W4A4, TypeError, "use_fused_finalize must be a bool", use_fused_finalize=1),
    bad(W4A4, ValueError, "tactic", tactic=(128, 256)),
    bad(W4A4, TypeError, "tactic must be a tuple", tactic="fast"),
    bad(W4A4, TypeError, "aux_stream must be a torch.cuda.Stream", aux_stream="stream"),
    bad(W4A4, TypeError, "enable_pdl must be a bool", enable_pdl=None),
    bad(W4A4, ValueError, "hidden size must be a multiple of 128", x=torch.zeros(5, 32, dtype=torch.uint8),
        x_sf=torch.zeros(5, 4, dtype=torch.uint8)),
    bad(W4A4, ValueError, "w1_weight must have shape", activation_type=6),
    bad(W4A4, ValueError, "localized_weights must hold exactly 2", localized_weights=[{}]),
    bad(W4A4, ValueError, "localized_streams was given without localized_weights", localized_streams=[None, None]),
]


@pytest.mark.parametrize("case,error,match,over", CASES)
def test_bad_argument_is_rejected_before_any_work(case, error, match, over):
    out = torch.full((case.ids.shape[0], 128), 7.0, dtype=torch.bfloat16)
    kwargs = case.kwargs(moe_output=out)
    kwargs.update(over)
    with pytest.raises(error, match=match):
        moe_ext.cute_dsl_fused_moe(**kwargs)
    assert (out == 7.0).all(), "moe_output must be untouched when validation fails"


def test_intermediate_size_must_fit_the_interleave():
    case = make_case("w4a16", inter=128)
    with pytest.raises(ValueError, match="I=96"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(w2_weight=torch.zeros(8, 128, 48, dtype=torch.uint8)))


@pytest.mark.parametrize("over,match", [
    (dict(moe_output=torch.zeros(4, 128, dtype=torch.bfloat16)), "moe_output must have shape"),
    (dict(moe_output=torch.zeros(5, 128, dtype=torch.float32)), "moe_output must have dtype"),
])
def test_bad_moe_output(over, match):
    with pytest.raises((TypeError, ValueError), match=match):
        moe_ext.cute_dsl_fused_moe(**W4A4.kwargs(**over))


def test_localized_shard_checks():
    case = make_case("w4a4", hidden=256, inter=256)
    shards = moe_ext.split_localized_shards(case.prepared)
    broken = [dict(shards[0]), dict(shards[1])]
    broken[1]["w2_weight"] = shards[1]["w2_weight"][:, :64]
    with pytest.raises(ValueError, match=r"localized_weights\[1\].w2_weight must have shape"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=broken))
    missing = [dict(shards[0]), {k: v for k, v in shards[1].items() if k != "w1_weight_sf"}]
    with pytest.raises(ValueError, match="missing"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=missing))
    with pytest.raises(ValueError, match="multiple of 128"):
        small = make_case("w4a4", hidden=256, inter=64)
        moe_ext.cute_dsl_fused_moe(**small.kwargs(localized_weights=shards))
    with pytest.raises(ValueError, match="localized_streams must be a list of 2"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=shards, localized_streams=[None]))
    with pytest.raises(ValueError, match="localized_sm_count must be >= 1"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=shards, localized_sm_count=0))
    with pytest.raises(ValueError, match="exactly 2 equal-width shards, got 3"):  # an odd shard count
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=[*shards, shards[0]]))
    elsewhere = [{**shards[0], "w1_weight": shards[0]["w1_weight"].to("meta")}, shards[1]]
    with pytest.raises(ValueError, match=r"localized_weights\[0\].w1_weight must be on cpu"):
        moe_ext.cute_dsl_fused_moe(**case.kwargs(localized_weights=elsewhere))
