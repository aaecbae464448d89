"""The C++ launcher module (built when a CUDA toolkit is present at install time)."""
import pytest

C = pytest.importorskip("moe_ext._C", reason="launcher not built (no CUDA toolkit at install time)")


def test_pointer_and_extent_checks():
    C.check_pointer("x", 256, 16)
    with pytest.raises(ValueError, match="x: pointer is not 16-byte aligned"):
        C.check_pointer("x", 8, 16)
    with pytest.raises(ValueError, match="power of two"):
        C.check_pointer("x", 8, 12)
    C.check_divisible("H", 7168, 128)
    with pytest.raises(ValueError, match="H: extent 2880 is not a multiple of 128"):
        C.check_divisible("H", 2880, 128)


def test_device_queries_do_not_raise_without_a_gpu():
    assert C.device_count() >= 0
    assert C.cuda_runtime_version() >= 12000
    assert isinstance(C.kernels(), list)


def test_launch_plan_checks_every_step_when_it_is_built():
    """A recorded forward is checked once, when its steps are added (no GPU needed); run() only patches the
    per-call pointers."""
    if not hasattr(C, "LaunchPlan") or "moe_finalize" not in C.kernels():
        pytest.skip("launcher built without the kernels")
    plan = C.LaunchPlan()
    buffers = [(4096, 8), (8192, 2), (12288, 2), (16384, 8)]
    plan.add_launch("moe_finalize", buffers, [128.0, 2.0], True, 0, [(2, 3)])
    plan.add_memset(16384, 16, 0)
    assert len(plan) == 2
    with pytest.raises(ValueError, match="expected 4 tensors and 2 scalars"):
        plan.add_launch("moe_finalize", buffers[:3], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="null pointer"):
        plan.add_launch("moe_finalize", [(0, 8)] + buffers[1:], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        plan.add_launch("moe_finalize", [(4097, 8)] + buffers[1:], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="bad patch"):
        plan.add_launch("moe_finalize", buffers, [128.0, 2.0], True, 0, [(7, 0)])
    with pytest.raises(ValueError, match="no kernel named"):
        plan.add_launch("moe_nothing", buffers, [], True, 0, [])


def test_token_slabs_hold_each_routed_row_where_the_staging_would_store_it():
    """moe_ext.slabs.token_slabs (the slab GEMM1's tokens): routing tile m's step s is `tile` rows of RING_PITCH
    bytes at (m * steps + s) * tile * RING_PITCH; value k of the step of routed row r (token = permuted_to_expanded /
    top_k) sits in 16-byte chunk chunk_position(k // 8) at pair slot 2 (k % 4) + (k % 8) // 4, times 2^63, where
    the token tile's staging stores it; rows past a tile's limit and the pitch padding stay zero."""
    import torch

    from moe_ext import launcher, slabs
    from moe_ext.routing import compute_routing

    gen = torch.Generator().manual_seed(3)
    tokens, hidden, experts, top_k, tile = 5, 256, 8, 2, 16
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    r = compute_routing(torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.int(), experts, 0, tile)
    got = slabs.token_slabs(x, r.permuted_to_expanded, r.tile_to_mn_limit, int(r.num_live_tiles), tile, top_k)
    steps, slabs_bytes = hidden // 128, got.numel()
    assert slabs_bytes == slabs.slab_bytes(r.permuted_to_expanded.numel(), hidden)
    got = got.view(torch.bfloat16).view(-1, steps, tile, slabs.RING_PITCH // 2).float()
    expected = torch.zeros_like(got)
    for p in range(r.permuted_to_expanded.numel()):
        m, row = divmod(p, tile)
        if m >= int(r.num_live_tiles) or p >= int(r.tile_to_mn_limit[m]):
            continue
        token = int(r.permuted_to_expanded[p]) // top_k
        for k in range(hidden):
            s, c, v = k // 128, (k % 128) // 8, k % 8
            expected[m, s, row, 8 * slabs.chunk_position(c) + 2 * (v % 4) + v // 4] = float(x[token, k]) * 2.0 ** 63
    assert torch.equal(got, expected)
    assert launcher.slab_elements(r.permuted_to_expanded.numel(), hidden) * 2 == slabs_bytes
