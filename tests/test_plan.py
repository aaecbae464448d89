"""ForwardPlan: a recorded forward replays its launches with the next call's per-call tensors, and refuses (so the
validated path runs) whatever it was not recorded for."""
import contextlib

import pytest
import torch
from conftest import RUN_ARGS, make_case

import moe_ext
from moe_ext import launcher
from moe_ext.launcher import Launch
from moe_ext.plan import ROLES, ForwardPlan


class FakeModule:
    def __init__(self):
        self.calls = []

    def launch(self, name, buffers, scalars, pdl, stream):
        self.calls.append((name, buffers, scalars, pdl))

    def memset_async(self, ptr, nbytes, stream):
        self.calls.append(("memset", [(ptr, nbytes)], [], False))


def recorded_run(weights, inputs):
    """What launcher.recording() collects for a forward: routing reads the ids, GEMM1 reads x and w1, finalize
    reads the router weights; per-call buffers carry their role."""
    ptr = lambda t: (t.data_ptr(), t.numel())  # noqa: E731
    return [Launch("moe_routing", [ptr(inputs["token_selected_experts"]), (1234, 8)], [8.0, 0.0, 8.0], True,
                   ((0, "token_selected_experts"),)),
            Launch("moe_gemm1", [ptr(inputs["x"]), ptr(weights[0]), (5678, 16)], [128.0, 1.0], True, ((0, "x"),)),
            Launch("moe_finalize", [ptr(inputs["token_final_scales"]), (9999, 64)], [128.0], False,
                   ((0, "token_final_scales"),))]


def issued(recorded):
    """The launches as the C++ launcher receives them."""
    return [(step.name, step.buffers, step.scalars, step.pdl) for step in recorded]


def make_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(2, 128, generator=g).bfloat16(), x_sf=None,
                token_selected_experts=torch.randint(0, 8, (2, 4), generator=g, dtype=torch.int32),
                token_final_scales=torch.rand(2, 4, generator=g), per_token_scale=None)


