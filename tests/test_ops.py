"""torch.ops.moe.fused: registration, opcheck, and torch.compile(fullgraph=True) without graph breaks."""
import pytest
import torch
from conftest import make_case

import moe_ext  # noqa: F401  (registers the op)


def op_args(case, **over):
    kw = case.kwargs(**over)
    positional = [kw.pop(k) for k in ("x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight",
                                       "w1_weight_sf", "w1_alpha", "fc2_input_scale", "w2_weight", "w2_weight_sf",
                                       "w2_alpha", "num_experts", "top_k")]
    # The op takes flat scale bytes and int tactics; the 6-D MMA views are strided views and are accepted too.
    return positional, kw


def test_op_is_registered_with_full_schema():
    schema = str(torch.ops.moe.fused.default._schema)
    for arg in ("Tensor? x_sf", "Tensor? fc2_input_scale", "int? num_local_experts", "bool use_fused_finalize",
                "float? situ_beta", "str quant_mode", "Tensor? per_token_scale", "int[]? tactic",
                "Tensor[]? localized_weights", "bool enable_pdl"):
        assert arg in schema, arg


@pytest.mark.parametrize("mode,act", [("w4a4", "swiglu"), ("w4a4_pt", "relu2"), ("w4a8", "geglu_tanh"),
                                      ("w4a16", "situ_linear")])
def test_op_matches_functional_api(mode, act):
    case = make_case(mode, act)
    args, kw = op_args(case)
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    assert torch.equal(torch.ops.moe.fused(*args, **kw), expected)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_opcheck(mode):
    case = make_case(mode)
    args, kw = op_args(case, use_fused_finalize=False)
    torch.library.opcheck(torch.ops.moe.fused.default, args, kw)


def test_op_with_localized_shards_and_tactic():
    case = make_case("w4a4", hidden=256, inter=256)
    shards = moe_ext.split_localized_shards(case.prepared)
    flat = [s[k] for s in shards for k in ("w1_weight", "w1_weight_sf", "w2_weight", "w2_weight_sf")]
    args, kw = op_args(case, use_fused_finalize=False)
    full = torch.ops.moe.fused(*args, **kw)
    assert torch.equal(torch.ops.moe.fused(*args, **kw, localized_weights=flat, tactic=[128]), full)


class MoELayer(torch.nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x_bf16, ids, scales):
        c = self.case
        h = x_bf16 * 2.0  # some surrounding work the compiler fuses around the opaque op
        out = torch.ops.moe.fused(
            h, None, ids, scales, c.prepared.w1_weight, c.prepared.w1_weight_sf, c.prepared.w1_alpha, None,
            c.prepared.w2_weight, c.prepared.w2_weight_sf, c.prepared.w2_alpha, c.num_experts, ids.shape[1],
            quant_mode="w4a16", use_fused_finalize=False)
        return out + h


def test_torch_compile_fullgraph_has_no_graph_break():
    torch._dynamo.reset()
    case = make_case("w4a16", num_tokens=6)
    layer = MoELayer(case)
    x = case.bf16_x
    expected = layer(x, case.ids, case.scales)
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x, case.ids, case.scales)
    assert torch.equal(got, expected)
    assert not counters["graph_break"], dict(counters["graph_break"])
