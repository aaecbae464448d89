"""CPU tests of the benchmark (moe_ext.bench, moe_ext.bench_peers, moe_ext.bench_plot): byte / FLOP / roofline
formulas on hand-computed numbers, routing statistics, CLI, record schema, the inputs it builds (accepted by the
API, finite), the bf16 peer against a per-slot loop, the table, the plot, and the no-GPU exit."""
import json
import os
import runpy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import moe_ext
from moe_ext import bench, bench_peers
from moe_ext.backends import HOPPER, REFERENCE
from moe_ext.bench_peers import bucket_counts, grouped_mm_moe, peer_swiglu, route_buckets
from conftest import decode_problem, gpu, hopper_kernels

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = {"shape", "T", "quant_mode", "finalize", "impl", "us", "tbps", "tflops", "roofline_fraction",
                 "bytes", "flops", "command", "git_rev", "gpu", "torch"}
META = dict(command="python -m moe_ext.bench --tokens 4", git_rev="abc123-dirty", gpu="fake GPU", torch="x",
            cuda=None)
TINY = bench.Shape("tiny", 256, 128, 8, 2, 4, local_offset=4)  # experts 4..7 local


# --- formulas -----------------------------------------------------------------------------------------------------

def test_weight_and_activation_bytes_by_hand():
    # H=256, I=128, N1=256: 256*256 + 256*128 = 98304 weights per expert
    assert bench.weight_bytes_per_expert("bf16", 256, 128, 256) == 2 * 98304
    # NVFP4: half a byte per weight + one e4m3 per 16 (no swizzle padding at these sizes)
    assert bench.weight_bytes_per_expert("nvfp4", 256, 128, 256) == 49152 + 6144
    # MXFP4: one ue8m0 per 32
    assert bench.weight_bytes_per_expert("mxfp4", 256, 128, 256) == 49152 + 3072
    assert bench.activation_bytes_per_token("bf16", 256) == 512
    assert bench.activation_bytes_per_token("nvfp4", 256) == 128 + 16
    assert bench.activation_bytes_per_token("mxfp8", 256) == 256 + 8


def test_swizzle_padding_is_counted():
    # H=64: FC2's 64 scale rows still occupy one 128-row tile, so the bytes stored (and read) are padded
    padded = bench.weight_bytes_per_expert("nvfp4", 64, 128, 256)
    assert padded == (256 * 64 + 64 * 128) // 2 + 256 * 4 + 128 * 8


def test_forward_bytes_flops_roofline_by_hand():
    num_bytes = bench.forward_bytes(experts_hit=3, weight_bytes=55296, num_tokens=4, act_bytes=144, hidden=256)
    assert num_bytes == 3 * 55296 + 4 * 144 + 4 * 256 * 2 == 168512
    flops = bench.forward_flops(local_pairs=8, hidden=256, inter=128, n1=256)
    assert flops == 2 * 8 * 98304 == 1572864
    assert bench.roofline_us(num_bytes, flops) == pytest.approx(168512 / 4.15e12 * 1e6)  # memory bound
    assert bench.roofline_us(1.0, 793e12) == pytest.approx(1e6)  # compute bound: 1 s of bf16 math


def test_build_record_from_fake_timings():
    point = bench.Point(TINY, 4, "moe_ext", "w4a4", "fused", 256, 128)
    stats = bench.RoutingStats(experts_hit=3, local_pairs=8)
    record = bench.build_record(point, [12.0, 10.0, 11.0, 50.0, 9.0], stats, META, graphs=4)
    assert REQUIRED_KEYS <= record.keys()
    assert record["us"] == 11.0 and record["us_min"] == 9.0 and record["samples"] == 5
    assert record["bytes"] == 168512 and record["flops"] == 1572864
    assert record["tbps"] == pytest.approx(168512 / 11e-6 / 1e12)
    assert record["tflops"] == pytest.approx(1572864 / 11e-6 / 1e12)
    assert record["roofline_fraction"] == pytest.approx(record["roofline_us"] / 11.0)
    assert record["git_rev"] == "abc123-dirty" and record["graphs"] == 4 and "padded_from" not in record
    json.dumps(record)  # serialisable as is


def test_peer_and_failure_records_have_the_identity_keys():
    peer = bench.peer_point(TINY, 4, "torch_grouped_mm_bf16")
    record = bench.build_record(peer, [20.0], bench.RoutingStats(3, 8), META)
    assert record["quant_mode"] == "bf16" and record["impl"] == "torch_grouped_mm_bf16"
    assert record["bytes"] == 3 * 2 * 98304 + 4 * 512 + 4 * 512
    failed = bench.failure_record(bench.Point(TINY, 4, "moe_ext", "w4a8", "deterministic", 256, 128), "error",
                                  "OutOfMemoryError: boom", META)
    assert {"shape", "T", "quant_mode", "finalize", "impl", "error", "command", "git_rev", "gpu"} <= failed.keys()


def test_padded_dims_come_from_the_validator():
    gpt_oss = bench.SHAPES["gpt-oss-120b"]
    assert "multiple of 128" in bench.kernel_rejection(gpt_oss, "w4a16", 2880, 2880)  # H = 2880 is refused
    assert bench.supported_dims(gpt_oss, "w4a16") == (2944, 2880)  # the validator alone takes I % 64 for w4a16
    assert bench.supported_dims(gpt_oss, "w4a8") == (2944, 2944)  # and I % 128 for w4a8
    assert bench.supported_dims(bench.SHAPES["qwen3-30b-a3b"], "w4a4") == (2048, 768)
    point = bench.Point(gpt_oss, 1, "moe_ext", "w4a8", "fused", 2944, 2944)
    assert point.identity()["padded_from"] == [2880, 2880]


def test_padded_dims_follow_the_backend_on_a_device(monkeypatch):
    """On a device the backend's choice counts too: dims it would send to the reference path are padded on."""
    def kernels_need_i_multiple_of_128(problem):  # stands in for the sm_90a backend's own rule
        if problem.intermediate_size % 128:
            warnings.warn("the sm_90a kernels need I % 128 == 0")
            return REFERENCE
        return HOPPER

    monkeypatch.setattr(bench, "backend_for", kernels_need_i_multiple_of_128)
    gpt_oss = bench.SHAPES["gpt-oss-120b"]
    assert bench.kernel_rejection(gpt_oss, "w4a16", 2944, 2880, "cpu") == "the sm_90a kernels need I % 128 == 0"
    assert bench.supported_dims(gpt_oss, "w4a16", "cpu") == (2944, 2944)


