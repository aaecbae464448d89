"""Per-kernel GPU time of one forward (torch.profiler over eager wrapper runs), to see which kernel bounds a point.
    python3 benchmarks/profile_kernels.py [--points qwen3-30b-a3b:1,mixtral-8x7b:1024] [--mode w4a16] [--tactic 8]
"""
import argparse
import collections

import torch

import moe_ext

SHAPES = {"deepseek-v3": (7168, 2048, 256, 8, 256), "deepseek-v3-ep8": (7168, 2048, 256, 8, 32),
          "qwen3-30b-a3b": (2048, 768, 128, 8, 128), "mixtral-8x7b": (4096, 14336, 8, 2, 8)}


def inputs(name, T, mode, g):
    H, I, num_experts, K, E = SHAPES[name]
    block, sf_byte = (32, 121) if mode == "w4a8" else (16, 0x20)
    u8 = dict(dtype=torch.uint8, device="cuda", generator=g)
    ids = torch.rand(T, num_experts, device="cuda", generator=g).topk(K, dim=-1).indices.int()
    act = moe_ext.quantize_activation(torch.randn(T, H, device="cuda", generator=g), mode, global_scale=64.0)
    return dict(x=act.x, x_sf=act.x_sf, token_selected_experts=ids,
                token_final_scales=torch.full((T, K), 1.0 / K, device="cuda"),
                w1_weight=torch.randint(0, 256, (E, 2 * I, H // 2), **u8),
                w1_weight_sf=torch.full((moe_ext.quant.swizzled_size(E, 2 * I, H // block),), sf_byte,
                                        dtype=torch.uint8, device="cuda"),
                w1_alpha=torch.ones(E, device="cuda"),
                fc2_input_scale=torch.ones(1, device="cuda") if mode == "w4a4" else None,
                w2_weight=torch.randint(0, 256, (E, H, I // 2), **u8),
                w2_weight_sf=torch.full((moe_ext.quant.swizzled_size(E, H, I // block),), sf_byte,
                                        dtype=torch.uint8, device="cuda"),
                w2_alpha=torch.ones(E, device="cuda"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="qwen3-30b-a3b:1,deepseek-v3-ep8:1,deepseek-v3-ep8:64,mixtral-8x7b:1,"
                                            "mixtral-8x7b:1024")
    parser.add_argument("--mode", default="w4a16")
    parser.add_argument("--tactic", type=int, default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for point in args.points.split(","):
        name, T = point.split(":")
        T = int(T)
        H, I, num_experts, K, E = SHAPES[name]
        kw = inputs(name, T, args.mode, g)
        wrapper = moe_ext.CuteDslMoEWrapper(num_experts, K, H, I, max_num_tokens=T, num_local_experts=E,
                                            quant_mode=args.mode, device="cuda", use_fused_finalize=False)
        tactic = None if args.tactic is None else (args.tactic,)
        for _ in range(3):
            wrapper.run(**kw, tactic=tactic)
        torch.cuda.synchronize()
        reps = 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                wrapper.run(**kw, tactic=tactic)
            torch.cuda.synchronize()
        times = collections.defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name[:60]] += event.device_time / reps
        total = sum(times.values())
        print(f"{name} T={T} {args.mode} tactic={tactic}: {total:.1f} us of kernels")
        for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {us:9.1f} us  {kernel}")
        del kw, wrapper
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
