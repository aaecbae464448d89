"""ForwardPlan: a recorded forward replays its launches with the next call's per-call tensors, and refuses (so the
validated path runs) whatever it was not recorded for."""
import torch
from conftest import make_case

import moe_ext
from moe_ext import launcher
from moe_ext.plan import ForwardPlan


class FakeModule:
    def __init__(self):
        self.calls = []

    def launch(self, name, buffers, scalars, pdl, stream):
        self.calls.append((name, buffers, scalars, pdl))


def recorded_run(weights, inputs):
    """What launcher.recording() collects for a forward: routing reads the ids, GEMM1 reads x and w1, finalize
    reads the router weights; per-call buffers carry their role."""
    ptr = lambda t: (t.data_ptr(), t.numel())  # noqa: E731
    return [("moe_routing", [ptr(inputs["token_selected_experts"]), (1234, 8)], [8.0, 0.0, 8.0], True,
             ((0, "token_selected_experts"),)),
            ("moe_gemm1", [ptr(inputs["x"]), ptr(weights[0]), (5678, 16)], [128.0, 1.0], True, ((0, "x"),)),
            ("moe_finalize", [ptr(inputs["token_final_scales"]), (9999, 64)], [128.0], False,
             ((0, "token_final_scales"),))]


def issued(recorded):
    """The launches as the C++ launcher receives them."""
    return [(name, buffers, scalars, pdl) for name, buffers, scalars, pdl, _ in recorded]


def make_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(2, 128, generator=g).bfloat16(), x_sf=None,
                token_selected_experts=torch.randint(0, 8, (2, 4), generator=g, dtype=torch.int32),
                token_final_scales=torch.rand(2, 4, generator=g), per_token_scale=None)


def test_plan_substitutes_the_new_inputs_and_keeps_everything_else(monkeypatch):
    weights = (torch.zeros(8, 256, 64, dtype=torch.uint8), None)
    first = make_inputs(0)
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    plan = ForwardPlan.from_recording(recorded_run(weights, first), weights, first, out, tuning_generation=3)
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    second = make_inputs(1)
    assert plan.matches(weights, 3)
    assert plan.run(second) is out
    assert [c[0] for c in fake.calls] == ["moe_routing", "moe_gemm1", "moe_finalize"]
    assert fake.calls == issued(recorded_run(weights, second))  # same kernels, scalars, fixed buffers; new pointers


def test_plan_refuses_what_it_was_not_recorded_for(monkeypatch):
    weights = (torch.zeros(8, 256, 64, dtype=torch.uint8), None)
    first = make_inputs(0)
    plan = ForwardPlan.from_recording(recorded_run(weights, first), weights, first, torch.empty(2, 128),
                                      tuning_generation=0)
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
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
    weights = (torch.zeros(4, dtype=torch.uint8),)
    first = make_inputs(0)
    recorded = recorded_run(weights, first)
    name, buffers, scalars, pdl, roles = recorded[2]
    recorded[2] = (name, buffers[:1] + [(first["x"].data_ptr(), 256)], scalars, pdl, roles)  # finalize writes at x
    plan = ForwardPlan.from_recording(recorded, weights, first, torch.empty(1), 0)
    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    second = make_inputs(1)
    plan.run(second)
    assert fake.calls[1][1][0] == (second["x"].data_ptr(), second["x"].numel())  # GEMM1 reads the new x
    assert fake.calls[2][1][1] == (first["x"].data_ptr(), 256)  # finalize still writes the recorded buffer


def test_a_recording_whose_inputs_were_copied_is_not_planned():
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


RUN_ARGS = ("x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf", "w1_alpha",
            "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha")


def test_the_kernel_forward_marks_exactly_the_per_call_buffers(monkeypatch):
    """launcher.forward on CPU tensors with the C++ module faked: every launch gets plain (pointer, numel)
    buffers, and the recorded roles are the activations, router weights and ids of this call."""
    from moe_ext.problem import build_problem

    fake = FakeModule()
    monkeypatch.setattr(launcher, "_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    for mode in ("w4a16", "w4a4", "w4a8"):
        case = make_case(mode, num_tokens=5, top_k=2, num_experts=8, hidden=256, inter=256)
        kw = case.kwargs()
        if mode == "w4a4":
            kw["per_token_scale"] = torch.rand(5) + 0.5
        problem = build_problem(**kw)
        routing = launcher.allocate_routing(5, 2, 8, 8, "cpu")
        monkeypatch.setattr(launcher, "route", lambda ids, *a, **k: launcher.launch(
            "moe_routing", [launcher._check("token_selected_experts", ids, torch.int32, ids.device)], [], True,
            ids.device))
        buffers = launcher.KernelBuffers.allocate(mode, routing.permuted_to_expanded.numel(), 256, 10, 256, "cpu")
        out = torch.empty(5, 256, dtype=torch.bfloat16)
        fake.calls.clear()
        with launcher.recording() as recorded:
            launcher.forward(problem, routing, buffers, out, True, (1, 2))
        names = [name for name, *_ in recorded]
        assert names[0] == "moe_routing" and names[-1] == "moe_finalize"
        assert all(isinstance(p, int) and isinstance(n, int) for _, bufs, *_ in fake.calls for p, n in bufs)
        roles = {role for *_, rs in recorded for _, role in rs}
        expected = {"x", "token_selected_experts", "token_final_scales"}
        expected |= {"x_sf"} if mode != "w4a16" else set()
        expected |= {"per_token_scale"} if mode == "w4a4" else set()
        assert roles == expected, (mode, roles)
        assert ForwardPlan.from_recording(recorded, (), {r: kw.get(r) for r in ("x", "x_sf", "per_token_scale",
                                                                            "token_selected_experts",
                                                                            "token_final_scales")},
                                          out, 0) is not None
