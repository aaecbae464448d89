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