def test_no_kernels_on_this_device_is_a_reason():
    reason = bench.kernel_rejection(bench.SHAPES["qwen3-30b-a3b"], "w4a4", 2048, 768, "cpu")
    assert "reference" in reason and "not the sm_90a kernels" in reason


def test_rotation_and_budget_helpers():
    l2 = 50 * 2 ** 20
    assert bench.rotation_count(19e6, l2) == 7  # ceil(2 * 52.4 MB / 19 MB) + 1
    assert bench.rotation_count(1e9, l2) == 4  # the minimum
    assert bench.rotation_count(0.0, l2) == 32  # the maximum
    assert bench.weight_copies(3 * l2, l2) == 1
    assert bench.weight_copies(30e6, l2) == 5  # 4 other copies stream >= 2x L2
    assert bench.budgeted_count(100, 1e5, 5.0, 5) == 50
    assert bench.budgeted_count(100, 10.0, 5.0, 5) == 100
    assert bench.budgeted_count(100, 1e7, 5.0, 5) == 5
    assert bench.expected_experts_hit(1, bench.SHAPES["deepseek-v3-ep8"]) == pytest.approx(1.0)


# --- routing ------------------------------------------------------------------------------------------------------

def test_experts_hit_and_local_pairs_from_routing():
    ids = torch.tensor([[0, 5], [5, 7], [2, 0]], dtype=torch.int32)
    assert route_buckets(ids, 4, 4).tolist() == [4, 1, 1, 3, 4, 4]  # 4 = another rank's expert
    assert bucket_counts(route_buckets(ids, 4, 4), 4).tolist() == [0, 2, 0, 1, 3]
    assert bench.routing_stats([ids], 4, 4) == bench.RoutingStats(experts_hit=2, local_pairs=3)  # 5, 7
    assert bench.routing_stats([ids], 4, 0) == bench.RoutingStats(experts_hit=2, local_pairs=3)  # 0, 2
    other = torch.tensor([[1, 2], [3, 0], [1, 0]], dtype=torch.int32)
    assert bench.routing_stats([ids, other], 4, 0) == bench.RoutingStats(experts_hit=3, local_pairs=4.5)


def test_random_routing_is_a_renormalised_softmax_top_k():
    first = bench.random_routing(64, bench.SHAPES["qwen3-30b-a3b"], seed=7, device="cpu")
    again = bench.random_routing(64, bench.SHAPES["qwen3-30b-a3b"], seed=7, device="cpu")
    assert first.ids.dtype == torch.int32 and first.ids.shape == (64, 8)
    assert torch.equal(first.ids, again.ids)  # same seed, same routing for every implementation
    assert all(len(set(row)) == 8 for row in first.ids.tolist())
    assert torch.allclose(first.weights.sum(-1), torch.ones(64))
    expected = torch.softmax(first.logits, -1).gather(1, first.ids.long())
    assert torch.allclose(first.weights, expected / expected.sum(-1, keepdim=True))


@pytest.mark.parametrize("mode", bench.QUANT_MODES)
def test_generated_inputs_run_through_the_api(mode):
    """What the benchmark feeds moe_ext is accepted by the API and gives finite outputs (reference path here)."""
    shape = bench.Shape("tiny-oai", 128, 128, 8, 2, 4, "swiglu_oai", local_offset=2)
    point = bench.Point(shape, 5, "moe_ext", mode, "deterministic", *bench.supported_dims(shape, mode))
    routing = bench.random_routing(5, shape, seed=3, device="cpu")
    inputs = bench.moe_ext_inputs(routing, point.hidden, mode, "cpu")
    weights = bench.random_moe_ext_weights(point, "cpu", torch.Generator().manual_seed(0))
    wrapper = moe_ext.CuteDslMoEWrapper(shape.num_experts, shape.top_k, point.hidden, point.inter, max_num_tokens=5,
                                        num_local_experts=shape.num_local, local_expert_offset=shape.local_offset,
                                        device="cpu", quant_mode=mode, use_fused_finalize=False,
                                        **shape.wrapper_kwargs())
    out = wrapper.run(**inputs, **weights)
    assert out.shape == (5, 128) and torch.isfinite(out).all() and out.abs().max() > 0


def test_scale_bytes_are_near_one_sixty_fourth():
    g = torch.Generator().manual_seed(0)
    nvfp4 = moe_ext.quant.e4m3_decode(bench.random_scale_bytes(4096, "nvfp4", "cpu", g))
    mx = bench.random_scale_bytes(4096, "mxfp4", "cpu", g)
    assert nvfp4.min() >= 1 / 160 and nvfp4.max() <= 1 / 28
    assert set(mx.unique().tolist()) <= {120, 121, 122}  # ue8m0 code 121 = 2^-6


# --- the bf16 peer --------------------------------------------------------------------------------------------------

def _grouped_mm_on_cpu() -> bool:
    try:
        a = torch.zeros(4, 16, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.zeros(2, 16, 16, dtype=torch.bfloat16), offs=torch.tensor([2, 4],
                                                                                           dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _grouped_mm_on_cpu(), reason="torch._grouped_mm has no CPU implementation here")
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_grouped_mm_peer_matches_a_per_slot_loop(activation):
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, offset = 4, 32, 32, 6, 2
    ids = torch.tensor([[2, 3], [0, 5], [4, 2], [1, 0], [5, 3], [3, 2]], dtype=torch.int32)  # 0, 1: not local
    router = torch.rand(tokens, 2, generator=g)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).bfloat16()
    act = bench.ACTIVATIONS[activation]
    out = grouped_mm_moe(x, ids, router, w1, w2, offset, act)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(2):
            e = int(ids[t, k]) - offset
            if 0 <= e < experts:
                h = x[t].float() @ w1[e].float().T
                expected[t] += router[t, k] * (act.apply(h[:inter], h[inter:]) @ w2[e].float().T)
    assert out.shape == (tokens, hidden) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_peer_swiglu_is_the_specified_activation(activation):
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 6
    act = bench.ACTIVATIONS[activation]
    assert torch.allclose(peer_swiglu(h, act), act.apply(h[:, :32], h[:, 32:]), atol=1e-5, rtol=1e-5)


