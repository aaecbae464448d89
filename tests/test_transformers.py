"""Swapping transformers MoE blocks (Mixtral, Qwen3-MoE, DeepSeek-V3) for the fused MoE, on tiny random models."""
import copy

import pytest
import torch
from conftest import hopper_kernels

transformers = pytest.importorskip("transformers")

from moe_ext.integrations.transformers import FusedMoEBlock, swap_moe_blocks  # noqa: E402
from moe_ext.quant.interleave import deinterleave_up_gate  # noqa: E402
from moe_ext.reference import dequantize_expert  # noqa: E402


def tiny(family):
    common = dict(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=128, num_key_value_heads=2, num_local_experts=8,
                                         num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(cfg)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=128,
                                          num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, head_dim=32)
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.DeepseekV3Config(**common, intermediate_size=256, moe_intermediate_size=128,
                                        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
                                        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                        v_head_dim=32)
    return transformers.DeepseekV3ForCausalLM(cfg)


def moe_blocks(model):
    return [m for m in model.modules() if isinstance(m, FusedMoEBlock)]


def dequantized_block(original, fused):
    """The original block with its experts replaced by the fused block's dequantized 4-bit weights: the exact
    function the w4a16 fused block computes, up to fp32-vs-bf16 rounding."""
    block = copy.deepcopy(original)
    mode = fused.quant_mode
    w1 = torch.stack([dequantize_expert(fused.w1_weight, fused.w1_weight_sf, e, mode) * fused.w1_alpha[e]
                      for e in range(fused.num_experts)])
    w2 = torch.stack([dequantize_expert(fused.w2_weight, fused.w2_weight_sf, e, mode) * fused.w2_alpha[e]
                      for e in range(fused.num_experts)])
    up_gate = deinterleave_up_gate(w1, dim=1)
    inter = up_gate.shape[1] // 2
    block.experts.gate_up_proj.data = torch.cat((up_gate[:, inter:], up_gate[:, :inter]), dim=1)
    block.experts.down_proj.data = w2
    return block


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_fused_block_computes_the_block_on_its_quantized_experts(family):
    torch.manual_seed(0)
    model = tiny(family).eval()
    original = [m for m in model.modules() if type(m).__name__.endswith(("SparseMoeBlock", "MoE"))][0]
    fused = FusedMoEBlock(original, "w4a16", use_fused_finalize=False)
    hidden = torch.randn(2, 5, 128)
    with torch.no_grad():
        expected = dequantized_block(original, fused)(hidden)
        got = fused(hidden)
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 1e-2, rel  # only the bf16 rounding of the FC2 input and of each expert output differ


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode,bound", [("w4a16", 0.25), ("w4a4", 0.35), ("w4a8", 0.35)])
def test_swapped_model_logits_stay_close(family, mode, bound):
    torch.manual_seed(1)
    model = tiny(family).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        reference = model(ids).logits
        assert swap_moe_blocks(model, mode) == 2
        assert len(moe_blocks(model)) == 2
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    rel = float((logits - reference).norm() / reference.norm())
    assert rel < bound, rel  # 4-bit experts: the bound is the format's error, not a rounding tolerance


def test_swapped_block_compiles_without_graph_breaks():
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = tiny("qwen3_moe").eval()
    swap_moe_blocks(model, "w4a16")
    block = moe_blocks(model)[0]
    hidden = torch.randn(1, 4, 128)
    with torch.no_grad():
        expected = block(hidden)
        got = torch.compile(block, fullgraph=True)(hidden)
    assert torch.equal(got, expected)


def test_casting_the_model_keeps_the_fp32_expert_scales():
    torch.manual_seed(3)
    model = tiny("mixtral").eval()
    swap_moe_blocks(model, "w4a4")
    block = moe_blocks(model)[0]
    alpha = block.w1_alpha.clone()
    model.to(torch.bfloat16)
    assert block.w1_alpha.dtype == torch.float32 and torch.equal(block.w1_alpha, alpha)
    assert block.fc2_input_scale.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 64, (1, 5))).logits).all()


def test_expert_biases_are_refused():
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, head_dim=32)
    model = transformers.GptOssForCausalLM(cfg)
    with pytest.raises(ValueError, match="expert biases"):
        swap_moe_blocks(model, "w4a16")


@pytest.mark.gpu
@hopper_kernels
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode,bound", [("w4a16", 0.25), ("w4a4", 0.35), ("w4a8", 0.35)])
def test_swapped_model_runs_on_the_hopper_kernels(family, mode, bound):
    """The swapped model on the GPU: its MoE blocks launch the sm_90a kernels, the logits match the same swapped
    model on the CPU reference path, and stay within the format's error of the original model."""
    from moe_ext import launcher

    torch.manual_seed(1)
    model = tiny(family).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        original = model(ids).logits
        swap_moe_blocks(model, mode)
        on_cpu = model(ids).logits
        model = model.to("cuda")
        with launcher.recording() as launches:
            on_gpu = model(ids.cuda()).logits.cpu()
    names = {step.name for step in launches if isinstance(step, launcher.Launch)}
    # At these few tokens a layer may take the one-launch forward (launcher.FUSED_DECODE); otherwise the chain runs:
    # the routing launch (in w4a4 / w4a8 decoding x), GEMM1 and GEMM2.
    chain = (set(launcher.mode_kernels(mode)) <= names and any(n.startswith("moe_gemm1_") for n in names)
             and any(n.startswith("moe_gemm2_") for n in names))
    one_launch = names and all(n.startswith(f"moe_decode_{mode}_") for n in names)
    assert chain or one_launch, names
    assert torch.isfinite(on_gpu).all()
    rel = float((on_gpu - on_cpu).norm() / on_cpu.norm())
    assert rel < 3e-2, rel
    rel = float((on_gpu - original).norm() / original.norm())
    assert rel < bound, rel
