"""A decode loop that keeps one CuteDslMoEWrapper, captures its forward in a CUDA graph once and replays it every
step with new activations and routing copied into the static inputs. Prints tokens/s.

    python3 examples/serving_loop.py [--quant-mode w4a4] [--batch 32] [--steps 200]

On a machine without CUDA the same loop runs eagerly (no graph) on the reference path.
"""
import argparse
import time

import torch

import moe_ext


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant-mode", default="w4a16", choices=["w4a16", "w4a4", "w4a8"])
    parser.add_argument("--batch", type=int, default=32, help="tokens per decode step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    E, K, H, I, T = args.experts, args.top_k, args.hidden, args.intermediate, args.batch
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    router = (torch.randn(H, E, generator=g) * H ** -0.5).to(device)
    gs = 2688.0 / 4.0  # activations here are N(0, 1): |x| < 4 almost surely
    weights = moe_ext.prepare_moe_weights(w1, w2, args.quant_mode, x_global_scale=gs).to(device)
    wrapper = moe_ext.CuteDslMoEWrapper(E, K, H, I, use_cuda_graph=cuda, max_num_tokens=T, device=device,
                                        quant_mode=args.quant_mode, use_fused_finalize=False)

    def step_inputs(step):
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(step)).to(device)
        scores, ids = torch.softmax(hidden @ router, dim=-1).topk(K, dim=-1)
        act = moe_ext.quantize_activation(hidden, args.quant_mode, global_scale=gs)
        return dict(x=act.x, x_sf=act.x_sf, token_selected_experts=ids.int(),
                    token_final_scales=(scores / scores.sum(-1, keepdim=True)).float())

    static = step_inputs(0)
    layer = dict(w1_weight=weights.w1_weight, w1_weight_sf=weights.w1_weight_sf, w1_alpha=weights.w1_alpha,
                 fc2_input_scale=weights.fc2_input_scale, w2_weight=weights.w2_weight,
                 w2_weight_sf=weights.w2_weight_sf, w2_alpha=weights.w2_alpha)
    out = wrapper.run(**static, **layer)  # warm-up: loads the kernels before capture
    graph = None
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = wrapper.run(**static, **layer)
    inputs = [step_inputs(s) for s in range(1, 9)]  # prepared ahead so the loop times the MoE alone
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(args.steps):
        new = inputs[step % len(inputs)]
        if graph is not None:
            for name, value in new.items():
                if value is not None:
                    static[name].copy_(value)
            graph.replay()
        else:
            out = wrapper.run(**new, **layer)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert torch.isfinite(out).all()
    mode = "graph replay" if graph is not None else "eager (no CUDA)"
    print(f"{args.steps} decode steps of {T} tokens, {args.quant_mode}, {mode} on {device}: "
          f"{args.steps * T / seconds:,.0f} tokens/s ({seconds / args.steps * 1e3:.3f} ms per step)")


if __name__ == "__main__":
    main()