# --- the sweep, without a GPU ------------------------------------------------------------------------------------

@pytest.fixture
def eager_sweep(monkeypatch, tmp_path):
    """The sweep's bookkeeping without a GPU: graphs become eager calls, timing fixed samples, moe_ext runs its
    reference path. Returns a factory of Run objects writing to tmp_path/r.json."""
    # "capture" runs the first and last forward only (different input set and weight copy): enough to check them
    monkeypatch.setattr(bench, "capture_graphs", lambda forwards: (forwards, [forwards[0](), forwards[-1]()]))
    monkeypatch.setattr(bench, "time_replays", lambda graphs, *args: [7.0, 8.0, 9.0])
    monkeypatch.setattr(bench, "backend_for", lambda problem: HOPPER)  # "the kernels would run it"
    monkeypatch.setattr(bench, "release_memory", lambda: None)  # gc.collect per point: slow, and no GPU memory

    def make(*argv):
        args = bench.parse_args([*argv, "--out", str(tmp_path / "r.json")])
        return bench.Run(args, torch.device("cpu"), 64 * 1024, META, [])  # a 64 KiB "L2" makes copies rotate

    return make


def test_sweep_records_every_point(eager_sweep, tmp_path):
    shape = bench.Shape("tiny-ep", 128, 128, 8, 2, 4, local_offset=4)
    run = eager_sweep("--tokens", "1,3", "--modes", "w4a16,w4a8", "--finalize", "deterministic",
                      "--impls", "moe_ext,torch_grouped_mm_bf16,triton_kernels_mxfp4")
    bench.run_shape(run, shape)
    records = json.loads((tmp_path / "r.json").read_text())
    assert records == run.records
    moe = [r for r in records if r["impl"] == "moe_ext"]
    assert sorted((r["T"], r["quant_mode"]) for r in moe) == [(1, "w4a16"), (1, "w4a8"), (3, "w4a16"), (3, "w4a8")]
    for r in moe:
        assert REQUIRED_KEYS <= r.keys() and r["us"] == 8.0 and r["output_finite"]
        assert r["weight_copies"] == 3 and r["graphs"] >= 4  # 110 KB of weights < 2x the 64 KiB "L2"
    peer = [r for r in records if r["impl"] == "torch_grouped_mm_bf16"]
    assert [r["T"] for r in peer] == [1, 3]
    if _grouped_mm_on_cpu():
        assert all(r["output_finite"] and r["quant_mode"] == "bf16" for r in peer)
    triton = [r for r in records if r["impl"] == "triton_kernels_mxfp4"]
    assert [r["T"] for r in triton] == [1, 3] and all("expert-parallel" in r["skipped"] for r in triton)
    hits = {(r["T"], r["experts_hit"]) for r in records if "experts_hit" in r}
    assert len(hits) == 2  # every implementation of one T saw the same routing


def test_sweep_records_a_missing_peer_as_skipped(eager_sweep):
    if bench_peers.triton_kernels_unavailable() is None:
        pytest.skip("triton_kernels is installed here")
    shape = bench.Shape("tiny", 128, 128, 4, 2, 4)
    run = eager_sweep("--tokens", "2")
    routing = bench.random_routing(2, shape, seed=0, device="cpu")
    bench.run_triton_kernels(run, shape, 2, [routing], bench.routing_stats([routing.ids], 4, 0))
    (record,) = run.records
    assert record["impl"] == "triton_kernels_mxfp4" and "import triton_kernels failed" in record["skipped"]


def test_sweep_turns_a_failure_into_an_error_record(eager_sweep, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench, "measure_moe_ext", out_of_memory)
    run = eager_sweep("--tokens", "1", "--modes", "w4a4", "--impls", "moe_ext,torch_grouped_mm_bf16")
    bench.run_shape(run, bench.Shape("tiny", 128, 128, 4, 2, 4))
    errors = [r for r in run.records if "error" in r]
    assert [r["finalize"] for r in errors] == ["fused", "deterministic"]
    assert errors[0]["error"].startswith("OutOfMemoryError")
    assert run.records[-1]["impl"] == "torch_grouped_mm_bf16"  # the sweep went on


def test_sweep_without_kernels_skips_moe_ext_with_the_reason(eager_sweep, monkeypatch):
    monkeypatch.setattr(bench, "backend_for", lambda problem: REFERENCE)
    run = eager_sweep("--tokens", "1,2", "--modes", "w4a4", "--finalize", "fused", "--impls", "moe_ext")
    bench.run_shape(run, bench.Shape("tiny", 128, 128, 4, 2, 4))
    assert [(r["T"], r["impl"]) for r in run.records] == [(1, "moe_ext"), (2, "moe_ext")]
    assert all("not the sm_90a kernels" in r["skipped"] for r in run.records)


@pytest.mark.parametrize("tactic", ["tuned", "default", "128"])
def test_sweep_tunes_only_when_asked(eager_sweep, monkeypatch, tactic):
    """--tactic tuned times the autotuner's pick; default the heuristic's, untuned; a given tactic runs as given."""
    tuning = []
    real_autotune = bench.moe_ext.autotune

    def recording_autotune(tune_mode=True, **kwargs):
        tuning.append(tune_mode)
        return real_autotune(tune_mode, **kwargs)

    monkeypatch.setattr(bench.moe_ext, "autotune", recording_autotune)
    run = eager_sweep("--tokens", "2", "--modes", "w4a16", "--finalize", "fused", "--impls", "moe_ext",
                      "--tactic", tactic)
    bench.run_shape(run, bench.Shape("tiny", 128, 128, 4, 2, 4))
    (record,) = run.records
    assert tuning == [tactic == "tuned"] and record["us"] == 8.0
    assert record["tactic"] == [128]  # the reference path's only tactic, whichever way it was chosen


