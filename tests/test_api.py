"""The public API: FlashInfer's signature, the deprecated alias, output handling, ActivationType values."""
import inspect
import pathlib
from typing import Tuple

import pytest
import torch
from conftest import make_case

import moe_ext
from moe_ext import ActivationType

SEED_SIGNATURE = (
    "x: Tensor, x_sf: Tensor | None, token_selected_experts: Tensor, token_final_scales: Tensor, w1_weight: Tensor, "
    "w1_weight_sf: Tensor, w1_alpha: Tensor, fc2_input_scale: Tensor | None, w2_weight: Tensor, w2_weight_sf: Tensor, "
    "w2_alpha: Tensor, num_experts: int, top_k: int, num_local_experts: int | None = None, local_expert_offset: int = "
    "0, output_dtype: dtype = torch.bfloat16, use_fused_finalize: bool = True, moe_output: Tensor | None = None, "
    "aux_stream: Stream | None = None, enable_pdl: bool = True, activation_type: int = 3, swiglu_alpha: float = 1.0, "
    "swiglu_beta: float = 0.0, swiglu_limit: float = 3.4028234663852886e+38, situ_beta: float | None = None, "
    "situ_linear_beta: float | None = None, *, quant_mode: str = 'w4a4', per_token_scale: Tensor | None = None, "
    "tactic: Tuple | None = None, localized_weights: list | None = None, localized_streams: list | None = None, "
    "localized_sm_count: int | None = None, localized_memset_stream: Stream | None = None, "
    "localized_allow_nonlocalized: bool = False, autotune_use_cuda_graph: bool = False"
)
SEED_FILE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "seed" / "cute_dsl_fused_moe.txt"


def seed_signature() -> inspect.Signature:
    namespace = dict(Tensor=torch.Tensor, Stream=torch.cuda.Stream, dtype=torch.dtype, Tuple=Tuple, torch=torch)
    exec(f"def f({SEED_SIGNATURE}) -> Tensor: pass", namespace)
    return inspect.signature(namespace["f"])


@pytest.mark.skipif(not SEED_FILE.exists(), reason="shared/seed not beside this checkout")
def test_embedded_signature_is_the_seed_text():
    text = SEED_FILE.read_text()
    assert f"cute_dsl_fused_moe({SEED_SIGNATURE}) → Tensor" in text


def test_signature_equals_the_seed_parameter_for_parameter():
    ours = inspect.signature(moe_ext.cute_dsl_fused_moe).parameters
    seed = seed_signature().parameters
    assert list(ours) == list(seed)
    for name, p in seed.items():
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name


def test_nvfp4_is_a_deprecated_alias_of_w4a4():
    case = make_case("w4a4")
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    with pytest.warns(DeprecationWarning, match="nvfp4"):
        got = moe_ext.cute_dsl_fused_moe(**case.kwargs(quant_mode="nvfp4"))
    assert torch.equal(got, expected)


def test_writes_into_moe_output_and_returns_its_rows():
    case = make_case("w4a16", num_tokens=6)
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    buffer = torch.full((10, 128), 3.0, dtype=torch.bfloat16)
    got = moe_ext.cute_dsl_fused_moe(**case.kwargs(moe_output=buffer))
    assert got.data_ptr() == buffer.data_ptr() and got.shape == (6, 128)
    assert torch.equal(buffer[:6], expected)
    assert (buffer[6:] == 3.0).all()


def test_scale_factor_forms_are_interchangeable():
    case = make_case("w4a4")
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    view = case.prepared.w1_weight_sf
    flat = torch.as_strided(view, (view.numel(),), (1,), view.storage_offset())
    for form in (flat, flat.reshape(-1, 4), flat.view(torch.float8_e4m3fn)):
        assert torch.equal(moe_ext.cute_dsl_fused_moe(**case.kwargs(w1_weight_sf=form)), expected)
    x_sf3 = case.quantized.x_sf[..., None]
    assert torch.equal(moe_ext.cute_dsl_fused_moe(**case.kwargs(x_sf=x_sf3)), expected)
    int64_ids = case.ids.long()
    assert torch.equal(moe_ext.cute_dsl_fused_moe(**case.kwargs(token_selected_experts=int64_ids)), expected)


def test_activation_type_values_match_flashinfer():
    assert (ActivationType.Swiglu, ActivationType.Relu2, ActivationType.GegluTanh) == (3, 6, 8)
    assert ActivationType.Situ == 10


def test_activations_change_the_result():
    outs = {}
    for act in ("swiglu", "swiglu_oai", "situ", "situ_linear", "geglu_tanh"):
        case = make_case("w4a16", act, seed=11)
        outs[act] = moe_ext.cute_dsl_fused_moe(**case.kwargs()).float()
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(outs[a], outs[b]), (a, b)


def test_zero_tokens():
    case = make_case("w4a16", num_tokens=0)
    out = moe_ext.cute_dsl_fused_moe(**case.kwargs())
    assert out.shape == (0, 128)


def test_examples_serving_loop_and_compiled_layer_run_on_cpu():
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    loop = subprocess.run([sys.executable, str(root / "examples" / "serving_loop.py"), "--batch", "4", "--steps", "2",
                           "--experts", "8", "--hidden", "256", "--intermediate", "128"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert loop.returncode == 0, loop.stderr[-2000:]
    assert "tokens/s" in loop.stdout
    layer = subprocess.run([sys.executable, str(root / "examples" / "compile_layer.py"), "--tokens", "8"],
                           capture_output=True, text=True, timeout=600, env=env)
    assert layer.returncode == 0, layer.stderr[-2000:]
    assert "graph breaks 0" in layer.stdout
