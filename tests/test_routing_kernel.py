"""The sm_90a routing kernel against moe_ext.routing (the spec), eagerly and inside a CUDA graph."""
import pytest
import torch
from conftest import gpu, routing

from moe_ext import launcher
from moe_ext.routing import compute_routing

pytestmark = [
    pytest.mark.gpu, gpu,
    pytest.mark.skipif(not launcher.has_kernel("moe_routing"), reason="launcher built without the sm_90a kernels"),
]


def assert_same_routing(got, want, ids, num_local, offset):
    """Equal up to the order of rows inside an expert, which the kernel's atomics leave free."""
    for name in ("expert_counts", "expert_offsets", "tile_to_expert", "tile_to_mn_limit", "num_live_tiles"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
    e2p = got.expanded_to_permuted.cpu().long()
    p2e = got.permuted_to_expanded.cpu().long()
    local = ids.cpu().long() - offset
    is_local = (local >= 0) & (local < num_local)
    assert torch.equal(e2p >= 0, is_local)
    assert torch.equal(e2p[~is_local], torch.full_like(e2p[~is_local], -1))
    offsets = want.expert_offsets.cpu().long()
    counts = want.expert_counts.cpu().long()
    rows = e2p[is_local]
    experts = local[is_local]
    assert ((rows >= offsets[experts]) & (rows < offsets[experts] + counts[experts])).all()
    assert torch.equal(p2e[rows], torch.nonzero(is_local.reshape(-1)).reshape(-1))
    valid = torch.zeros_like(p2e, dtype=torch.bool)
    valid[rows] = True
    assert (p2e[~valid] == -1).all(), "padding rows must be -1"


CASES = [  # (T, K, num_experts, num_local, offset, tile)
    (1, 1, 8, 8, 0, 128), (7, 2, 8, 8, 0, 128), (128, 8, 256, 256, 0, 128), (515, 8, 256, 32, 224, 128),
    (4096, 8, 256, 32, 96, 128), (1280, 8, 384, 48, 0, 64), (33, 4, 2048, 2048, 0, 256), (16384, 8, 128, 128, 0, 128),
    (4096, 8, 256, 256, 0, 144),  # the padded wgmma tile: not a power of two
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("pdl", [True, False])
def test_routing_kernel_matches_spec(case, pdl):
    T, K, num_experts, num_local, offset, tile = case
    g = torch.Generator().manual_seed(T * 31 + K)
    ids, _ = routing(T, K, num_experts, g, invalid_fraction=0.05)
    ids = ids.cuda()
    out = launcher.allocate_routing(T, K, num_local, tile, "cuda")
    for t in (out.expert_counts, out.expert_offsets, out.expanded_to_permuted, out.permuted_to_expanded,
              out.tile_to_expert, out.tile_to_mn_limit, out.num_live_tiles):
        t.fill_(0x5A5A5A5A)  # poison: every output must be written
    launcher.route(ids, num_local, offset, out, enable_pdl=pdl)
    torch.cuda.synchronize()
    assert_same_routing(out, compute_routing(ids.cpu(), num_local, offset, tile), ids, num_local, offset)


def test_routing_kernel_replays_in_a_cuda_graph_with_new_routing():
    T, K, E = 64, 8, 256
    static_ids = torch.zeros(T, K, dtype=torch.int32, device="cuda")
    out = launcher.allocate_routing(T, K, E, 128, "cuda")
    launcher.route(static_ids, E, 0, out)  # warm-up outside capture loads the cubin
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher.route(static_ids, E, 0, out)
    g = torch.Generator().manual_seed(0)
    for step in range(100):
        ids, _ = routing(T, K, E, g, invalid_fraction=0.02 * (step % 3))
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_routing(out, compute_routing(ids, E, 0, 128), ids, E, 0)


def test_routing_launcher_rejects_bad_buffers():
    out = launcher.allocate_routing(4, 2, 8, 128, "cuda")
    ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="int32"):
        launcher.route(ids, 8, 0, out)
    with pytest.raises(ValueError, match="num_experts must be in"):
        launcher.route(ids.int(), 4096, 0, launcher.allocate_routing(4, 2, 4096, 128, "cuda"))


@pytest.mark.skipif(not launcher.has_kernel("moe_token_slabs"), reason="launcher built without the token-slab gather")
@pytest.mark.parametrize("case", [(5, 2, 8, 8, 0, 16, 256), (256, 8, 256, 32, 96, 16, 7168),
                                  (300, 4, 128, 128, 0, 32, 2944), (1, 8, 256, 256, 0, 32, 1024)], ids=str)
def test_token_slab_gather_writes_moe_ext_slabs_layout(case):
    """The gather launch after the routing (moe_token_slabs) writes every live routed row of x in the token slab
    layout of moe_ext.slabs bit for bit, and leaves padding rows as they were (the slab GEMM1 copies live rows
    only)."""
    from moe_ext import slabs

    T, K, num_experts, num_local, offset, tile, hidden = case
    g = torch.Generator().manual_seed(T + hidden)
    ids, _ = routing(T, K, num_experts, g, invalid_fraction=0.05)
    out = launcher.allocate_routing(T, K, num_local, tile, "cuda")
    launcher.route(ids.cuda(), num_local, offset, out)
    x = (torch.randn(T, hidden, generator=g) * 4).to(torch.bfloat16).cuda()
    rows = out.permuted_to_expanded.numel()
    buffer = torch.full((launcher.slab_elements(rows, hidden),), float("nan"), dtype=torch.bfloat16, device="cuda")
    launcher.launch("moe_token_slabs", [x.reshape(-1), out.permuted_to_expanded, out.tile_to_mn_limit,
                                        out.num_live_tiles, buffer], [hidden, K, tile], True, x.device)
    torch.cuda.synchronize()
    want = slabs.token_slabs(x, out.permuted_to_expanded, out.tile_to_mn_limit, int(out.num_live_tiles), tile, K)
    got = buffer.view(torch.uint8).view(rows // tile, hidden // 128, tile, slabs.RING_PITCH)
    want = want.view(rows // tile, hidden // 128, tile, slabs.RING_PITCH)
    limits = out.tile_to_mn_limit.cpu()
    live = torch.tensor([m < int(out.num_live_tiles) and m * tile + r < int(limits[m])
                         for m in range(rows // tile) for r in range(tile)]).view(rows // tile, tile).cuda()
    written = live[:, None, :, None].expand_as(got).clone()
    written[..., 256:] = False  # a row's 16 pitch bytes are never written nor read
    assert torch.equal(got[written], want[written])
    untouched = buffer.view(rows // tile, hidden // 128, tile, slabs.RING_PITCH // 2)
    assert torch.isnan(untouched[~live[:, None, :, None].expand_as(untouched)]).all(), "padding rows written"
