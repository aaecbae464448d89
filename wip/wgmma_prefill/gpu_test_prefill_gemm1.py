"""GPU test of the prefill GEMM1 prototype (prefill_gemm1.py) on an H100/H200: correctness against a torch fp32
reference built from moe_ext's own helpers, then timing against the current mma.sync GEMM1 (stream.py, w4a16,
128-token tile) on the same routing. Both kernels are JIT-compiled here through TVM-FFI (the Python call path
that ran on the H200; the CuTe-ABI JIT path failed there, shared/spec/cutedsl_on_hopper.md section 7 (e)).

On the device machine (CuTe-DSL from the offline bundle; carry `.offline`):
    tar xJf .offline/cutedsl-4.8.1-py312.tar.xz -C /tmp && . /tmp/cutedsl-4.8.1-py312/env.sh
    PYTHONUNBUFFERED=1 timeout 300 python3 wip/wgmma_prefill/gpu_test_prefill_gemm1.py --out $OUT/prefill.json

A deadlock (pipeline arrive counts, phases) shows up as a hang: the script kills itself after --deadline seconds
(SIGALRM, no handler), and the correctness cases run first, on small problems, so a hang costs little.
Exit status: 0 when every correctness case passes, 1 otherwise.

What is compared: out[row, c] = w1_alpha[e] * sum_k x[token(row), k] * W1[e][c, k] for every valid permuted row
(rows below tile_to_mn_limit of a live tile), W1 decoded with moe_ext.reference.dequantize_expert. The output is
poisoned with NaN first: padding rows and dead tiles must stay NaN (no stray writes), valid rows must not.
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.abspath(os.path.join(_HERE, "..", ".."))
for path in (_HERE, _REPO):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

TILE = 128
PEAK_BF16_FLOPS = 790e12  # dense bf16, measured on this H200 (torch 8192^3)
PEAK_BYTES = 4.8e12  # HBM3e nominal


def log(*args):
    print(*args, flush=True)


@dataclass
class Problem:
    name: str
    x: torch.Tensor  # bf16 [T, H]
    w1: torch.Tensor  # uint8 [E_local, N1, H/2]
    sf: torch.Tensor  # uint8 flat, 128x4-swizzled e4m3 scales of w1
    alpha: torch.Tensor  # fp32 [E_local]
    routing: object  # moe_ext.routing.Routing, tile 128
    top_k: int

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    @property
    def n1(self) -> int:
        return self.w1.shape[1]


def route(ids, num_local, offset):
    from moe_ext.routing import compute_routing

    return compute_routing(ids, num_local, offset, TILE)


def random_ids(T, E, K, device, gen, skew=0.0):
    """Distinct top-k experts per token; with skew > 0 low expert ids are favoured (multi-tile experts, empty
    experts)."""
    weights = torch.rand(T, E, generator=gen, device=device)
    if skew:
        weights = weights + skew * torch.linspace(1.0, 0.0, E, device=device)
    return weights.topk(K, dim=1).indices.to(torch.int32).contiguous()


def prepared_problem(name, T, E, K, H, I, device, seed, local=None, skew=0.0) -> Problem:
    """Weights through moe_ext.prepare_moe_weights (w4a16: NVFP4 weights, alpha = 1 / global scale); `local` =
    (offset, count) keeps only those experts (expert parallelism), via moe_ext.quant.slice_experts."""
    from moe_ext.activation import ActivationType
    from moe_ext.quant import prepare_moe_weights, slice_experts
    from moe_ext.quant.swizzle import sf_bytes

    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=gen, device=device) * 0.05
    w2 = torch.randn(E, H, I, generator=gen, device=device) * 0.05
    prepared = prepare_moe_weights(w1, w2, "w4a16", ActivationType.Swiglu)
    offset, count = local if local else (0, E)
    if local:
        prepared = slice_experts(prepared, offset, count)
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    ids = random_ids(T, E, K, device, gen, skew)
    sf = sf_bytes(prepared.w1_weight_sf, prepared.w1_weight_sf.numel())
    return Problem(name, x, prepared.w1_weight.contiguous(), sf, prepared.w1_alpha.contiguous(),
                   route(ids, count, offset), K)


def random_bytes_problem(name, T, E, K, H, N1, device, seed, num_local=None) -> Problem:
    """Large shapes for timing: random e2m1 bytes and e4m3 scale bytes in [2^-3, 2^2) (no NaN codes), swizzled with
    moe_ext.quant.swizzle_sf; cheaper than quantizing bf16 weights of that size. Tokens pick K of E experts; with
    `num_local`, only experts 0..num_local-1 are on this rank (expert parallelism) and have weights."""
    from moe_ext.quant import swizzle_sf

    local = num_local or E
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randint(0, 256, (local, N1, H // 2), generator=gen, device=device, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x48, (local, N1, H // 16), generator=gen, device=device, dtype=torch.uint8)
    sf = swizzle_sf(scales)
    del scales
    alpha = (torch.rand(local, generator=gen, device=device) + 0.5).float()
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    ids = random_ids(T, E, K, device, gen)
    return Problem(name, x, w1, sf, alpha, route(ids, local, 0), K)


def flat_weight(t: torch.Tensor) -> torch.Tensor:
    """Flat view; tensor extents are int32, so a weight over 2^31 bytes is passed as its first 2^31 - 1 bytes (the
    kernels only use the base pointer and 64-bit row offsets, as moe_ext.launcher._weight_view does)."""
    flat = t.reshape(-1)
    return flat if flat.numel() < 2 ** 31 else flat[:2 ** 31 - 1]


def valid_rows(p: Problem) -> torch.Tensor:
    r = p.routing
    live = int(r.num_live_tiles.item())
    limits = r.tile_to_mn_limit[:live].long()
    rows = torch.arange(live * TILE, device=limits.device)
    return rows[rows < limits.repeat_interleave(TILE)]


def reference_rows(p: Problem, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [len(rows), N1]: alpha[e] * x[token] @ dequant(W1[e])^T, per expert, in fp32 (no TF32)."""
    from moe_ext.reference import dequantize_expert

    r = p.routing
    expert_of_row = r.tile_to_expert[rows // TILE].long()
    tokens = r.permuted_to_expanded[rows].long() // p.top_k
    out = torch.empty(rows.numel(), p.n1, dtype=torch.float32, device=rows.device)
    for e in torch.unique(expert_of_row).tolist():
        sel = (expert_of_row == e).nonzero().squeeze(1)
        w = dequantize_expert(p.w1, p.sf, e, "w4a16")  # [N1, H] fp32, exact
        out[sel] = (p.x[tokens[sel]].float() @ w.T) * p.alpha[e]
    return out


# --------------------------------------------------------------------------------------------------------------
# The two kernels, JIT through TVM-FFI (torch tensors in, current torch stream)
# --------------------------------------------------------------------------------------------------------------
def compile_new(cfg):
    import prefill_gemm1

    start = time.perf_counter()
    fn = prefill_gemm1.compile_prefill_gemm1("--gpu-arch sm_90a", cfg, tvm_ffi=True)
    log(f"prefill_gemm1 compiled in {time.perf_counter() - start:.1f} s ({cfg})")
    return fn


def run_new(fn, p: Problem, out: torch.Tensor):
    r = p.routing
    fn(p.x.reshape(-1), flat_weight(p.w1), p.sf, p.alpha, r.permuted_to_expanded, r.tile_to_expert,
       r.tile_to_mn_limit, r.num_live_tiles, out, p.hidden, p.n1, p.top_k)


def compile_old():
    """moe_ext's current GEMM1 (mma.sync streaming kernel), w4a16 + SwiGLU, 128-token tile: the same fake
    arguments as gemm1.compile_gemm1 with the stream taken from torch."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from moe_ext.kernels.sm90 import gemm1

    def vector(dtype, align=4):
        return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)

    u8 = cutlass.Uint8
    start = time.perf_counter()
    fn = cute.compile(
        gemm1.make_kernel("w4a16", "swiglu", TILE), vector(BFloat16, 16), vector(u8, 16), vector(u8),
        vector(Float32), vector(u8, 16), vector(u8, 16), vector(Float32), vector(Int32), vector(Int32),
        vector(Int32), vector(Int32), vector(BFloat16, 16), vector(u8, 16), vector(u8), vector(Float32),
        Int32(128), Int32(256), Int32(128), Int32(0), Int32(1), Float32(0), Float32(0), Float32(0), Float32(0),
        Int32(1), cutlass.Boolean(False), make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--gpu-arch sm_90a --enable-tvm-ffi")
    log(f"mma.sync gemm1 compiled in {time.perf_counter() - start:.1f} s")
    return fn


def run_old(fn, p: Problem, out_bf16: torch.Tensor, dummies: dict):
    from moe_ext import launcher
    from moe_ext.activation import Activation

    r = p.routing
    act = launcher.activation_params(Activation("swiglu"))
    inter = p.n1 // 2
    fn(p.x.reshape(-1), dummies["u8"], dummies["u8"], dummies["f32"], flat_weight(p.w1), p.sf, p.alpha,
       r.permuted_to_expanded, r.tile_to_expert, r.tile_to_mn_limit, r.num_live_tiles, out_bf16, dummies["u8"],
       dummies["u8"], dummies["f32"], p.hidden, p.n1, inter, 0, p.top_k, *act, 1, False)


# --------------------------------------------------------------------------------------------------------------
# Checks and timing
# --------------------------------------------------------------------------------------------------------------
def check(fn, p: Problem, max_check_rows=None) -> dict:
    rows_total = p.routing.permuted_to_expanded.numel()
    out = torch.full((rows_total * p.n1,), float("nan"), dtype=torch.float32, device=p.x.device)
    run_new(fn, p, out)
    if out.is_cuda:
        torch.cuda.synchronize()
    out = out.view(rows_total, p.n1)
    rows = valid_rows(p)
    written = torch.zeros(rows_total, dtype=torch.bool, device=out.device)
    written[rows] = True
    stray = int(torch.isfinite(out[~written]).any(dim=1).sum())  # padding rows / dead tiles touched
    missing = int((~torch.isfinite(out[rows])).any(dim=1).sum())  # valid rows not (fully) written
    checked = rows
    if max_check_rows is not None and rows.numel() > max_check_rows:  # first and last rows of the live range
        checked = torch.cat([rows[:max_check_rows // 2], rows[-max_check_rows // 2:]])
    ref = reference_rows(p, checked)
    got = out[checked]
    finite = torch.isfinite(got).all(dim=1)
    diff = (got[finite] - ref[finite])
    rel_l2 = float(diff.norm() / ref[finite].norm().clamp_min(1e-30)) if finite.any() else float("nan")
    max_rel = float(diff.abs().max() / ref[finite].abs().max().clamp_min(1e-30)) if finite.any() else float("nan")
    ok = stray == 0 and missing == 0 and rel_l2 < 1e-4
    return dict(problem=p.name, rows=int(rows.numel()), checked_rows=int(checked.numel()), rel_l2=rel_l2,
                max_abs_over_max_ref=max_rel, stray_rows=stray, missing_rows=missing, ok=ok)


def cuda_event_us(fn, iters, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def profiler_us(fn, iters, needle: str):
    """Mean device time of kernels whose name contains `needle` (excludes launch overhead); None if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        total, count = 0.0, 0
        for event in prof.key_averages():
            if needle in event.key:
                total += getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
                count += event.count
        return total / count if count else None
    except Exception as exc:  # profiler support varies (gVisor, CUPTI)
        log(f"  profiler unavailable: {exc}")
        return None


def floors(p: Problem) -> dict:
    """Roofline floors of this GEMM1 on this routing: FLOPs at 790 TFLOP/s (issued = live tiles x 128 rows; useful
    = valid rows) and bytes at 4.8 TB/s (weights + scales of the experts hit once, x once, fp32 out once)."""
    r = p.routing
    live = int(r.num_live_tiles.item())
    valid = int(valid_rows(p).numel())
    experts_hit = int(torch.unique(r.tile_to_expert[:live]).numel())
    H, N1 = p.hidden, p.n1
    flops_issued = 2.0 * live * TILE * N1 * H
    flops_useful = 2.0 * valid * N1 * H
    weight_bytes = experts_hit * N1 * (H // 2 + H // 16)
    bytes_ = weight_bytes + p.x.numel() * 2 + valid * N1 * 4
    return dict(live_tiles=live, valid_rows=valid, experts_hit=experts_hit, flops_issued=flops_issued,
                flops_useful=flops_useful, bytes=bytes_, flop_floor_us=flops_issued / PEAK_BF16_FLOPS * 1e6,
                byte_floor_us=bytes_ / PEAK_BYTES * 1e6)


def bench(fn_new, fn_old, p: Problem, iters: int) -> dict:
    r = p.routing
    rows_total = r.permuted_to_expanded.numel()
    out = torch.empty(rows_total * p.n1, dtype=torch.float32, device=p.x.device)
    result = dict(problem=p.name, **floors(p))
    result["new_event_us"] = cuda_event_us(lambda: run_new(fn_new, p, out), iters)
    result["new_kernel_us"] = profiler_us(lambda: run_new(fn_new, p, out), iters, "prefill_gemm1")
    if fn_old is not None:
        dummies = {"u8": torch.zeros(16, dtype=torch.uint8, device=p.x.device),
                   "f32": torch.zeros(4, dtype=torch.float32, device=p.x.device)}
        out_bf16 = torch.empty(rows_total * p.n1 // 2, dtype=torch.bfloat16, device=p.x.device)
        result["old_event_us"] = cuda_event_us(lambda: run_old(fn_old, p, out_bf16, dummies), iters)
        result["old_kernel_us"] = profiler_us(lambda: run_old(fn_old, p, out_bf16, dummies), iters, "gemm1_kernel")
    for key in ("new_kernel_us", "new_event_us", "old_kernel_us", "old_event_us"):
        t = result.get(key)
        if t:
            result[key.replace("_us", "_tflops")] = result["flops_issued"] / (t * 1e-6) / 1e12
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--deadline", type=int, default=240, help="seconds before the process kills itself")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-old", action="store_true", help="do not compile/time the mma.sync GEMM1")
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--lag", type=int, default=None)
    parser.add_argument("--shapes", default="qwen3,mixtral,dsv3ep8",
                        help="timing shapes (comma list of qwen3, mixtral, dsv3ep8, dsv3)")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    signal.alarm(args.deadline)  # default action: terminate, even while blocked in a CUDA call

    import dataclasses

    import prefill_gemm1

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    log(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    cfg = prefill_gemm1.DEFAULT
    if args.stages is not None:
        cfg = dataclasses.replace(cfg, stages=args.stages)
    if args.lag is not None:
        cfg = dataclasses.replace(cfg, lag=args.lag)
    fn_new = compile_new(cfg)

    results = {"config": dataclasses.asdict(cfg), "correctness": [], "bench": []}
    # Correctness: small problems first (a hang shows early). Partial tiles, empty experts, multi-tile experts,
    # expert parallelism (local experts 4..11 of 16), a larger H (many K stages; stages wrap around the rings).
    cases = [
        ("tiny T=7 E=4 K=2 H=256 I=128", dict(T=7, E=4, K=2, H=256, I=128)),
        ("small T=300 E=8 K=2 H=512 I=256", dict(T=300, E=8, K=2, H=512, I=256)),
        ("skewed T=700 E=8 K=2 H=512 I=256", dict(T=700, E=8, K=2, H=512, I=256, skew=3.0)),
        ("EP local 4..11 of 16, T=512 K=4 H=1024 I=384", dict(T=512, E=16, K=4, H=1024, I=384, local=(4, 8))),
        ("deep K: T=256 E=4 K=2 H=4096 I=256", dict(T=256, E=4, K=2, H=4096, I=256)),
    ]
    all_ok = True
    for i, (name, kw) in enumerate(cases):
        p = prepared_problem(name, device=device, seed=i, **kw)
        res = check(fn_new, p)
        all_ok &= res["ok"]
        results["correctness"].append(res)
        log(f"[{'PASS' if res['ok'] else 'FAIL'}] {name}: rel_l2={res['rel_l2']:.2e} "
            f"max_err/max_ref={res['max_abs_over_max_ref']:.2e} rows={res['rows']} stray={res['stray_rows']} "
            f"missing={res['missing_rows']}")

    if not args.skip_bench:
        fn_old = None if args.skip_old else compile_old()
        T = args.tokens
        shapes = {  # (E, K, H, N1) of GEMM1
            "qwen3": (128, 8, 2048, 2 * 768),
            "mixtral": (8, 2, 4096, 2 * 14336),
            "dsv3ep8": (256, 8, 7168, 2 * 2048),  # DeepSeek-V3 over 8 ranks: experts 0..31 local
            "dsv3": (256, 8, 7168, 2 * 2048),
        }
        for name in [s for s in args.shapes.split(",") if s]:
            E, K, H, N1 = shapes[name]
            local = 32 if name == "dsv3ep8" else None
            p = random_bytes_problem(f"{name} T={T}", T, E, K, H, N1, device, seed=100, num_local=local)
            res = check(fn_new, p, max_check_rows=512)
            all_ok &= res["ok"]
            results["correctness"].append(res)
            log(f"[{'PASS' if res['ok'] else 'FAIL'}] {p.name} (sampled rows): rel_l2={res['rel_l2']:.2e} "
                f"stray={res['stray_rows']} missing={res['missing_rows']}")
            b = bench(fn_new, fn_old, p, args.iters)
            results["bench"].append(b)
            log(f"  {p.name}: live tiles {b['live_tiles']}, valid rows {b['valid_rows']}, experts hit "
                f"{b['experts_hit']}; floors: flops {b['flop_floor_us']:.0f} us, bytes {b['byte_floor_us']:.0f} us")
            for who in ("new", "old"):
                if f"{who}_event_us" in b:
                    k = b.get(f"{who}_kernel_us")
                    log(f"  {who:3s}: kernel {k if k is None else round(k, 1)} us, events "
                        f"{b[f'{who}_event_us']:.1f} us, {b.get(f'{who}_kernel_tflops') or b[f'{who}_event_tflops']:.0f}"
                        f" TFLOP/s issued")
            del p
            torch.cuda.empty_cache()

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    log("ALL PASS" if all_ok else "SOME FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
