"""Exact format vectors (hand-computed bytes) and round-trip properties of moe_ext.quant."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ext.quant import (
    deinterleave_up_gate,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    interleave_up_gate,
    mma_view,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_per_token,
    pack_e2m1,
    prepare_moe_weights,
    split_localized_shards,
    swizzle_sf,
    swizzled_size,
    ue8m0_encode_ceil,
    unpack_e2m1,
    unswizzle_sf,
)
from moe_ext.quant.fast_math import rcp_approx
from moe_ext.quant.formats import ue8m0_reciprocal
from moe_ext.quant.swizzle import sf_bytes, swizzle_offsets

floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 0xF, 0x8]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x8F]]
    assert unpack_e2m1(torch.tensor([0x21, 0x8F], dtype=torch.uint8)).tolist() == [1, 2, 0xF, 0x8]


def test_e2m1_table_and_rounding():
    assert e2m1_decode(torch.arange(16)).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30, -0.0, -0.3, -2.6, -100.0])
    # ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4; beyond 6 saturates
    assert e2m1_encode(x).tolist() == [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 8, 9, 13, 15]


def test_e4m3_saturates_and_rounds_to_even():
    x = torch.tensor([448.0, 464.0, 1e9, -1e9, 0.0, 2 ** -9, 2 ** -10, 1.0625, 1.1875])
    assert e4m3_encode(x).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x01, 0x00, 0x38, 0x3A]


def test_ue8m0_rounds_up_and_clamps():
    x = torch.tensor([1.0, 1.5, 2.0, 0.0, -3.0, 2.0 ** -127, 3e38, 2.0 ** -130, 2.0 ** -127 * 1.5])
    # 1.0 -> 127; 1.5 -> ceil -> 128; 0 and negatives -> 0; denormals at most half the range -> 0, above -> 1
    assert ue8m0_encode_ceil(x).tolist() == [127, 128, 128, 0, 0, 0, 254, 0, 1]
    assert ue8m0_reciprocal(torch.tensor([127, 128, 0, 254])).tolist() == [1.0, 0.5, 0.0, 0.0]


def test_swizzle_offsets_hand_computed():
    off = swizzle_offsets(2, 256, 8)  # m_tiles 2, k_tiles 2
    assert off[0, 0, 0] == 0
    assert off[0, 1, 0] == 16  # r % 32 steps 16 bytes
    assert off[0, 32, 0] == 4  # (r % 128) // 32 steps 4 bytes
    assert off[0, 127, 3] == 31 * 16 + 3 * 4 + 3
    assert off[0, 0, 4] == 512  # next k-tile atom
    assert off[0, 128, 0] == 2 * 512  # next m-tile skips k_tiles atoms
    assert off[1, 0, 0] == 2 * 2 * 512  # next expert
    assert swizzled_size(2, 256, 8) == 2048 * 2


def test_swizzle_pads_with_zero_and_mma_view_matches_flashinfer_strides():
    sf = torch.randint(1, 255, (3, 200, 5), dtype=torch.uint8)
    buf = swizzle_sf(sf)
    assert buf.numel() == 3 * 2 * 2 * 512
    mask = torch.zeros_like(buf, dtype=torch.bool)
    mask[swizzle_offsets(3, 200, 5).reshape(-1)] = True
    assert (buf[~mask] == 0).all()
    view = mma_view(buf, 3, 200, 5)
    assert view.shape == (32, 4, 2, 4, 2, 3)
    assert view.stride() == (16, 4, 1024, 1, 512, 2048)
    # element (r%32, (r%128)//32, r//128, c%4, c//4, e)
    r, c, e = 165, 4, 2
    assert view[r % 32, (r % 128) // 32, r // 128, c % 4, c // 4, e] == sf[e, r, c]


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 3), rows=st.integers(1, 300), cols=st.integers(1, 12), as_view=st.booleans(),
       dtype=st.sampled_from([torch.uint8, torch.float8_e4m3fn]))
def test_swizzle_round_trip_in_every_accepted_form(groups, rows, cols, as_view, dtype):
    sf = torch.randint(0, 127, (groups, rows, cols), dtype=torch.uint8)
    buf = swizzle_sf(sf)
    form = mma_view(buf, groups, rows, cols) if as_view else buf.reshape(-1, 4)
    assert torch.equal(unswizzle_sf(form.view(dtype), groups, rows, cols), sf)


def test_sf_bytes_rejects_wrong_sizes_and_layouts():
    buf = swizzle_sf(torch.zeros(1, 128, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="w1_weight_sf"):
        sf_bytes(buf[:-1], 512, "w1_weight_sf")
    with pytest.raises(ValueError, match="swizzled"):
        sf_bytes(buf.reshape(16, 32).t(), 512, "w1_weight_sf")
    with pytest.raises(TypeError, match="8-bit"):
        sf_bytes(buf.float(), 512, "w1_weight_sf")


def test_interleave_vector():
    w = torch.arange(256).reshape(256, 1)  # I = 128: up rows 0..127, gate rows 128..255
    phys = interleave_up_gate(w, dim=0).reshape(-1).tolist()
    assert phys[:64] == list(range(0, 64))  # up 0..63
    assert phys[64:128] == list(range(128, 192))  # gate 0..63
    assert phys[128:192] == list(range(64, 128))  # up 64..127
    assert phys[192:] == list(range(192, 256))  # gate 64..127
    with pytest.raises(ValueError, match="multiple of 128"):
        interleave_up_gate(torch.zeros(192, 4), dim=0)


@settings(max_examples=20, deadline=None)
@given(pairs=st.integers(1, 4), cols=st.integers(1, 5), experts=st.integers(1, 3))
def test_interleave_round_trip(pairs, cols, experts):
    w = torch.randn(experts, 128 * pairs, cols)
    assert torch.equal(deinterleave_up_gate(interleave_up_gate(w, dim=1), dim=1), w)


@settings(max_examples=50, deadline=None)
@given(st.lists(floats, min_size=1, max_size=64))
def test_e2m1_encode_picks_a_nearest_grid_value(values):
    x = torch.tensor(values, dtype=torch.float32).clamp(-6, 6)
    got = e2m1_decode(e2m1_encode(x))
    grid = e2m1_decode(torch.arange(16))
    best = (x[:, None] - grid).abs().min(dim=1).values
    assert torch.equal((got - x).abs(), best)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 4), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 999))
def test_block_quantizers_round_trip_within_format_error(rows, blocks, scale, seed):
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * scale
    amax = x.abs().reshape(rows, -1, 16).amax(-1, keepdim=True)
    # NVFP4 with gs = 2688/amax (keeps block scales out of the e4m3 denormals): each element within half an e2m1
    # step at the block's scale, plus the e4m3 rounding of that scale
    gs = 2688 / float(x.abs().max())
    q = nvfp4_quantize(x, gs)
    err = (nvfp4_dequantize(q.data, q.scale) / gs - x).abs().reshape(rows, -1, 16)
    assert (err <= amax * (1 / 6) * 1.07 + 1e-6).all()
    q = nvfp4_quantize_per_token(x, 1 / 2688)
    deq = nvfp4_dequantize(q.data, q.scale) * q.row_scale[:, None]
    assert ((deq - x).abs().reshape(rows, -1, 16) <= amax * (1 / 6) * 1.07 + 1e-6).all()
    # MX: power-of-two scale at most 2x the ideal one, so the error is within one e2m1/e4m3 step at that scale
    q = mxfp4_quantize(x)
    amax32 = x.abs().reshape(rows, -1, 32).amax(-1, keepdim=True)
    assert ((mxfp4_dequantize(q.data, q.scale) - x).abs().reshape(rows, -1, 32) <= amax32 / 3 + 1e-6).all()
    q = mxfp8_quantize(x)
    assert ((mxfp8_dequantize(q.data, q.scale) - x).abs().reshape(rows, -1, 32) <= amax32 / 16 + 1e-6).all()


def test_mxfp8_scale_code_is_the_round_up_exponent():
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0 * 2 ** 3  # amax/448 = 8 exactly -> code 130, values land on e4m3 exactly
    x[0, 1] = -448.0
    q = mxfp8_quantize(x)
    assert q.scale.tolist() == [[130]]
    assert mxfp8_dequantize(q.data, q.scale)[0, :2].tolist() == [3584.0, -448.0]
    x[0, 0] = 448.0 * 8.5  # not a power of two: round the exponent up
    assert mxfp8_quantize(x).scale.tolist() == [[131]]


@pytest.mark.parametrize("mode", ["w4a4", "w4a8", "w4a16"])
def test_prepare_moe_weights_layout_and_alphas(mode):
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(3, 256, 128, generator=g), torch.randn(3, 128, 128, generator=g)
    p = prepare_moe_weights(w1, w2, mode, x_global_scale=10.0, fc2_input_scale=4.0)
    block = 32 if mode == "w4a8" else 16
    assert p.w1_weight.shape == (3, 256, 64) and p.w1_weight.dtype == torch.uint8
    assert p.w2_weight.shape == (3, 128, 64)
    assert p.w1_weight_sf.shape == (32, 4, 2, 4, -(-128 // block // 4), 3)
    gs1 = 2688 / w1.abs().amax(dim=(1, 2))
    gs2 = 2688 / w2.abs().amax(dim=(1, 2))
    if mode == "w4a4":
        torch.testing.assert_close(p.w1_alpha, 1 / (10.0 * gs1))
        torch.testing.assert_close(p.w2_alpha, 1 / (4.0 * gs2))
        assert p.fc2_input_scale.tolist() == [4.0]
    elif mode == "w4a16":
        torch.testing.assert_close(p.w1_alpha, 1 / gs1)
        assert p.fc2_input_scale is None
    else:
        assert p.w1_alpha.tolist() == [1.0] * 3 and p.fc2_input_scale is None
    # The SF rows follow the interleaved physical rows: re-quantizing the interleaved weight gives equal bytes.
    phys = interleave_up_gate(w1, dim=1)
    if mode != "w4a8":
        q = nvfp4_quantize(phys, (2688 / w1.abs().amax(dim=(1, 2))))
        assert torch.equal(q.data, p.w1_weight)
        assert torch.equal(unswizzle_sf(p.w1_weight_sf, 3, 256, 128 // block), q.scale)


def test_localized_shards_split_rows_and_reswizzle():
    g = torch.Generator().manual_seed(1)
    p = prepare_moe_weights(torch.randn(2, 512, 256, generator=g), torch.randn(2, 256, 256, generator=g))
    shards = split_localized_shards(p)
    assert [s["w1_weight"].shape for s in shards] == [(2, 256, 128)] * 2
    assert [s["w2_weight"].shape for s in shards] == [(2, 128, 128)] * 2
    full = unswizzle_sf(p.w1_weight_sf, 2, 512, 16)
    assert torch.equal(torch.cat([s["w1_weight"] for s in shards], 1), p.w1_weight)
    assert torch.equal(torch.cat([unswizzle_sf(s["w1_weight_sf"], 2, 256, 16) for s in shards], 1), full)


def test_rcp_approx_is_the_exact_reciprocal_on_the_cpu():
    x = torch.tensor([6.0, 448.0, 3.0, 1 / 2688, 0.0])
    assert torch.equal(rcp_approx(x), 1.0 / x)
    assert rcp_approx(6.0).dtype == torch.float32 and float(rcp_approx(6.0)) == float(torch.tensor(1 / 6.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rcp_approx_on_cuda_is_within_one_ulp_and_exact_on_powers_of_two():
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.rand(1 << 20, generator=g) * 60 - 30)
    approx = rcp_approx(x.cuda()).cpu()
    exact = 1.0 / x
    ulps = (approx.view(torch.int32).long() - exact.view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 1
    powers = torch.exp2(torch.arange(-30.0, 31.0))
    assert torch.equal(rcp_approx(powers.cuda()).cpu(), 1.0 / powers)
    assert torch.isinf(rcp_approx(torch.zeros(1, device="cuda"))).all()