def test_sweep_runs_a_given_tactic_as_given(eager_sweep):
    run = eager_sweep("--tokens", "2", "--modes", "w4a16", "--finalize", "fused", "--impls", "moe_ext",
                      "--tactic", "8")
    bench.run_shape(run, bench.Shape("tiny", 128, 128, 4, 2, 4))
    (record,) = run.records
    assert "tactic (8,) is not valid" in record["error"]  # passed through, not replaced by the heuristic's


def test_sweep_skips_points_over_the_weight_limit(eager_sweep):
    run = eager_sweep("--tokens", "1", "--modes", "w4a16", "--finalize", "fused", "--max-weight-gb", "0.00001",
                      "--impls", "moe_ext,torch_grouped_mm_bf16")
    bench.run_shape(run, bench.Shape("tiny", 128, 128, 4, 2, 4))
    assert [("--max-weight-gb" in r["skipped"]) for r in run.records] == [True, True]


# --- command line, table, metadata --------------------------------------------------------------------------------

def test_cli_defaults_and_selection():
    args = bench.parse_args([])
    assert args.shapes == list(bench.SHAPES) and args.tokens == [1, 8, 64, 256, 1024, 4096, 16384]
    assert args.modes == ["w4a16", "w4a4", "w4a8"] and args.finalize == ["fused", "deterministic"]
    assert args.impls == list(bench.IMPLS) and args.out == bench.DEFAULT_OUT and not args.host_overhead
    assert args.tactic == "tuned" and args.decode_form == "rule"
    assert bench.parse_args(["--decode-form", "partials"]).decode_form == "partials"
    assert bench.parse_args(["--tactic", "default"]).tactic == "default"
    assert bench.parse_args(["--tactic", "16,1,-2"]).tactic == (16, 1, -2)
    args = bench.parse_args(["--shapes", "mixtral-8x7b,qwen3-30b-a3b", "--tokens", "1,64", "--modes", "w4a4",
                             "--finalize", "deterministic", "--impls", "moe_ext,torch_grouped_mm_bf16",
                             "--max-weight-gb", "12.5", "--iters", "20", "--warmup", "3", "--plot", "r.png"])
    assert args.shapes == ["mixtral-8x7b", "qwen3-30b-a3b"] and args.tokens == [1, 64] and args.modes == ["w4a4"]
    assert args.finalize == ["deterministic"] and args.impls == ["moe_ext", "torch_grouped_mm_bf16"]
    assert (args.max_weight_gb, args.iters, args.warmup, args.plot) == (12.5, 20, 3, "r.png")
    assert bench.parse_args(["--host-overhead"]).out == bench.DEFAULT_HOST_OUT


def test_host_time_is_the_median_batch_so_one_stalled_batch_does_not_decide(monkeypatch):
    clock = {"t": 0.0, "calls": 0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)

    def forward():  # 20 µs a call, but every call of the third timed batch stalls 1 ms
        clock["calls"] += 1
        stalled = 10 + 2 * 100 < clock["calls"] <= 10 + 3 * 100
        clock["t"] += 1e-3 if stalled else 20e-6

    assert bench.host_time_us(forward, 100) == pytest.approx(20.0)
    assert clock["calls"] == 10 + 7 * 100  # warm-up, then 7 batches


@pytest.mark.parametrize("bad", [["--shapes", "llama"], ["--modes", "w8a8"], ["--tokens", "0"],
                                 ["--tokens", "a,b"], ["--impls", "cublas"], ["--finalize", "atomic"],
                                 ["--iters", "0"], ["--tactic", "fastest"], ["--decode-form", "splitk"]])
