"""Expert parallelism across 2 processes (gloo on CPU; NCCL on 2 GPUs where there are): each rank holds half the
experts and its own tokens; the combined result equals the single-process layer within the modes' tolerance."""
import contextlib
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import TOLERANCE, make_case  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext.distributed import ExpertParallelMoE  # noqa: E402

WORLD = 2
TOKENS = (5, 8)  # uneven per-rank token counts exercise the padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _gloo_group(rank: int = 0, world: int = 1, port: int | None = None, backend: str = "gloo"):
    """A process group for the duration of the block (one rank of `world`, or a single-process group)."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port or _free_port()}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _two_gpus():
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA devices (NCCL)")


def _case(mode, act, tokens=TOKENS, size=128):
    return make_case(mode, act, num_tokens=sum(tokens), top_k=3, num_experts=8, seed=21, invalid_fraction=0.05,
                     hidden=size, inter=size)


def _rank_main(rank, port, results, mode, act, fused, exchange="all_gather", backend="gloo", tokens=TOKENS,
               size=128, graph=False):
    """One rank: its half of the experts over its own tokens. On NCCL rank r runs on cuda:r; with `graph` the
    all-gather layer (padded to a fixed max_tokens_per_rank) is captured once and replayed."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    with _gloo_group(rank, WORLD, port, backend):
        case = _case(mode, act, tokens, size).to(device)
        local = moe_ext.quant.slice_experts(case.prepared, rank * 4, 4)
        exchanges = ExpertParallelMoE.EXCHANGES if exchange == "both" else (exchange,)
        cap = {"max_tokens_per_rank": max(tokens)} if graph else {}
        layers = [ExpertParallelMoE(local, num_experts=8, top_k=3, use_fused_finalize=fused, exchange=e,
                                    **cap, **case.activation_kwargs) for e in exchanges]
        start = sum(tokens[:rank])
        rows = slice(start, start + tokens[rank])
        q = case.quantized
        mine = moe_ext.quant.QuantizedActivation(
            q.x[rows], None if q.x_sf is None else q.x_sf[rows],
            None if q.per_token_scale is None else q.per_token_scale[rows])
        if graph:
            outs = [_captured_forward(layers[0], mine, case.ids[rows], case.scales[rows])]
        else:
            outs = [layer(mine, case.ids[rows], case.scales[rows]) for layer in layers]
        outs = [o.cpu() for o in outs]
        results[rank] = outs if exchange == "both" else outs[0]


def _captured_forward(layer, *inputs):
    """Capture one forward, replay it twice, return the output. The graph is gone before the process group is
    destroyed: a live graph holding NCCL work makes destroy_process_group hang (pytorch/pytorch#115388)."""
    layer(*inputs)  # warm-up outside capture: kernels load, plans record
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = layer(*inputs)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    return static_out.clone()