def test_plan_substitutes_the_new_inputs_and_keeps_everything_else(monkeypatch):
    weights = (torch.zeros(8, 256, 64, dtype=torch.uint8), None)
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    first = make_inputs(0)
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    plan = ForwardPlan.from_recording(recorded_run(weights, first), weights, first, out, tuning_generation=3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    second = make_inputs(1)
    assert plan.matches(weights, 3)
    assert plan.run(second) is out
    assert [c[0] for c in fake.calls] == ["moe_routing", "moe_gemm1", "moe_finalize"]
    assert fake.calls == issued(recorded_run(weights, second))  # same kernels, scalars, fixed buffers; new pointers


def test_plan_refuses_what_it_was_not_recorded_for(monkeypatch):
    weights = (torch.zeros(8, 256, 64, dtype=torch.uint8), None)
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    first = make_inputs(0)
    plan = ForwardPlan.from_recording(recorded_run(weights, first), weights, first, torch.empty(2, 128),
                                      tuning_generation=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    assert not plan.matches((weights[0].clone(), None), 0), "another weight tensor"
    assert not plan.matches(weights, 1), "the tactic cache changed"
    wrong = [dict(make_inputs(1), x=torch.randn(3, 128).bfloat16()),  # another T
             dict(make_inputs(1), token_final_scales=torch.rand(4, 2).t()),  # not contiguous
             dict(make_inputs(1), x_sf=torch.zeros(2, 8, dtype=torch.uint8)),  # an input the run did not have
             dict(make_inputs(1), token_selected_experts=torch.zeros(2, 4, dtype=torch.int64))]  # dtype
    for inputs in wrong:
        assert plan.run(inputs) is None
    assert fake.calls == [], "nothing is launched when the plan does not fit"


def test_an_input_aliasing_a_fixed_buffer_is_patched_only_where_it_is_an_input(monkeypatch):
    """x may be the output buffer of the same wrapper (a layer applied twice): only its input position moves."""
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    weights = (torch.zeros(4, dtype=torch.uint8),)
    first = make_inputs(0)
    recorded = recorded_run(weights, first)
    finalize = recorded[2]  # finalize writes at x
    recorded[2] = finalize._replace(buffers=finalize.buffers[:1] + [(first["x"].data_ptr(), 256)])
    plan = ForwardPlan.from_recording(recorded, weights, first, torch.empty(1), 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    second = make_inputs(1)
    plan.run(second)
    assert fake.calls[1][1][0] == (second["x"].data_ptr(), second["x"].numel())  # GEMM1 reads the new x
    assert fake.calls[2][1][1] == (first["x"].data_ptr(), 256)  # finalize still writes the recorded buffer


def test_a_recording_whose_inputs_were_copied_is_not_planned(monkeypatch):
    monkeypatch.setattr(launcher, "_module", lambda: FakeModule())
    weights = (torch.zeros(4, dtype=torch.uint8),)
    first = make_inputs(0)
    recorded = recorded_run(weights, dict(first, x=first["x"].clone()))  # validation made its own copy of x
    assert ForwardPlan.from_recording(recorded, weights, first, torch.empty(1), 0) is None


def test_tuning_cache_changes_are_counted():
    from moe_ext.tuning import AutoTuner

    cache = AutoTuner.get().cache
    before = cache.generation
    cache["k"] = (1,)
    cache.pop("k")
    assert cache.generation == before + 2


def test_a_larger_workspace_drops_the_recorded_plans():
    case = make_case("w4a16", num_tokens=4)
    wrapper = moe_ext.CuteDslMoEWrapper(case.num_experts, 2, 128, 128, quant_mode="w4a16", device="cpu")
    wrapper._plans[("stale",)] = object()
    wrapper.run(**{k: v for k, v in case.kwargs().items() if k in RUN_ARGS})
    assert ("stale",) not in wrapper._plans



class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class FakeForkJoin:
    """moe_ext.streams.ForkJoin's interface, noting its calls in the fake module's log."""

    def __init__(self, log, handles):
        self.log, self.streams = log, [FakeStream(h) for h in handles]

    def fork(self):
        self.log.append(("fork", [], [], False))

    def join(self):
        self.log.append(("join", [], [], False))


def fake_forward(monkeypatch, mode, fused, shards=False, aux=False, per_token=False, tile=8, k_splits=(1, 2)):
    """launcher.forward on CPU tensors with the C++ module, streams and events faked: (recorded steps, log of
    what the module saw, kwargs, out)."""
    from moe_ext.problem import build_problem

    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(0))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def fake_route(ids, *args, decode=None, k_permuted=False):  # the routing launch with its ids (and what it
        # decodes or copies), no maps
        name = "moe_routing" if decode is None else f"moe_routing_decode_{decode[0]}"
        tensors = [launcher._check("token_selected_experts", ids, torch.int32, ids.device), *(decode or ())[1:]]
        launcher.launch(name, tensors, [], True, ids.device)

    monkeypatch.setattr(launcher, "route", fake_route)
    case = make_case(mode, num_tokens=5, top_k=2, num_experts=8, hidden=256, inter=256)
    kw = case.kwargs(use_fused_finalize=fused)
    if per_token:
        kw["per_token_scale"] = torch.rand(5) + 0.5
    if shards:
        kw["localized_weights"] = moe_ext.split_localized_shards(case.prepared)
    problem = build_problem(**kw)
    routing = launcher.allocate_routing(5, 2, 8, tile, "cpu")
    rows = routing.permuted_to_expanded.numel()
    buffers = launcher.KernelBuffers.allocate(mode, rows, 256, 5, 2, 256, "cpu", slab_rows=rows)
    out = torch.empty(5, 256, dtype=torch.bfloat16)
    with launcher.recording() as recorded:
        launcher.forward(problem, routing, buffers, out, True, k_splits,
                         aux=FakeForkJoin(fake.calls, [7]) if aux else None,
                         shard_streams=FakeForkJoin(fake.calls, [11, 12]) if shards else None)
    return recorded, fake.calls, kw, out


@pytest.mark.parametrize("mode,per_token", [("w4a16", False), ("w4a4", False), ("w4a4", True), ("w4a8", False)])
@pytest.mark.parametrize("fused", [False, True])
def test_the_kernel_forward_marks_exactly_the_per_call_buffers(monkeypatch, mode, per_token, fused):
    """Every launch gets plain (pointer, numel) buffers, and the recorded roles are the activations, router
    weights and ids of this call."""
    recorded, calls, kw, out = fake_forward(monkeypatch, mode, fused, per_token=per_token)
    launches = [step for step in recorded if isinstance(step, Launch)]
    kernel_mode = "w4a4_pt" if per_token else mode
    assert launches[0].name == ("moe_routing" if mode == "w4a16" else
                                f"moe_routing_decode_{launcher.X_FORMAT[kernel_mode]}")
    assert all(isinstance(p, int) and isinstance(n, int) for _, bufs, *_ in calls for p, n in bufs)
    roles = {role for step in launches for _, role in step.roles}
    expected = {"x", "token_selected_experts", "token_final_scales"}
    expected |= {"x_sf"} if mode != "w4a16" else set()
    expected |= {"per_token_scale"} if per_token else set()
    assert roles == expected, (mode, roles)
    assert ForwardPlan.from_recording(recorded, (), {r: kw.get(r) for r in ROLES}, out, 0) is not None


@pytest.mark.parametrize("aux", [False, True])
def test_fused_finalize_zeroes_the_output_and_gemm2_adds_into_it(monkeypatch, aux):
    """Fused: the output is memset (on the aux stream between a fork and a join that precedes GEMM2, or in order
    on the caller's stream), GEMM2 takes the output itself with fused=1, and no finalize kernel runs."""
    _, calls, _, out = fake_forward(monkeypatch, "w4a4", True, aux=aux)
    names = [c[0] for c in calls]
    gemm1 = next(n for n in names if n.startswith("moe_gemm1"))
    gemm2 = next(n for n in names if n.startswith("moe_gemm2"))
    expected = ["moe_routing_decode_nvfp4"] + (["fork", "memset"] if aux else ["memset"]) + [gemm1]
    expected += ["join"] if aux else []
    assert names == expected + [gemm2]
    memset = calls[names.index("memset")]
    assert memset[1] == [(out.data_ptr(), out.numel() * 2)]
    g2 = calls[names.index(gemm2)]
    assert g2[1][-1] == (out.data_ptr(), out.numel())  # destination: the output rows, not the slot buffer
    assert g2[2][-2] == 1.0  # fused flag
    _, calls, _, _ = fake_forward(monkeypatch, "w4a4", False)
    assert [c[0] for c in calls][-1] == "moe_finalize" and "memset" not in [c[0] for c in calls]


@pytest.mark.parametrize("fused", [False, True])
def test_localized_forward_runs_each_shard_on_its_stream_with_column_offsets(monkeypatch, fused):
    """Two shards: FC1 of each writes intermediate columns [d*I/2, (d+1)*I/2) of the full-width rows, FC2 of each
    output columns [d*H/2, (d+1)*H/2), each on its shard's stream between a fork and a join; a plan replays the
    side launches on the same streams."""
    recorded, calls, kw, out = fake_forward(monkeypatch, "w4a4", fused, shards=True)
    H = I = 256
    names = [c[0] for c in calls]
    g1 = [i for i, n in enumerate(names) if n.startswith("moe_gemm1")]
    g2 = [i for i, n in enumerate(names) if n.startswith("moe_gemm2")]
    assert len(g1) == len(g2) == 2
    assert names[g1[0] - 1] == "fork" and names[g1[1] + 1] == "join"
    assert names[g2[0] - 1] == "fork" and names[g2[1] + 1] == "join"
    # GEMM1 scalars: H, N1 of the shard, I (row pitch), column offset, ...
    assert [calls[i][2][:4] for i in g1] == [[H, I, I, 0], [H, I, I, I // 2]]
    # GEMM2 scalars: weight rows of the shard, I, H (row pitch), column offset, ...
    assert [calls[i][2][:4] for i in g2] == [[H // 2, I, H, 0], [H // 2, I, H, H // 2]]
    side = [step.stream.cuda_stream for step in recorded if isinstance(step, Launch) and step.stream is not None]
    assert side == [11, 12, 11, 12]
    fake = launcher._module()
    streams_seen = []
    fake.launch = lambda name, buffers, scalars, pdl, stream: streams_seen.append((name, stream))
    plan = ForwardPlan.from_recording(recorded, (), {r: kw.get(r) for r in ROLES}, out, 0)
    assert plan.run({r: kw.get(r) for r in ROLES}) is out
    assert [s for n, s in streams_seen if n.startswith("moe_gemm")] == [11, 12, 11, 12]


@pytest.mark.parametrize("k_splits", [(0, 0), (4, 2)])
def test_a_wgmma_split_launches_that_gemms_wgmma_kernel_unsplit(monkeypatch, k_splits):
    """Split launcher.WGMMA (0) picks the GEMM's warp-specialised kernel, which is passed K split 1; a mixed pair
    is refused (the wgmma GEMMs read their tokens in their own K order)."""
    _, calls, _, _ = fake_forward(monkeypatch, "w4a16", False, tile=launcher.WGMMA_TILE, k_splits=k_splits)
    gemm1 = next(c for c in calls if c[0].startswith("moe_gemm1"))
    gemm2 = next(c for c in calls if c[0].startswith("moe_gemm2"))
    for call, split, name in ((gemm1, k_splits[0], "moe_gemm1_w4a16_swiglu_t128"), (gemm2, k_splits[1],
                                                                                   "moe_gemm2_w4a16_t128")):
        wgmma = split == launcher.WGMMA
        assert call[0] == name + ("_wgmma" if wgmma else "")
        assert call[2][-1] == (1 if wgmma else split)  # the kernels' last scalar is the K split
    for mixed in ((0, 2), (4, 0)):
        with pytest.raises(ValueError, match="both GEMMs run the wgmma kernels or neither"):
            fake_forward(monkeypatch, "w4a16", False, tile=launcher.WGMMA_TILE, k_splits=mixed)


@pytest.mark.parametrize("tile", launcher.NARROW_WGMMA_TILES)
@pytest.mark.parametrize("k_splits", [(0, 0), (-1, 0), (-1, -1)])
def test_narrow_wgmma_tiles_launch_their_own_wgmma_kernels(monkeypatch, tile, k_splits):
    """32- and 64-token routing tiles run the wgmma GEMMs built for them (one m64n32 / m64n64 block a tile), in
    the 256-weight-row form where the split is WGMMA_WIDE, each passed K split 1."""
    _, calls, _, _ = fake_forward(monkeypatch, "w4a16", True, tile=tile, k_splits=k_splits)
    gemms = [c for c in calls if c[0].startswith("moe_gemm")]
    suffixes = ["_wgmma_n256" if s == launcher.WGMMA_WIDE else "_wgmma" for s in k_splits]
    assert [c[0] for c in gemms] == [f"moe_gemm1_w4a16_swiglu_t{tile}{suffixes[0]}",
                                     f"moe_gemm2_w4a16_t{tile}{suffixes[1]}"]
    assert all(c[2][-1] == 1 for c in gemms)


@pytest.mark.parametrize("k_splits", [(0, 0), (0, -1)])
def test_padded_wgmma_tile_launches_its_kernels_and_256_weight_rows_only_on_gemm2(monkeypatch, k_splits):
    """144-token routing tiles run the wgmma GEMMs built for them (one m64n144 block a tile), GEMM2 also in the
    256-weight-row form; GEMM1 has none (WGMMA_WIDE on it is refused before any launch), nor do streaming splits."""
    tile = launcher.PADDED_WGMMA_TILE
    _, calls, _, _ = fake_forward(monkeypatch, "w4a16", True, tile=tile, k_splits=k_splits)
    gemms = [c[0] for c in calls if c[0].startswith("moe_gemm")]
    assert gemms == [f"moe_gemm1_w4a16_swiglu_t{tile}_wgmma",
                     f"moe_gemm2_w4a16_t{tile}_wgmma" + ("_n256" if k_splits[1] == launcher.WGMMA_WIDE else "")]
    for refused in ((launcher.WGMMA_WIDE, launcher.WGMMA), (launcher.WGMMA_WIDE, launcher.WGMMA_WIDE), (1, 1)):
        with pytest.raises(ValueError, match="runs only the wgmma kernels"):
            fake_forward(monkeypatch, "w4a16", True, tile=tile, k_splits=refused)


@pytest.mark.parametrize("split1", launcher.K_SPLITS)
def test_persistent_gemm2_launches_its_own_object_beside_any_gemm1_split(monkeypatch, split1):
    """GEMM2's launcher.PERSISTENT runs the 16-token persistent object (built for w4a4 per-token, whose FC2 input
    is row-major), passed K split 1 (it launches no clusters); GEMM1 keeps its split."""
    P = launcher.PERSISTENT
    _, calls, _, _ = fake_forward(monkeypatch, "w4a4", True, per_token=True, tile=16, k_splits=(split1, P))
    gemms = [c for c in calls if c[0].startswith("moe_gemm")]
    assert [c[0] for c in gemms] == ["moe_gemm1_w4a4_pt_swiglu_t16", "moe_gemm2_w4a4_pt_t16_persistent"]
    assert [c[2][-1] for c in gemms] == [split1, 1]


@pytest.mark.parametrize("tile,k_splits", [(8, (1, launcher.PERSISTENT)), (32, (1, launcher.PERSISTENT)),
                                           (16, (launcher.PERSISTENT, 1)),
                                           (16, (launcher.PERSISTENT, launcher.PERSISTENT))])
def test_persistent_is_refused_off_the_16_token_tile_and_on_gemm1(monkeypatch, tile, k_splits):
    with pytest.raises(ValueError, match="PERSISTENT runs GEMM2 on 16-token"):
        fake_forward(monkeypatch, "w4a16", True, tile=tile, k_splits=k_splits)


@pytest.mark.parametrize("tile", [8, 16])
def test_wgmma_wide_is_refused_on_streaming_only_tiles(monkeypatch, tile):
    with pytest.raises(ValueError, match="WGMMA_WIDE runs on"):
        fake_forward(monkeypatch, "w4a16", True, tile=tile, k_splits=(launcher.WGMMA_WIDE, launcher.WGMMA))


def test_w4a16_wgmma_forward_copies_x_into_the_wgmma_k_order_in_the_routing_launch(monkeypatch):
    """The wgmma GEMMs read their tokens in their own K order: in w4a16 the routing launch copies the caller's x
    into the x_decoded buffer, which GEMM1 reads; the streaming forward reads x itself."""
    W = launcher.WGMMA
    recorded, calls, kw, out = fake_forward(monkeypatch, "w4a16", True, tile=launcher.WGMMA_TILE, k_splits=(W, W))
    launches = [step for step in recorded if isinstance(step, Launch)]
    assert [step.name for step in launches][:2] == ["moe_routing_decode_bf16", "moe_gemm1_w4a16_swiglu_t128_wgmma"]
    assert {role for _, role in launches[0].roles} == {"token_selected_experts", "x"}
    copied = launches[0].buffers[-1]
    assert copied[1] == 5 * 256 and launches[1].buffers[0] == copied, "GEMM1 reads the copy"
    recorded, *_ = fake_forward(monkeypatch, "w4a16", True)
    launches = [step for step in recorded if isinstance(step, Launch)]
    assert launches[0].name == "moe_routing" and ("x" in {role for _, role in launches[1].roles})
    sizes = launcher.KernelBuffers.sizes  # so only a forward that may run wgmma holds a copy of x
    assert sizes("w4a16", 8, 256, 5, 2, 256, wgmma=False)["x_decoded"] == 0
    assert sizes("w4a16", 8, 256, 5, 2, 256, wgmma=True)["x_decoded"] == sizes("w4a8", 8, 256, 5, 2, 256,
                                                                               wgmma=False)["x_decoded"] == 5 * 256


@pytest.mark.parametrize("mode,per_token,tile,k_splits", [
    ("w4a16", False, 16, (1, 1)), ("w4a16", False, 32, (launcher.THREE_CTAS, 1)), ("w4a4", False, 16, (2, 1)),
    ("w4a8", False, 32, (1, 2)), ("w4a4", True, 16, (1, 1))])
def test_slab_gemm1_reads_the_token_slabs_a_gather_launch_writes_after_the_routing(monkeypatch, mode, per_token,
                                                                                    tile, k_splits):
    """On launcher.SLAB_TILES, in a build that links the gather, the streaming GEMM1 reads its tokens as token slabs:
    a gather launch between the routing launch and GEMM1 writes them (from the caller's x in w4a16, from the decoded
    x otherwise) into the token_slabs buffer, sized for the routed rows, and GEMM1 takes that buffer as its x. w4a4
    per-token keeps the staging GEMM1 (its forward has no node to spare), and so does a build without the gather."""
    monkeypatch.setattr(launcher, "_linked_kernels", lambda: frozenset())  # a build without the gather
    recorded, *_ = fake_forward(monkeypatch, mode, True, per_token=per_token, tile=tile, k_splits=k_splits)
    assert launcher.SLAB_GATHER not in [step.name for step in recorded if isinstance(step, Launch)]
    monkeypatch.setattr(launcher, "_linked_kernels", lambda: frozenset({launcher.SLAB_GATHER}))
    recorded, calls, kw, out = fake_forward(monkeypatch, mode, True, per_token=per_token, tile=tile,
                                            k_splits=k_splits)
    launches = [step for step in recorded if isinstance(step, Launch)]
    names = [step.name for step in launches]
    kernel_mode = "w4a4_pt" if per_token else mode
    gemm1 = launcher.gemm1_kernel(kernel_mode, "swiglu", tile, k_splits[0])
    if per_token:
        assert "moe_token_slabs" not in names and names[1] == gemm1
        return
    assert names[1:3] == ["moe_token_slabs", gemm1]
    gather = launches[1]
    rows = launcher.allocate_routing(5, 2, 8, tile, "cpu").permuted_to_expanded.numel()
    assert gather.buffers[-1][1] == launcher.slab_elements(rows, 256)
    assert launches[2].buffers[0] == gather.buffers[-1], "GEMM1 reads the slabs"
    if mode == "w4a16":
        assert "x" in {role for _, role in gather.roles}, "the gather reads the caller's x"
    else:
        assert gather.buffers[0] == launches[0].buffers[-1], "the gather reads the decoded x"
    assert len(names) <= 5


@pytest.mark.parametrize("mode,per_token,tile,k_splits", [
    ("w4a16", False, 16, (1, 2)), ("w4a4", False, 32, (1, launcher.THREE_CTAS)), ("w4a8", False, 16, (2, 1)),
    ("w4a16", False, 32, (1, 1)), ("w4a4", True, 16, (1, 1))])
def test_slab_gemm2_reads_the_fc2_input_its_gemm1_stores_as_token_slabs(monkeypatch, mode, per_token, tile,
                                                                        k_splits):
    """Where the build links the slab GEMM2 of a mode and tile (launcher.FC2_SLABS in its name), that GEMM2 runs,
    reading the FC2 input GEMM1 stored as token slabs: the same buffer, sized for the slab layout, and no launch
    between the GEMMs. w4a4 per-token keeps the row-major FC2 input its quantizer reads; a build without slab GEMM2s
    runs the row-major ones."""
    kernel_mode = "w4a4_pt" if per_token else mode
    suffix = "_3cta" if k_splits[1] == launcher.THREE_CTAS else ""
    plain = f"moe_gemm2_{'w4a16' if kernel_mode == 'w4a4' else kernel_mode}_t{tile}"
    built = f"moe_gemm2_{'w4a8' if mode == 'w4a8' else 'w4a16'}_t{tile}_slabs"  # none for w4a4_pt
    slab_gemm2s = {built, built + suffix}  # a build has every streaming form of it
    for linked in (frozenset({launcher.SLAB_GATHER}), frozenset({launcher.SLAB_GATHER, *slab_gemm2s})):
        monkeypatch.setattr(launcher, "_linked_kernels", lambda: linked)
        slabs = len(linked) > 1 and not per_token
        assert launcher.fc2_slabs(kernel_mode, tile) == slabs
        recorded, *_ = fake_forward(monkeypatch, mode, True, per_token=per_token, tile=tile, k_splits=k_splits)
        launches = [step for step in recorded if isinstance(step, Launch)]
        names = [step.name for step in launches]
        first = names.index(launcher.gemm1_kernel(kernel_mode, "swiglu", tile, k_splits[0]))
        assert names[first + (2 if per_token else 1)] == plain + ("_slabs" if slabs else "") + suffix
        gemm1, gemm2 = launches[first], launches[first + (2 if per_token else 1)]
        assert gemm2.buffers[0] == gemm1.buffers[9], "GEMM2 reads the FC2 input GEMM1 stores"
        rows = launcher.allocate_routing(5, 2, 8, tile, "cpu").permuted_to_expanded.numel()
        assert gemm1.buffers[9][1] == launcher.slab_elements(rows, 256) > rows * 256


def test_slab_gemm1_is_refused_past_the_tokens_its_slabs_are_sized_for(monkeypatch):
    monkeypatch.setattr(launcher, "_linked_kernels", lambda: frozenset({launcher.SLAB_GATHER}))
    monkeypatch.setattr(launcher, "SLAB_MAX_TOKENS", 4)
    with pytest.raises(ValueError, match="reads token slabs, offered up to 4 tokens, not 5"):
        fake_forward(monkeypatch, "w4a16", True, tile=16, k_splits=(1, 1))
    fake_forward(monkeypatch, "w4a16", True, tile=8, k_splits=(1, 1))  # the 8-token GEMM1 stages its tokens


@pytest.mark.parametrize("mode,per_token", [("w4a4", False), ("w4a4", True), ("w4a8", False)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", ["wgmma", "streaming"])
def test_quantized_modes_decode_x_in_the_routing_launch(monkeypatch, mode, per_token, fused, family):
    """Quantized activations on either GEMM family: the routing launch also decodes x (the per-call x and x_sf go
    to it) into the bf16 buffer GEMM1 reads, the per-token quantizer writes its quantization decoded over the FC2
    input GEMM2 reads, w4a4 runs w4a16's GEMM2, and no kernel node is added."""
    W = launcher.WGMMA
    tile, k_splits, suffix = (launcher.WGMMA_TILE, (W, W), "_t128_wgmma") if family == "wgmma" else (8, (1, 2), "_t8")
    recorded, calls, kw, out = fake_forward(monkeypatch, mode, fused, per_token=per_token, tile=tile,
                                            k_splits=k_splits)
    launches = [step for step in recorded if isinstance(step, Launch)]
    names = [step.name for step in launches]
    kernel_mode = "w4a4_pt" if per_token else mode
    expected = [f"moe_routing_decode_{launcher.X_FORMAT[kernel_mode]}", f"moe_gemm1_{kernel_mode}_swiglu{suffix}"]
    expected += ["moe_fc2_quant_per_token"] if per_token else []
    expected += [{"w4a4": "moe_gemm2_w4a16", "w4a4_pt": "moe_gemm2_w4a4_pt", "w4a8": "moe_gemm2_w4a8"}[kernel_mode]
                 + suffix]
    expected += [] if fused else ["moe_finalize"]
    assert names == expected
    assert len(names) <= 5
    routing_roles = {role for _, role in launches[0].roles}
    assert routing_roles == {"token_selected_experts", "x", "x_sf"}
    decoded = launches[0].buffers[-1]
    assert launches[1].buffers[0] == decoded, "GEMM1 reads the decoded activations"
    assert decoded[1] == 5 * 256  # T * H bf16 values
    fc2_input = launches[1].buffers[-2]  # GEMM1's out_bf16 (then fc2_input_scale)
    assert launches[names.index(expected[-1 if fused else -2])].buffers[0] == fc2_input, "GEMM2 reads GEMM1's bf16"
    if family == "wgmma":
        with pytest.raises(ValueError, match="both GEMMs"):
            fake_forward(monkeypatch, mode, fused, per_token=per_token, tile=tile, k_splits=(W, 1))


def test_the_wrapper_says_which_tactic_its_last_validated_run_chose():
    case = make_case("w4a16", num_tokens=4)
    wrapper = moe_ext.CuteDslMoEWrapper(case.num_experts, 2, 128, 128, quant_mode="w4a16", device="cpu")
    assert wrapper.last_tactic is None
    wrapper.run(**{k: v for k, v in case.kwargs().items() if k in RUN_ARGS})
    assert wrapper.last_tactic == (wrapper.tile_size,)  # the CPU reference path has one tactic: its row tile