def test_cli_rejects_bad_values(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(bad)
    assert bad[0] in capsys.readouterr().err


@pytest.mark.parametrize("form,flag,floor,deep,gemm2_steps", [
    ("rule", True, 9, True, 4), ("fc2", True, 0, True, 4), ("partials", False, 9, True, 4),
    ("shallow_ring", True, 9, False, 4), ("split_gemm2", True, 9, True, 1)])
def test_decode_form_sets_the_launchers_choice(form, flag, floor, deep, gemm2_steps, monkeypatch):
    monkeypatch.setattr(bench.launcher, "has_kernel", lambda name: True)
    monkeypatch.setattr(bench.launcher, "DECODE_FC2_BY_GEMM1", True)
    monkeypatch.setattr(bench.launcher, "DECODE_FC2_MIN_RANGE_STEPS", 9)
    monkeypatch.setattr(bench.launcher, "DECODE_DEEP_RING", True)
    monkeypatch.setattr(bench.launcher, "DECODE_GEMM2_MIN_STEPS", 4)
    bench.force_decode_form(form)
    assert (bench.launcher.DECODE_FC2_BY_GEMM1, bench.launcher.DECODE_FC2_MIN_RANGE_STEPS,
            bench.launcher.DECODE_DEEP_RING, bench.launcher.DECODE_GEMM2_MIN_STEPS) == (flag, floor, deep, gemm2_steps)


def test_split_gemm2_form_takes_the_split_kernel_at_qwen3_t1(monkeypatch):
    """What --decode-form split_gemm2 is for: Qwen3-30B-A3B T=1's 6-step GEMM2 items, unsplit under the rule, take
    the split form (128 items leave the 264-CTA grid room for two ranges)."""
    monkeypatch.setattr(bench.launcher, "has_kernel", lambda name: True)
    monkeypatch.setattr(bench.launcher, "num_sms", lambda device: 132)
    monkeypatch.setattr(bench.launcher, "DECODE_GEMM2_MIN_STEPS", 4)
    problem = decode_problem(1, 8, 128, 128, 2048, 768)
    assert bench.launcher.decode_kernel_for(problem) == "moe_decode_w4a16_swiglu"
    bench.force_decode_form("split_gemm2")
    assert bench.launcher.decode_kernel_for(problem) == "moe_decode_w4a16_swiglu_split2"


def test_decode_form_is_refused_when_its_objects_are_not_linked(monkeypatch):
    monkeypatch.setattr(bench.launcher, "has_kernel", lambda name: not name.endswith("_fc2"))
    with pytest.raises(SystemExit, match="--decode-form fc2"):
        bench.force_decode_form("fc2")
    bench.force_decode_form("rule")


def test_metadata_names_command_and_tree():
    meta = bench.run_metadata(["--tokens", "1", "--out", "a b.json"], "NVIDIA H200")
    assert meta["command"] == "python -m moe_ext.bench --tokens 1 --out 'a b.json'"
    assert meta["gpu"] == "NVIDIA H200" and meta["torch"] == torch.__version__
    assert meta["git_rev"] == "unknown" or len(meta["git_rev"].removesuffix("-dirty")) == 40


def test_table_shows_speedup_over_each_peer():
    stats = bench.RoutingStats(3, 8)
    ours = bench.build_record(bench.Point(TINY, 4, "moe_ext", "w4a4", "fused", 256, 128), [10.0], stats, META)
    peer = bench.build_record(bench.peer_point(TINY, 4, "torch_grouped_mm_bf16"), [25.0], stats, META)
    failed = bench.failure_record(bench.peer_point(TINY, 4, "triton_kernels_mxfp4"), "skipped", "not installed",
                                  META)
    table = bench.format_table([peer, ours, failed])
    lines = table.splitlines()
    assert "vs torch_grouped_mm_bf16" in lines[0] and "vs triton" not in lines[0]  # only peers that were measured
    assert lines[1].split()[2] == "moe_ext" and lines[1].rstrip().endswith("2.50x")
    assert "skipped: not installed" in table
    assert ours["speedup_vs"] == {"torch_grouped_mm_bf16": 2.5} and "speedup_vs" not in peer  # also in the JSON


def test_records_are_written_as_a_json_list(tmp_path):
    out = tmp_path / "sub" / "r.json"
    bench.write_records([{"a": 1}], str(out))
    assert json.loads(out.read_text()) == [{"a": 1}] and not (tmp_path / "sub" / "r.json.tmp").exists()


# --- plot ---------------------------------------------------------------------------------------------------------

def _fake_results(tmp_path) -> Path:
    stats = bench.RoutingStats(3, 8)
    records = [bench.build_record(bench.Point(TINY, t, "moe_ext", "w4a16", "fused", 256, 128), [5.0 * t], stats, META)
               for t in (1, 8)]
    records.append(bench.build_record(bench.peer_point(bench.SHAPES["qwen3-30b-a3b"], 8, "torch_grouped_mm_bf16"),
                                      [40.0], stats, META))
    records.append(bench.failure_record(bench.peer_point(TINY, 1, "triton_kernels_mxfp4"), "skipped", "no", META))
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    return path


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from moe_ext import bench_plot

    results = _fake_results(tmp_path)
    assert bench_plot.main([str(results), "--out", str(tmp_path / "roof.png")]) == 0
    assert (tmp_path / "roof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench.write_plot(json.loads(results.read_text()), str(tmp_path / "from_bench.png"))  # what --plot does
    assert (tmp_path / "from_bench.png").stat().st_size > 0
    # Several result files are plotted together; without --out the PNG goes next to the first.
    other = tmp_path / "more.json"
    other.write_text(results.read_text())
    assert bench_plot.main([str(results), str(other)]) == 0
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    from moe_ext import bench_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert bench_plot.main([str(_fake_results(tmp_path))]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# --- no GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU prints")
def test_no_gpu_exits_with_a_message(capsys, tmp_path):
    assert bench.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU prints")
@pytest.mark.parametrize("script", ["benchmarks/bench_moe.py", "moe_ext/bench.py"])
def test_entry_points_without_gpu_exit_cleanly(script, monkeypatch, capsys):
    """Both entry points run as __main__ (in-process: a subprocess would spend seconds importing torch) and end
    with exit status 2 and the message, not an exception."""
    monkeypatch.setattr(sys, "argv", [script, "--tokens", "1", "--out", os.devnull])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exited.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_state_fields_from_an_nvidia_smi_line():
    assert bench.parse_gpu_state("1785, 612.40, 63, 0x0000000000000004") == {
        "sm_clock_mhz": 1785.0, "power_w": 612.4, "temperature_c": 63.0, "clock_event_reasons": "0x0000000000000004"}
    assert bench.parse_gpu_state("1980, [N/A], 41") == {"sm_clock_mhz": 1980.0, "temperature_c": 41.0}


def test_gpu_state_without_nvidia_smi_is_empty(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench.subprocess, "run", missing)
    assert bench.gpu_state(torch.device("cuda", 0)) == {}
    assert bench.gpu_state(torch.device("cpu")) == {}


class FakeCounter:
    """An energy counter that reads `values` in turn (millijoules)."""

    def __init__(self, *values):
        self.values = list(values)

    def read(self):
        return self.values.pop(0)


class FakeGraph:
    replays = 0

    def replay(self):
        FakeGraph.replays += 1


@pytest.mark.parametrize("readings,expected", [
    ((1_000, 1_000 + 5 * 40), dict(energy_mj=5.0, energy_replays=40)),  # 40 replays of ~25 us fill 1 ms
    ((1_000, 1_000), {}),  # the counter did not tick over the window: no number
    ((None,), {}),  # no counter: nothing replayed, nothing recorded
])
def test_replay_energy_is_the_counter_delta_per_replay(monkeypatch, readings, expected):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "_keep_gpu_busy", lambda replays: None)
    FakeGraph.replays = 0
    record = bench.replay_energy([FakeGraph(), FakeGraph()], forward_us=25.0, seconds=1e-3,
                                 counter=FakeCounter(*readings))
    assert {k: record[k] for k in expected} == expected
    assert set(record) == (set() if not expected else {"energy_mj", "energy_replays", "energy_window_s",
                                                       "energy_avg_w"})
    assert FakeGraph.replays == (40 if readings[0] is not None else 0)


def test_energy_counter_reads_none_or_a_growing_count():
    """Where the driver's NVML is missing (CPU machines) the counter reads None; on a GPU it never goes back."""
    counter = bench.EnergyCounter(0)
    first = counter.read()
    if first is None:
        assert counter.read() is None
    else:
        assert counter.read() >= first > 0


@gpu
def test_replay_energy_of_real_replays_is_positive():
    counter = bench.EnergyCounter(torch.cuda.current_device())
    if counter.read() is None:
        pytest.skip("NVML's energy counter is not readable here")
    a = torch.randn(2048, 2048, device="cuda")

    def body(a):
        for _ in range(8):
            a = a @ a.T * 1e-3
        return a

    # cuBLAS makes its handle and workspace on first use, which a capture cannot hold: warm up on a side stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(a)
    record = bench.replay_energy([graph], forward_us=1_000.0, seconds=0.3, counter=counter)
    assert record["energy_mj"] > 0 and record["energy_replays"] == 300
    assert 20 < record["energy_avg_w"] < 1_500  # an H200 under load draws 100-700 W


def load_benchmark(name: str):
    """A benchmarks/ script as a module (the folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass's string annotations are resolved through its module
    spec.loader.exec_module(module)
    return module


def test_kernel_profile_takes_each_kernels_median_forward():
    """benchmarks/profile_kernels.py splits each kernel's launches into the forwards they came from (in start
    order) and reports the median forward, so one slow forward does not move an A/B; a kernel launched twice a
    forward (two localized shards) counts both launches."""
    profile_kernels = load_benchmark("profile_kernels")
    events = [("gemm1", 10 * r, us) for r, us in enumerate([5.0, 5.0, 50.0])]  # forward 2 is slow
    events += [("gemm2", 10 * r + 1 + s, us) for r in range(3) for s, us in enumerate([2.0, 3.0])]
    medians, totals = profile_kernels.per_forward_medians(events[::-1], reps=3)  # any order in
    assert medians == {"gemm1": 5.0, "gemm2": 5.0}
    assert totals == [10.0, 10.0, 55.0]


def test_kernel_profile_can_pick_an_input_set_that_reaches_the_local_experts():
    """--min-local-pairs: the first input set (by index) whose routing sends enough pairs to this rank's experts;
    0 keeps the benchmark's own first set, and an impossible count is a ValueError, not a silent empty profile."""
    profile_kernels = load_benchmark("profile_kernels")
    shape = bench.SHAPES["deepseek-v3-ep8"]  # experts [0, 32) of 256, top 8

    def local_pairs(routing):
        return int(((routing.ids >= shape.local_offset) & (routing.ids < shape.local_offset + shape.num_local)).sum())

    routing, index, local = profile_kernels.routing_with_local_pairs(shape, 1, 0, "cpu")
    assert index == 0 and routing.seed == bench.point_seed(0, shape, 1, 0)
    routing, index, local = profile_kernels.routing_with_local_pairs(shape, 1, 2, "cpu")
    assert local == local_pairs(routing) >= 2 and routing.seed == bench.point_seed(0, shape, 1, index)
    assert all(local_pairs(bench.random_routing(1, shape, bench.point_seed(0, shape, 1, i), "cpu")) < 2
               for i in range(index))
    with pytest.raises(ValueError, match="min_local_pairs"):
        profile_kernels.routing_with_local_pairs(shape, 1, 9, "cpu", tries=5)  # T=1 routes 8 pairs at most


def test_ncu_stall_summary_groups_by_opcode_and_by_execution_count(tmp_path, capsys):
    """benchmarks/ncu_stalls.py on a per-SASS export (gzipped here): opcodes lose their predicate and modifiers,
    and code that runs equally often (per K step, per token chunk) is summed as one region."""
    import gzip

    ncu_stalls = load_benchmark("ncu_stalls")
    assert ncu_stalls.opcode("@!P2 IMAD.HI.U32 R21, R21, R108, RZ") == "IMAD"
    assert ncu_stalls.opcode("HMMA.16816.F32.BF16 R36, R48, R20, R44") == "HMMA"
    header = ["Address", "Source", "Instructions Executed", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    lines = [("0x0", "LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", 600, 6, 0, 9),  # per step
             ("0x10", "@P0 HMMA.16816.F32.BF16 R4, R8, R12, R4", 300, 3, 0, 9),
             ("0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", 100, 0, 0, 9),  # per chunk
             ("0x30", "ULDC UR8, c[0x0][0x3a0]", 100, 0, 11, 9)]
    path = tmp_path / "k.sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write('"Kernel Name","k"\n' + ",".join(f'"{h}"' for h in header) + "\n")
        f.writelines(",".join(f'"{v}"' for v in line) + "\n" for line in lines)
    assert ncu_stalls.main([str(path), "--top", "1", "--opcodes", "--regions"]) == 0
    out = capsys.readouterr().out
    assert "4 instructions, 20 stall samples" in out  # Not Issued columns are a subset, not added
    assert "ULDC UR8" in out.split("top 1")[1].splitlines()[1]  # the barrier's wait lands after it
    shares = {tuple(line.split()) for line in out.splitlines() if line.startswith("  ") and "%" in line}
    assert ("LOP3", "54.5%", "30.0%") in shares and ("HMMA", "27.3%", "15.0%") in shares
    assert ("100", "18.2%", "55.0%") in shares and ("600", "54.5%", "30.0%") in shares


def _timeline_words(sm, start_ns, start_clock, marks, gemm1_items, gemm2_items, end, steps=(8, 6)):
    """A CTA's decode_fused.TIMELINE words: `marks` maps a mark to its clock count after `start_clock`; `steps`:
    each phase's K steps an item."""
    dt = load_benchmark("decode_timeline")
    words = [0] * dt.TIMELINE_WORDS
    end_ns = start_ns + end
    words[:4] = [start_ns % 2**32, start_ns >> 32, sm, start_clock]
    words[24:27] = [(start_clock + end) % 2**32, end_ns % 2**32, end_ns >> 32]
    for name, cycles in marks.items():
        phase, _, piece = name.partition("_")
        if phase in dt.PHASES and piece in dt.PHASE_WORDS:
            word = 8 + 8 * dt.PHASES.index(phase) + dt.PHASE_WORDS.index(piece)
        else:
            word = dt.SLOTS[name]
        words[word] = (start_clock + cycles) % 2**32
    words[8 + 6], words[16 + 6] = gemm1_items, gemm2_items
    words[8 + 7], words[16 + 7] = steps
    return words


def test_decode_timeline_lines_up_ctas_and_times_each_piece_of_an_item():
    """benchmarks/decode_timeline.py: clock marks become ns since the CTA's start (modulo the 32-bit clock's wrap),
    CTAs line up on the global timer, a CTA without items in a phase has no marks there, and the summary gives
    each mark's median and last CTA, each piece's median and longest, and when the grid barrier opened."""
    dt = load_benchmark("decode_timeline")
    item = dict(waited=500, routed=1_000, zeroed=1_100, gemm1_item=1_200, gemm1_staged=1_500, gemm1_landed=2_200,
                gemm1_first_done=4_000, gemm1_last_done=4_000, gemm1_end=4_500, barrier_passed=6_000,
                gemm2_item=6_100, gemm2_staged=6_300, gemm2_landed=7_000, gemm2_first_done=8_000,
                gemm2_last_done=8_000, gemm2_end=8_400)
    idle = dict(waited=500, routed=1_000, zeroed=1_100, gemm1_end=1_150, barrier_passed=5_900, gemm2_end=5_950)
    slow = dict(item, gemm1_first_done=5_000, gemm1_last_done=5_000, gemm1_end=5_500)
    ctas = [_timeline_words(0, 10_000, 2**32 - 300, item, 3, 2, 9_000),  # its clock wraps during the kernel
            _timeline_words(0, 10_000, 50, slow, 3, 2, 9_000),  # SM 0's second CTA: the slowest GEMM1 item
            _timeline_words(1, 10_200, 7, item, 3, 2, 9_000),  # starts 200 ns later
            _timeline_words(1, 10_000, 9, idle, 3, 0, 6_000)]  # SM 1's idle CTA: no items in either phase
    decoded = [dt.decode_cta(words, clock_mhz=1_000.0) for words in ctas]  # a cycle is a ns
    assert decoded[0]["gemm1_landed"] == 2_200 and decoded[0]["end"] == 9_000 and decoded[0]["sm"] == 0
    assert decoded[3]["gemm1_item"] is None and decoded[3]["gemm1_end"] == 1_150
    summary = dt.forward_summary(decoded)
    assert summary["span_ns"] == 9_200 and summary["start_spread_ns"] == 200
    assert summary["at_gemm1_landed"] == dict(median=2_200, last=2_400, ctas=3)
    assert summary["gemm1_mainloop"] == dict(median=2_800, longest=3_800)
    assert summary["gemm1_epilogue"] == dict(median=500, longest=500)
    assert summary["gemm1_per_step"] == dict(median=1_800 / 6, longest=2_800 / 6)  # after the first 2 of 8 steps
    assert summary["gemm2_wait_ns"] == 5_900 - 5_500  # the first wait passed after the last GEMM1 item
    assert summary["sms_with_two_gemm1_ctas"] == 1
    twice = dt.summarize([summary, dict(summary, span_ns=9_400)])
    assert twice["span_ns"] == 9_300 and twice["forwards"] == 2
    assert twice["at_gemm1_landed"] == dict(median=2_200, last=2_400, ctas=3)
    assert twice["gemm2_mainloop"] == dict(median=1_900, longest=1_900)
    assert "first GEMM2 wait passed 0.40 us" in dt.format_summary("x", twice)


def test_decode_timeline_reads_the_words_the_kernel_writes():
    """benchmarks/decode_timeline.py keeps its own copy of decode_fused's timeline layout (the GPU machine runs it
    without CuTe-DSL): the two must agree."""
    pytest.importorskip("cutlass")
    from moe_ext.kernels.sm90 import decode_fused

    dt = load_benchmark("decode_timeline")
    assert dt.TIMELINE_WORDS == decode_fused.TIMELINE_WORDS and dt.SLOTS == decode_fused.TIMELINE
    assert dt.PHASE_WORDS == decode_fused.TIMELINE_PHASE
    assert max(dt.SLOTS.values()) < dt.TIMELINE_WORDS and 16 + len(dt.PHASE_WORDS) <= min(
        v for v in dt.SLOTS.values() if v >= 16)  # GEMM2's words end before the end marks


def test_tactic_table_ranks_tactics_by_their_geometric_mean_over_draws():
    """benchmarks/tactic_table.py's summary: a tactic's score is the geometric mean over the draws of its time over
    that draw's best, so one draw's routing cannot decide alone; the heuristic's rank is its place in that order."""
    table = load_benchmark("tactic_table")
    base = dict(shape="qwen3-30b-a3b", T=1, heuristic=[8, 1, 1])
    records = [dict(base, draw=0, us={"8,1,1": 10.0, "16,1,1": 11.0, "8,2,1": 20.0}),
               dict(base, draw=1, us={"8,1,1": 12.0, "16,1,1": 10.0, "8,2,1": 10.0})]
    (row,) = table.summarize(records)
    assert row["best"] == "16,1,1" and row["best_score"] == pytest.approx(1.1 ** 0.5)
    assert row["heuristic"] == "8,1,1" and row["heuristic_rank"] == 2
    assert row["heuristic_score"] == pytest.approx(1.2 ** 0.5)
    assert [t for t, _ in row["top"]] == ["16,1,1", "8,1,1", "8,2,1"]


def test_tactic_table_draws_the_benchmarks_routing_and_runs_every_valid_tactic():
    """Draw d of a point is the benchmark's input set d; every tactic the wrapper accepts gets a forward (run once),
    the heuristic's among them (on the CPU: the reference path's tiles)."""
    table = load_benchmark("tactic_table")
    shape = bench.Shape("tiny", 256, 128, 8, 2, 8)
    fields, forwards = table.tactic_forwards(shape, 5, 1, (256, 128), torch.device("cpu"))
    routing = bench.random_routing(5, shape, bench.point_seed(0, shape, 5, 1), "cpu")
    assert fields["seed"] == routing.seed and fields["local_pairs"] == 10 and fields["quant_mode"] == "w4a16"
    wrapper = moe_ext.CuteDslMoEWrapper(8, 2, 256, 128, device="cpu", quant_mode="w4a16")
    assert set(forwards) == {table.tactic_key(t) for t in wrapper.get_valid_tactics()}
    assert table.tactic_key(fields["heuristic"]) in forwards
    out = forwards[table.tactic_key(fields["heuristic"])]()
    assert out.shape == (5, 256) and torch.isfinite(out).all()


@pytest.mark.gpu
@hopper_kernels
def test_tactic_table_times_every_valid_tactic_cold():
    """One draw of a small point on the kernels: a positive time for every tactic the wrapper accepts."""
    table = load_benchmark("tactic_table")
    flush = moe_ext.tuning.l2_flush(torch.device("cuda", torch.cuda.current_device()))
    shape = bench.SHAPES["qwen3-30b-a3b"]
    hidden, inter = bench.supported_dims(shape, "w4a16", "cuda")
    record = table.measure_draw(shape, 8, 0, (hidden, inter), rounds=3, flush=flush)
    wrapper = moe_ext.CuteDslMoEWrapper(128, 8, hidden, inter, device="cuda", quant_mode="w4a16")
    assert set(record["us"]) == {table.tactic_key(t) for t in wrapper.get_valid_tactics()}
    assert all(0 < us < 1e4 for us in record["us"].values())
    assert table.tactic_key(record["heuristic"]) in record["us"] and record["local_pairs"] == 64


def _sweep_record(shape: str, t: int, impl: str, us: float, mode: str = "w4a16", **extra) -> dict:
    return dict(shape=shape, T=t, impl=impl, quant_mode=mode, finalize="fused" if impl == "moe_ext" else "peer",
                us=us, **extra)


def test_targets_are_read_off_the_sweep_each_point_with_its_gap():
    """benchmarks/check_targets.py: each issue-4 target over the points it covers. The triton_kernels check carries
    the bound (the peer's time over moe_ext's roofline time), and points no target covers give no check."""
    targets = load_benchmark("check_targets")
    ours = dict(roofline_fraction=0.75, roofline_us=60.0, tflops=10.0)
    records = [
        _sweep_record("gpt-oss-120b", 8, "moe_ext", 100.0, **ours),
        _sweep_record("gpt-oss-120b", 8, "torch_grouped_mm_bf16", 290.0),  # 2.9x: under 3x at T <= 64
        _sweep_record("gpt-oss-120b", 8, "triton_kernels_mxfp4", 140.0),  # 1.4x, 2.33x at the roofline
        _sweep_record("gpt-oss-120b", 8, "moe_ext", 50.0, mode="w4a4", **ours),  # not w4a16: not in the sweep checks
        _sweep_record("qwen3-30b-a3b", 1, "moe_ext", 16.0, roofline_fraction=0.2, roofline_us=3.0, tflops=0.1),
        _sweep_record("qwen3-30b-a3b", 256, "moe_ext", 100.0, roofline_fraction=0.5, roofline_us=50.0, tflops=1.0),
        _sweep_record("qwen3-30b-a3b", 256, "torch_grouped_mm_bf16", 90.0),  # 64 < T < 1024: no composite target
        _sweep_record("mixtral-8x7b", 4096, "moe_ext", 5000.0, roofline_fraction=0.7, roofline_us=3500.0,
                      tflops=451.0),
        _sweep_record("mixtral-8x7b", 4096, "torch_grouped_mm_bf16", 4900.0),  # 0.98x at T >= 1024
    ]
    checks = {(c.target, c.point): c for c in targets.sweep_checks(records)}
    assert set(checks) == {("decode roofline", "gpt-oss-120b T=8"), ("vs composite", "gpt-oss-120b T=8"),
                           ("vs triton_kernels", "gpt-oss-120b T=8"), ("Qwen3 T=1 us", "qwen3-30b-a3b T=1"),
                           ("vs composite", "mixtral-8x7b T=4096"), ("prefill TFLOP/s", "mixtral-8x7b T=4096")}
    assert checks["decode roofline", "gpt-oss-120b T=8"].met
    composite = checks["vs composite", "gpt-oss-120b T=8"]
    assert not composite.met and composite.value == pytest.approx(2.9) and composite.limit == 3.0
    triton = checks["vs triton_kernels", "gpt-oss-120b T=8"]
    assert triton.met and triton.value == pytest.approx(1.4) and triton.bound == pytest.approx(140 / 60)
    assert not checks["Qwen3 T=1 us", "qwen3-30b-a3b T=1"].met
    large = checks["vs composite", "mixtral-8x7b T=4096"]
    assert not large.met and large.limit == 1.0
    assert checks["prefill TFLOP/s", "mixtral-8x7b T=4096"].met
    table = targets.format_checks(list(checks.values()))
    assert "## vs composite: met at 0 of 2 points" in table and "1.400 (limit 1.3, 2.33 at the roofline)" in table


def test_quant_and_host_targets():
    """w4a4 / w4a8 within 15% of w4a16 at the same point; an eager T=1 call within 30 µs in at most 5 kernel nodes."""
    targets = load_benchmark("check_targets")
    quant = [_sweep_record("qwen3-30b-a3b", 256, "moe_ext", 100.0), _sweep_record("qwen3-30b-a3b", 256, "moe_ext",
                                                                                  115.0, mode="w4a4"),
             _sweep_record("qwen3-30b-a3b", 256, "moe_ext", 116.0, mode="w4a8"),
             _sweep_record("qwen3-30b-a3b", 1, "moe_ext", 50.0, mode="w4a8")]  # no w4a16 at T=1: no check
    checks = targets.quant_checks(quant)
    assert [(c.target, c.met) for c in checks] == [("w4a4 / w4a16 time", True), ("w4a8 / w4a16 time", False)]
    host = [dict(shape="qwen3-30b-a3b", T=1, quant_mode="w4a16", finalize="fused", host_us=31.0, kernel_nodes=5)]
    assert [(c.target, c.met) for c in targets.host_checks(host)] == [("eager host us", False), ("kernel nodes", True)]


def test_targets_script_reads_the_committed_sweep(capsys):
    """The command README gives runs on the committed files and names every target it found points for."""
    targets = load_benchmark("check_targets")
    results = ROOT / "benchmarks/results"
    assert targets.main(["--sweep", str(results / "h200.json"), "--host", str(results / "h200_host_overhead.json"),
                         "--quant", str(results / "h100_session53_quant_modes.json"),
                         str(results / "h100_session53_quant_t1_tuned.json")]) == 0
    out = capsys.readouterr().out
    for target in ("decode roofline", "vs composite", "vs triton_kernels", "prefill TFLOP/s", "Qwen3 T=1 us",
                   "eager host us", "kernel nodes", "w4a4 / w4a16 time", "w4a8 / w4a16 time"):
        assert f"## {target}: met at" in out