def _run_ranks(*args, **kwargs):
    """Spawn WORLD ranks of _rank_main(rank, port, results, *args, **kwargs); their outputs, rank-ordered."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_spawned_rank, args=(_free_port(), results, args, kwargs), nprocs=WORLD, join=True,
                           start_method="spawn")
        return [results[r] for r in range(WORLD)]


def _spawned_rank(rank, port, results, args, kwargs):  # start_processes passes no keyword arguments
    _rank_main(rank, port, results, *args, **kwargs)


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("mode,act,fused", [("w4a16", "swiglu", False), ("w4a4", "relu2", True),
                                             ("w4a4_pt", "swiglu_oai", False), ("w4a8", "geglu_tanh", True)])
def test_two_rank_expert_parallel_equals_single_process(mode, act, fused, exchange):
    combined = torch.cat(_run_ranks(mode, act, fused, exchange=exchange))
    expected = moe_ext.cute_dsl_fused_moe(**_case(mode, act).kwargs(use_fused_finalize=fused))
    rel = float((combined.float() - expected.float()).norm() / expected.float().norm())
    # Each rank rounds its partial sum to bf16 before the cross-rank sum: a few bf16 ulps apart at most.
    assert rel < 1e-2, rel


def test_all_to_all_equals_all_gather_bitwise_on_two_ranks():
    """Both exchanges hand each token the same per-rank partial sums; with two ranks their fp32 sum is exact in
    either order, so the two outputs are identical."""
    for rank, (gathered, to_all) in enumerate(_run_ranks("w4a4", "swiglu", False, exchange="both")):
        assert torch.equal(gathered, to_all), rank


GPU_TOKENS = (37, 100)  # uneven, several routing tiles per expert on the larger rank


@_two_gpus()
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("mode,act,fused", [("w4a16", "swiglu", False), ("w4a4", "relu2", True),
                                             ("w4a4_pt", "swiglu_oai", False), ("w4a8", "geglu_tanh", True)])
def test_two_gpu_nccl_expert_parallel_equals_single_gpu(mode, act, fused, exchange):
    """2 ranks on cuda:0 and cuda:1 over NCCL, running the Hopper kernels, against the one-GPU layer on cuda:0."""
    combined = torch.cat(_run_ranks(mode, act, fused, exchange=exchange, backend="nccl", tokens=GPU_TOKENS,
                                    size=256))
    case = _case(mode, act, GPU_TOKENS, 256).to("cuda:0")
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused)).cpu()
    assert torch.isfinite(combined).all()
    rel = float((combined.float() - expected.float()).norm() / expected.float().norm())
    assert rel < TOLERANCE[mode], rel  # the single-GPU gate; each rank rounds its partial sum to bf16 first


@_two_gpus()
@pytest.mark.parametrize("fused", [False, True])
def test_two_gpu_all_gather_layer_is_graph_capturable(fused):
    """With max_tokens_per_rank the all-gather layer has no host sync: a captured step replays to the eager result."""
    captured = _run_ranks("w4a16", "swiglu", fused, backend="nccl", tokens=GPU_TOKENS, size=256, graph=True)
    eager = _run_ranks("w4a16", "swiglu", fused, backend="nccl", tokens=GPU_TOKENS, size=256)
    for rank in range(WORLD):
        if fused:  # atomics in another order: a few bf16 ulps
            rel = float((captured[rank].float() - eager[rank].float()).norm() / eager[rank].float().norm())
            assert rel < 5e-3, (rank, rel)
        else:
            assert torch.equal(captured[rank], eager[rank]), rank


def test_max_tokens_per_rank_is_checked():
    with _gloo_group():
        case = make_case("w4a16", num_experts=8, num_tokens=5)
        with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
            ExpertParallelMoE(case.prepared, num_experts=8, top_k=2, max_tokens_per_rank=0)
        with pytest.raises(ValueError, match="exchange='all_gather' only"):
            ExpertParallelMoE(case.prepared, num_experts=8, top_k=2, max_tokens_per_rank=8, exchange="all_to_all")
        layer = ExpertParallelMoE(case.prepared, num_experts=8, top_k=2, max_tokens_per_rank=4)
        with pytest.raises(ValueError, match="more than max_tokens_per_rank=4"):
            layer(case.quantized, case.ids, case.scales)
        padded = ExpertParallelMoE(case.prepared, num_experts=8, top_k=2, max_tokens_per_rank=8)
        unpadded = ExpertParallelMoE(case.prepared, num_experts=8, top_k=2)
        assert torch.equal(padded(case.quantized, case.ids, case.scales),
                           unpadded(case.quantized, case.ids, case.scales))


def test_unknown_exchange_is_refused():
    with _gloo_group():
        case = make_case("w4a16", num_experts=8)
        with pytest.raises(ValueError, match="exchange must be one of"):
            ExpertParallelMoE(case.prepared, num_experts=8, top_k=2, exchange="broadcast")


def test_world_size_must_divide_experts():
    with _gloo_group():
        case = make_case("w4a16", num_experts=8)
        with pytest.raises(ValueError, match="must hold 8 experts"):
            ExpertParallelMoE(moe_ext.quant.slice_experts(case.prepared, 0, 4), num_experts=8, top_k=2)
        with pytest.raises(ValueError, match="experts \\[6, 10\\)"):
            moe_ext.quant.slice_experts(case.prepared, 6, 4)


def test_expert_parallel_example_runs_under_torchrun():
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             os.path.join(root, "examples", "expert_parallel.py"), "--tokens", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rel. error vs one process" in result.stdout


def test_expert_parallel_benchmark_runs_under_torchrun(tmp_path):
    """benchmarks/bench_expert_parallel.py at a tiny size on 2 gloo ranks (the same script times NCCL on GPUs)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ep.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": root}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             os.path.join(root, "benchmarks", "bench_expert_parallel.py"), "--shape", "qwen3-30b-a3b",
                             "--hidden", "256", "--inter", "256", "--tokens", "8", "--iters", "1", "--warmup", "0",
                             "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    records = json.loads(out.read_text())
    assert {r["exchange"] for r in records} == {"all_gather", "all_to_all"}
    assert all(r["world"] == 2 and r["ms"] > 0 for r in records)
