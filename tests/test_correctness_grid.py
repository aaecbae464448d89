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
