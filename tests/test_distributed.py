"""Expert parallelism across 2 processes (gloo on CPU): each rank holds half the experts and its own tokens; the
combined result equals the single-process layer within the modes' tolerance."""
import contextlib
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_case  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext.distributed import ExpertParallelMoE  # noqa: E402

WORLD = 2
TOKENS = (5, 8)  # uneven per-rank token counts exercise the padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _gloo_group(rank: int = 0, world: int = 1, port: int | None = None):
    """A gloo process group for the duration of the block (one rank of `world`, or a single-process group)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or _free_port()}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_main(rank, port, mode, act, fused, results, exchange="all_gather"):
    with _gloo_group(rank, WORLD, port):
        case = make_case(mode, act, num_tokens=sum(TOKENS), top_k=3, num_experts=8, seed=21, invalid_fraction=0.05)
        local = moe_ext.quant.slice_experts(case.prepared, rank * 4, 4)
        exchanges = ExpertParallelMoE.EXCHANGES if exchange == "both" else (exchange,)
        layers = [ExpertParallelMoE(local, num_experts=8, top_k=3, use_fused_finalize=fused, exchange=e,
                                    **case.activation_kwargs) for e in exchanges]
        start = sum(TOKENS[:rank])
        rows = slice(start, start + TOKENS[rank])
        q = case.quantized
        mine = moe_ext.quant.QuantizedActivation(
            q.x[rows], None if q.x_sf is None else q.x_sf[rows],
            None if q.per_token_scale is None else q.per_token_scale[rows])
        outs = [layer(mine, case.ids[rows], case.scales[rows]) for layer in layers]
        results[rank] = outs if exchange == "both" else outs[0]


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("mode,act,fused", [("w4a16", "swiglu", False), ("w4a4", "relu2", True),
                                             ("w4a4_pt", "swiglu_oai", False), ("w4a8", "geglu_tanh", True)])
def test_two_rank_expert_parallel_equals_single_process(mode, act, fused, exchange):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(_free_port(), mode, act, fused, results, exchange), nprocs=WORLD,
                           join=True, start_method="spawn")
        combined = torch.cat([results[r] for r in range(WORLD)])
    case = make_case(mode, act, num_tokens=sum(TOKENS), top_k=3, num_experts=8, seed=21, invalid_fraction=0.05)
    expected = moe_ext.cute_dsl_fused_moe(**case.kwargs(use_fused_finalize=fused))
    rel = float((combined.float() - expected.float()).norm() / expected.float().norm())
    # Each rank rounds its partial sum to bf16 before the cross-rank sum: a few bf16 ulps apart at most.
    assert rel < 1e-2, rel


def test_all_to_all_equals_all_gather_bitwise_on_two_ranks():
    """Both exchanges hand each token the same per-rank partial sums; with two ranks their fp32 sum is exact in
    either order, so the two outputs are identical."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(_free_port(), "w4a4", "swiglu", False, results, "both"), nprocs=WORLD,
                           join=True, start_method="spawn")
        for rank in range(WORLD):
            gathered, to_all = results[rank]
            assert torch.equal(gathered, to_all), rank


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
