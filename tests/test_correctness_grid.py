"""scripts/correctness_grid.py, the full issue-3 grid runner: its case list and a CPU smoke run of the harness
(on CPU both sides are the reference, so this checks the mechanics, not the kernels)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script():
    spec = importlib.util.spec_from_file_location("correctness_grid", os.path.join(ROOT, "scripts",
                                                                                  "correctness_grid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grid_is_the_whole_product_of_issue_3():
    grid = load_script()
    groups = grid.groups()
    assert len(groups) == (4 * 6 - 2) * 5 * 4  # modes x activations (no SiTU on w4a8) x shapes x EP settings
    per_group = 5 * 3 * 2  # T x top_k x finalize
    assert len(groups) * per_group == 13200
    assert ("w4a8", "situ", (256, 512), (1, 0)) not in groups


def test_smoke_run_writes_records_and_a_summary(tmp_path):
    grid = load_script()
    out = tmp_path / "grid.json"
    assert grid.main(["--device", "cpu", "--limit", "3", "--shard", "5/440", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    summary, records = result["summary"], result["records"]
    assert summary["cases"] == len(records) == 3 and summary["failures"] == 0
    assert summary["stopped_before"] is not None  # the limit cut the group short
    first = records[0]
    assert (first["mode"], first["act"], first["tokens"], first["top_k"]) == (*grid.groups()[5][:2], 1, 1)
    assert all(r["finite"] and r["ok"] and not r["on_kernels"] for r in records)


def test_the_fused_gate_admits_accumulation_order_and_nothing_more():
    """reference_and_gate on a fused T=1, top_k=8 case: any bf16 running-sum order of the exact contributions
    passes, while a dropped contribution or a 2% scale error fails."""
    import torch
    from conftest import TOLERANCE, make_case, reference_and_gate, rel_l2

    from moe_ext.problem import build_problem
    from moe_ext.reference import expert_outputs
    from moe_ext.routing import compute_routing

    case = make_case("w4a16", "situ", num_tokens=1, top_k=8, num_experts=16, hidden=256, inter=512)
    problem = build_problem(**case.kwargs(use_fused_finalize=True))
    exact, gate = reference_and_gate(problem, TOLERANCE["w4a16"])
    assert gate >= TOLERANCE["w4a16"]
    routing = compute_routing(problem.token_selected_experts, problem.num_local_experts,
                              problem.local_expert_offset, problem.tile_size)
    y, valid = expert_outputs(problem, routing)
    terms = (y.float() * valid[..., None])[0]
    assert torch.equal(terms.sum(0).to(torch.bfloat16), exact[0])
    for order in (range(8), reversed(range(8))):
        running = torch.zeros_like(exact[0])
        for k in order:
            running = (running.float() + terms[k]).to(torch.bfloat16)
        assert rel_l2(running, exact[0]) <= gate
    dropped = (terms.sum(0) - terms[int(valid[0].nonzero()[0])]).to(torch.bfloat16)
    assert rel_l2(dropped, exact[0]) > gate
    assert rel_l2((exact[0].float() * 1.02).to(torch.bfloat16), exact[0]) > gate
    deterministic = build_problem(**case.kwargs(use_fused_finalize=False))
    assert reference_and_gate(deterministic, TOLERANCE["w4a16"])[1] == TOLERANCE["w4a16"]


def test_token_and_top_k_filters_keep_only_those_cases(tmp_path):
    grid = load_script()
    out = tmp_path / "grid.json"
    assert grid.main(["--device", "cpu", "--tokens", "7", "--top-k", "2,8", "--shard", "5/440",
                      "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["tokens"], r["top_k"], r["fused"]) for r in records] == [
        (7, 2, True), (7, 2, False), (7, 8, True), (7, 8, False)]


def test_filters_outside_the_grid_are_refused():
    import pytest

    grid = load_script()
    with pytest.raises(SystemExit):
        grid.main(["--device", "cpu", "--tokens", "16"])
