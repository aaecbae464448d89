"""Python side of the C++ launcher: device checks on torch tensors, then raw pointers to `moe_ext._C`.

The compiled kernels check nothing, and `_C` checks sizes and alignment; dtype, device and contiguity are
checked here, where the tensors are still torch tensors. Launches go to the current torch stream.
"""
from __future__ import annotations

import functools

import torch

from .activation import LOG2E
from .routing import Routing, max_num_tiles


@functools.lru_cache(maxsize=None)
def _module():
    try:
        from . import _C
    except ImportError:
        return None
    return _C


def has_kernel(name: str) -> bool:
    module = _module()
    return module is not None and name in module.kernels()


def hopper_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def _i32_vector(name: str, t: torch.Tensor, device: torch.device) -> int:
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous 1-D int32 tensor on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t.data_ptr()


def allocate_routing(num_tokens: int, top_k: int, num_local_experts: int, tile: int, device) -> Routing:
    tiles = max_num_tiles(num_tokens, top_k, num_local_experts, tile)
    i32 = dict(dtype=torch.int32, device=device)
    return Routing(
        local_expert=torch.empty(num_tokens, top_k, **i32),  # not written by the kernel
        expert_counts=torch.empty(num_local_experts, **i32),
        expert_offsets=torch.empty(num_local_experts + 1, **i32),
        expanded_to_permuted=torch.empty(num_tokens, top_k, **i32),
        permuted_to_expanded=torch.empty(tiles * tile, **i32),
        tile_to_expert=torch.empty(tiles, **i32),
        tile_to_mn_limit=torch.empty(tiles, **i32),
        num_live_tiles=torch.empty(1, **i32),
        tile_size=tile,
    )


def route(token_selected_experts: torch.Tensor, num_local_experts: int, local_expert_offset: int,
          out: Routing, enable_pdl: bool = True) -> Routing:
    """Fill `out` (sized by allocate_routing or a workspace) with the routing maps, on the current stream."""
    module = _module()
    if module is None or not hasattr(module, "routing"):
        raise RuntimeError("moe_ext._C was built without the sm_90a kernels")
    ids = token_selected_experts
    device = ids.device
    if ids.dtype != torch.int32 or ids.dim() != 2 or not ids.is_contiguous() or device.type != "cuda":
        raise ValueError("token_selected_experts must be a contiguous [T, K] int32 CUDA tensor")
    flat = ids.view(-1)
    e2p = out.expanded_to_permuted
    if e2p.shape != ids.shape:
        raise ValueError(f"routing buffers are for {tuple(e2p.shape)} slots, ids are {tuple(ids.shape)}")
    module.routing(
        _i32_vector("token_selected_experts", flat, device), flat.numel(), num_local_experts, local_expert_offset,
        out.tile_size,
        _i32_vector("expert_counts", out.expert_counts, device),
        _i32_vector("expert_offsets", out.expert_offsets, device),
        _i32_vector("expanded_to_permuted", e2p.view(-1), device),
        _i32_vector("permuted_to_expanded", out.permuted_to_expanded, device), out.permuted_to_expanded.numel(),
        _i32_vector("tile_to_expert", out.tile_to_expert, device),
        _i32_vector("tile_to_mn_limit", out.tile_to_mn_limit, device), out.tile_to_expert.numel(),
        _i32_vector("num_live_tiles", out.num_live_tiles, device),
        bool(enable_pdl), torch.cuda.current_stream(device).cuda_stream,
    )
    return out


ACTIVATION_KIND = {"swiglu": 0, "situ": 1, "geglu_tanh": 2, "relu2": 3}
TILE_M = 64  # moe_ext/kernels/sm90/mainloop.py TileConfig.tile_m: the routing tile of the Hopper kernels


def activation_params(activation) -> tuple[float, float, float, float]:
    """The four fp32 runtime parameters of the kernels' activation (moe_ext/kernels/sm90/activations.py)."""
    import numpy as np

    f32 = lambda v: float(np.float32(v))  # noqa: E731
    if activation.kind == "swiglu":  # -(alpha * log2e) folded in fp32, beta, limit
        return (f32(-f32(activation.swiglu_alpha * LOG2E)), f32(activation.swiglu_beta),
                f32(activation.swiglu_limit), 0.0)
    if activation.kind == "situ":  # b, 1/b, c (0: no linear clamp), 1/c
        b, c = activation.situ_beta, activation.situ_linear_beta
        return (f32(b), f32(1.0 / f32(b)), f32(c) if c else 0.0, f32(1.0 / f32(c)) if c else 0.0)
    return (0.0, 0.0, 0.0, 0.0)


def _buf(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    if t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} tensor on {device}, got {t.dtype} on {t.device}")
    return t.data_ptr(), t.numel()


def w4a16_forward(problem, routing: Routing, intermediate: torch.Tensor, slot_output: torch.Tensor,
                  out: torch.Tensor, enable_pdl: bool) -> torch.Tensor:
    """routing -> GEMM1 -> GEMM2 -> finalize on the current stream; every launch's grid depends on T only."""
    module = _module()
    device = problem.device
    stream = torch.cuda.current_stream(device).cuda_stream
    route(problem.token_selected_experts, problem.num_local_experts, problem.local_expert_offset, routing,
          enable_pdl)
    u8, i32, f32, bf16 = torch.uint8, torch.int32, torch.float32, torch.bfloat16
    w = problem.weights
    rows = routing.permuted_to_expanded.numel()
    tiles = routing.tile_to_expert.numel()
    p2e = _buf("permuted_to_expanded", routing.permuted_to_expanded, i32, device)[0]
    te = _buf("tile_to_expert", routing.tile_to_expert, i32, device)[0]
    tl = _buf("tile_to_mn_limit", routing.tile_to_mn_limit, i32, device)[0]
    live = _buf("num_live_tiles", routing.num_live_tiles, i32, device)[0]
    module.gemm1_w4a16(
        ACTIVATION_KIND[problem.activation.kind], *_buf("x", problem.x, bf16, device),
        *_buf("w1_weight", w.w1, u8, device), *_buf("w1_weight_sf", w.w1_sf_bytes(), u8, device),
        _buf("w1_alpha", problem.w1_alpha, f32, device)[0], problem.num_local_experts, p2e, rows, te, tl, tiles,
        live, *_buf("intermediate", intermediate, bf16, device), problem.hidden_size, problem.n1, problem.top_k,
        *activation_params(problem.activation), enable_pdl, stream)
    scales = problem.token_final_scales.view(-1)
    module.gemm2_w4a16(
        *_buf("intermediate", intermediate, bf16, device), *_buf("w2_weight", w.w2, u8, device),
        *_buf("w2_weight_sf", w.w2_sf_bytes(), u8, device), _buf("w2_alpha", problem.w2_alpha, f32, device)[0],
        problem.num_local_experts, *_buf("token_final_scales", scales, f32, device), p2e, rows, te, tl, tiles, live,
        *_buf("slot_output", slot_output, bf16, device), problem.hidden_size, problem.intermediate_size,
        problem.use_fused_finalize, enable_pdl, stream)
    e2p = routing.expanded_to_permuted.view(-1)
    module.finalize(*_buf("slot_output", slot_output, bf16, device), *_buf("expanded_to_permuted", e2p, i32, device),
                    _buf("token_final_scales", scales, f32, device)[0], *_buf("moe_output", out, bf16, device),
                    problem.hidden_size, problem.top_k, problem.use_fused_finalize, enable_pdl, stream)
    return out
