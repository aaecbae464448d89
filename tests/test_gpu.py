"""GPU checks of what exists today: the reference path on CUDA equals the CPU one, and the C++ launcher sees the
device. Skipped without a CUDA device."""
import pytest
import torch
from conftest import MODES, gpu, make_case

import moe_ext

pytestmark = [pytest.mark.gpu, gpu]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fused", [True, False])
def test_reference_on_cuda_matches_cpu(mode, fused):
    case = make_case(mode, "swiglu_oai", num_tokens=33, top_k=4, num_experts=16, ep=2, rank=1, seed=2,
                     invalid_fraction=0.05)
    cpu = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    cuda_case = case.to("cuda")
    out = moe_ext.cute_dsl_fused_moe(**cuda_case.kwargs(use_fused_finalize=fused))
    assert out.device.type == "cuda"
    rel = (out.cpu().float() - cpu.float()).norm() / cpu.float().norm()
    assert rel < 5e-3, rel  # cuBLAS and CPU sum in different orders


def test_wrapper_on_cuda_reuses_its_buffers():
    case = make_case("w4a16", num_tokens=16).to("cuda")
    wrapper = moe_ext.CuteDslMoEWrapper(8, 2, 128, 128, max_num_tokens=16, quant_mode="w4a16", device="cuda",
                                        use_cuda_graph=True)
    kw = {k: v for k, v in case.kwargs().items() if k in (
        "x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf", "w1_alpha",
        "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha")}
    a = wrapper.run(**kw)
    b = wrapper.run(**kw)
    assert a.data_ptr() == b.data_ptr() == wrapper.workspace.output.data_ptr()
    assert wrapper.aux_stream is not None


def test_device_mismatch_is_rejected():
    case = make_case("w4a16")
    kw = case.kwargs()
    kw["x"] = kw["x"].cuda()
    with pytest.raises(ValueError, match="must be on cuda"):
        moe_ext.cute_dsl_fused_moe(**kw)


def test_launcher_sees_the_device():
    C = pytest.importorskip("moe_ext._C")
    assert C.device_count() >= 1
    info = C.device_info(0)
    major, minor = torch.cuda.get_device_capability(0)
    assert (info.major, info.minor) == (major, minor)
    assert info.sm_count == torch.cuda.get_device_properties(0).multi_processor_count
    assert info.supports_pdl == (major >= 9)
