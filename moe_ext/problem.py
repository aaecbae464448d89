"""Validation of the fused-MoE arguments into one `MoEProblem`, before any work is done.

Every check raises TypeError (wrong kind or dtype) or ValueError (wrong value or shape) naming the argument and
what was expected. Only tensor metadata is read: full-width weights replaced by storage-less placeholders
(localized execution) pass validation untouched.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .activation import Activation
from .quant.block import sf_block
from .quant.swizzle import check_sf_form, sf_bytes, swizzled_size

QUANT_MODES = ("w4a4", "w4a8", "w4a16")
LOCALIZED_KEYS = ("w1_weight", "w1_weight_sf", "w2_weight", "w2_weight_sf")


def canonical_quant_mode(quant_mode) -> str:
    if not isinstance(quant_mode, str):
        raise TypeError(f"quant_mode must be a str, got {type(quant_mode).__name__}")
    if quant_mode == "nvfp4":
        warnings.warn('quant_mode="nvfp4" is deprecated; use "w4a4"', DeprecationWarning, stacklevel=3)
        return "w4a4"
    if quant_mode not in QUANT_MODES:
        raise ValueError(f"quant_mode must be one of {QUANT_MODES} (or the deprecated 'nvfp4'), got {quant_mode!r}")
    return quant_mode


@dataclass
class WeightSet:
    """FC1/FC2 weights of one width: the full layer or one localized shard, with their swizzled scale sizes.

    Scale tensors are kept as given (any accepted form); `w1_sf_bytes`/`w2_sf_bytes` read them as flat uint8, so
    storage-less placeholders are only touched when a path really reads them.
    """

    w1: torch.Tensor  # uint8 [E, N1, H/2]
    w1_sf: torch.Tensor  # swizzled scales of [E, N1, H/block]
    w2: torch.Tensor  # uint8 [E, H_out, I/2]
    w2_sf: torch.Tensor  # swizzled scales of [E, H_out, I/block]
    w1_sf_size: int
    w2_sf_size: int

    def w1_sf_bytes(self) -> torch.Tensor:
        return sf_bytes(self.w1_sf, self.w1_sf_size)

    def w2_sf_bytes(self) -> torch.Tensor:
        return sf_bytes(self.w2_sf, self.w2_sf_size)


@dataclass
class MoEProblem:
    quant_mode: str
    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    num_local_experts: int
    local_expert_offset: int
    top_k: int
    activation: Activation
    use_fused_finalize: bool
    output_dtype: torch.dtype
    x: torch.Tensor
    x_sf: torch.Tensor | None  # uint8 [T, H/block], linear
    token_selected_experts: torch.Tensor  # int32 [T, K]
    token_final_scales: torch.Tensor  # float32 [T, K]
    weights: WeightSet  # full width (may be storage-less when only shards are used)
    w1_alpha: torch.Tensor
    w2_alpha: torch.Tensor
    fc2_input_scale: torch.Tensor | None
    per_token_scale: torch.Tensor | None
    moe_output: torch.Tensor | None
    shards: list[WeightSet] | None = None
    localized_streams: list | None = None
    localized_sm_count: int | None = None
    localized_memset_stream: object | None = None
    localized_allow_nonlocalized: bool = False
    aux_stream: object | None = None  # where the fused finalize zeroes the output, overlapping GEMM1
    tile_size: int = 128  # routing tile of the reference path (rows per expert padded to it); the wrapper sets it
    enable_pdl: bool = True

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def sf_block(self) -> int:
        return sf_block(self.quant_mode)

    @property
    def n1(self) -> int:
        return 2 * self.intermediate_size if self.activation.gated else self.intermediate_size

    @property
    def kernel_mode(self) -> str:
        """The quant mode as the sm_90a kernels name it: w4a4 with per-token activation scales is `w4a4_pt`."""
        return self.quant_mode + ("_pt" if self.per_token_scale is not None else "")


def _tensor(name, t, *, dtypes, ndim=None, device=None, optional=False):
    if t is None:
        if optional:
            return None
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of x), got {t.device}")
    return t


def _shape(name, t, expected):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def _contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _int(name, v, *, minimum=None):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _bool(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def _weights(prefix, w1, w1_sf, w2, w2_sf, *, e, n1, h, h_out, i, block, sf_dtypes, device) -> WeightSet:
    w1 = _tensor(f"{prefix}w1_weight", w1, dtypes=(torch.uint8,), ndim=3, device=device)
    _shape(f"{prefix}w1_weight", w1, (e, n1, h // 2))
    _contiguous(f"{prefix}w1_weight", w1)
    w2 = _tensor(f"{prefix}w2_weight", w2, dtypes=(torch.uint8,), ndim=3, device=device)
    _shape(f"{prefix}w2_weight", w2, (e, h_out, i // 2))
    _contiguous(f"{prefix}w2_weight", w2)
    w1_sf = _tensor(f"{prefix}w1_weight_sf", w1_sf, dtypes=sf_dtypes, device=device)
    w2_sf = _tensor(f"{prefix}w2_weight_sf", w2_sf, dtypes=sf_dtypes, device=device)
    w1_size, w2_size = swizzled_size(e, n1, h // block), swizzled_size(e, h_out, i // block)
    check_sf_form(w1_sf, w1_size, f"{prefix}w1_weight_sf")
    check_sf_form(w2_sf, w2_size, f"{prefix}w2_weight_sf")
    return WeightSet(w1, w1_sf, w2, w2_sf, w1_size, w2_size)


def build_problem(
    x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale,
    w2_weight, w2_weight_sf, w2_alpha, num_experts, top_k, num_local_experts=None, local_expert_offset=0,
    output_dtype=torch.bfloat16, use_fused_finalize=True, moe_output=None, activation_type=3, swiglu_alpha=1.0,
    swiglu_beta=0.0, swiglu_limit=3.4028234663852886e38, situ_beta=None, situ_linear_beta=None, *,
    quant_mode="w4a4", per_token_scale=None, localized_weights=None, localized_streams=None,
    localized_sm_count=None, localized_memset_stream=None, localized_allow_nonlocalized=False,
) -> MoEProblem:
    quant_mode = canonical_quant_mode(quant_mode)
    activation = Activation.resolve(activation_type, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta,
                                    situ_linear_beta)
    if quant_mode == "w4a8" and activation.kind == "situ":
        raise ValueError("situ_beta (SiTU) is not supported with quant_mode='w4a8'")
    num_experts = _int("num_experts", num_experts, minimum=1)
    top_k = _int("top_k", top_k, minimum=1)
    e = num_experts if num_local_experts is None else _int("num_local_experts", num_local_experts, minimum=1)
    offset = _int("local_expert_offset", local_expert_offset, minimum=0)
    if offset + e > num_experts:
        raise ValueError(f"local_expert_offset + num_local_experts ({offset} + {e}) exceeds num_experts "
                         f"({num_experts})")
    _bool("use_fused_finalize", use_fused_finalize)
    _bool("localized_allow_nonlocalized", localized_allow_nonlocalized)
    if output_dtype != torch.bfloat16:
        raise ValueError(f"output_dtype must be torch.bfloat16 (the only output the kernels write), got {output_dtype}")

    # Activations fix T, H and the device.
    x_dtype = {"w4a4": torch.uint8, "w4a8": torch.float8_e4m3fn, "w4a16": torch.bfloat16}[quant_mode]
    x = _tensor("x", x, dtypes=(x_dtype,), ndim=2)
    _contiguous("x", x)
    device = x.device
    num_tokens = x.shape[0]
    hidden = x.shape[1] * 2 if quant_mode == "w4a4" else x.shape[1]
    block = sf_block(quant_mode)
    if hidden % 128:
        raise ValueError(f"hidden size must be a multiple of 128, got H={hidden} (from x of shape {tuple(x.shape)})")

    if quant_mode == "w4a16":
        if x_sf is not None:
            raise ValueError("x_sf must be None for quant_mode='w4a16' (x is bf16)")
    else:
        sf_dt = (torch.uint8, torch.float8_e4m3fn) if quant_mode == "w4a4" else (torch.uint8, torch.float8_e8m0fnu)
        x_sf = _tensor("x_sf", x_sf, dtypes=sf_dt, ndim=(2, 3), device=device)
        if tuple(x_sf.shape) not in ((num_tokens, hidden // block), (num_tokens, hidden // block, 1)):
            raise ValueError(f"x_sf must be linear scale factors of shape [T, H/{block}] = "
                             f"[{num_tokens}, {hidden // block}] (or with a trailing 1), got {tuple(x_sf.shape)}")
        _contiguous("x_sf", x_sf)
        x_sf = (x_sf if x_sf.dtype == torch.uint8 else x_sf.view(torch.uint8)).reshape(num_tokens, hidden // block)

    ids = _tensor("token_selected_experts", token_selected_experts, dtypes=(torch.int32, torch.int64), ndim=2,
                  device=device)
    if ids.shape[0] != num_tokens:
        raise ValueError(f"token_selected_experts must have {num_tokens} rows (tokens of x), got {ids.shape[0]}")
    if ids.shape[1] != top_k:
        raise ValueError(f"top_k ({top_k}) must equal token_selected_experts.shape[1] ({ids.shape[1]})")
    ids = ids.to(torch.int32).contiguous()
    scales = _tensor("token_final_scales", token_final_scales, dtypes=(torch.float32,), ndim=2, device=device)
    _shape("token_final_scales", scales, (num_tokens, top_k))
    scales = scales.contiguous()

    # Weights fix I; they must agree with H and E.
    w2_for_i = _tensor("w2_weight", w2_weight, dtypes=(torch.uint8,), ndim=3, device=device)
    inter = w2_for_i.shape[2] * 2
    if activation.gated and inter % 64:
        raise ValueError(f"intermediate size must be a multiple of 64 for gated activations, got I={inter}")
    if (not activation.gated or quant_mode == "w4a8") and inter % 128:
        raise ValueError(f"intermediate size must be a multiple of 128 for {activation.kind} / {quant_mode}, "
                         f"got I={inter}")
    n1 = 2 * inter if activation.gated else inter
    weight_sf_dt = (torch.uint8, torch.float8_e4m3fn) if block == 16 else (torch.uint8, torch.float8_e8m0fnu)
    weights = _weights("", w1_weight, w1_weight_sf, w2_weight, w2_weight_sf, e=e, n1=n1, h=hidden, h_out=hidden,
                       i=inter, block=block, sf_dtypes=weight_sf_dt, device=device)

    w1_alpha = _tensor("w1_alpha", w1_alpha, dtypes=(torch.float32,), ndim=1, device=device)
    _shape("w1_alpha", w1_alpha, (e,))
    w2_alpha = _tensor("w2_alpha", w2_alpha, dtypes=(torch.float32,), ndim=1, device=device)
    _shape("w2_alpha", w2_alpha, (e,))
    if quant_mode == "w4a4":
        fc2_input_scale = _tensor("fc2_input_scale", fc2_input_scale, dtypes=(torch.float32,), ndim=(0, 1),
                                  device=device)
        if fc2_input_scale.numel() != 1:
            raise ValueError(f"fc2_input_scale must hold one float32 value, got shape {tuple(fc2_input_scale.shape)}")
        fc2_input_scale = fc2_input_scale.reshape(1)
    elif fc2_input_scale is not None:
        raise ValueError(f"fc2_input_scale must be None for quant_mode='{quant_mode}'")

    if per_token_scale is not None:
        if quant_mode != "w4a4":
            raise ValueError(f"per_token_scale is only supported with quant_mode='w4a4', got '{quant_mode}'")
        per_token_scale = _tensor("per_token_scale", per_token_scale, dtypes=(torch.float32,), ndim=1,
                                  device=device)
        _shape("per_token_scale", per_token_scale, (num_tokens,))
        _contiguous("per_token_scale", per_token_scale)

    if moe_output is not None:
        moe_output = _tensor("moe_output", moe_output, dtypes=(output_dtype,), ndim=2, device=device)
        if moe_output.shape[0] < num_tokens or moe_output.shape[1] != hidden:
            raise ValueError(f"moe_output must have shape [>= {num_tokens}, {hidden}], got {tuple(moe_output.shape)}")
        _contiguous("moe_output", moe_output)

    problem = MoEProblem(
        quant_mode=quant_mode, num_tokens=num_tokens, hidden_size=hidden, intermediate_size=inter,
        num_experts=num_experts, num_local_experts=e, local_expert_offset=offset, top_k=top_k,
        activation=activation, use_fused_finalize=use_fused_finalize, output_dtype=output_dtype, x=x, x_sf=x_sf,
        token_selected_experts=ids, token_final_scales=scales, weights=weights, w1_alpha=w1_alpha,
        w2_alpha=w2_alpha, fc2_input_scale=fc2_input_scale, per_token_scale=per_token_scale, moe_output=moe_output,
        localized_allow_nonlocalized=localized_allow_nonlocalized,
    )
    if localized_weights is not None:
        _localized(problem, localized_weights, localized_streams, localized_sm_count, localized_memset_stream,
                   weight_sf_dt)
    else:
        for name, value in (("localized_streams", localized_streams), ("localized_sm_count", localized_sm_count),
                            ("localized_memset_stream", localized_memset_stream)):
            if value is not None:
                raise ValueError(f"{name} was given without localized_weights")
    return problem


def _localized(problem: MoEProblem, shards, streams, sm_count, memset_stream, sf_dtypes) -> None:
    if not isinstance(shards, (list, tuple)):
        raise TypeError(f"localized_weights must be a list of shard dicts, got {type(shards).__name__}")
    if len(shards) != 2:
        raise ValueError(f"localized_weights must hold exactly 2 equal-width shards, got {len(shards)}")
    inter, hidden = problem.intermediate_size, problem.hidden_size
    if inter % 128:
        raise ValueError(f"localized execution needs I to be a multiple of 128 (whole up/gate pairs per shard), "
                         f"got I={inter}")
    if hidden % 256:
        raise ValueError(f"localized execution needs H to be a multiple of 256, got H={hidden}")
    parsed = []
    for d, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise TypeError(f"localized_weights[{d}] must be a dict, got {type(shard).__name__}")
        missing = [k for k in LOCALIZED_KEYS if k not in shard]
        if missing or len(shard) != len(LOCALIZED_KEYS):
            raise ValueError(f"localized_weights[{d}] must have exactly the keys {LOCALIZED_KEYS}; "
                             f"missing {missing}, got {sorted(shard)}")
        parsed.append(_weights(f"localized_weights[{d}].", *(shard[k] for k in LOCALIZED_KEYS),
                               e=problem.num_local_experts, n1=problem.n1 // 2, h=hidden, h_out=hidden // 2,
                               i=inter, block=problem.sf_block, sf_dtypes=sf_dtypes, device=problem.device))
    if streams is not None:
        if not isinstance(streams, (list, tuple)) or len(streams) != len(shards):
            raise ValueError(f"localized_streams must be a list of {len(shards)} streams, one per shard")
        if problem.device.type == "cuda":
            for d, s in enumerate(streams):
                if not isinstance(s, torch.cuda.Stream):
                    raise TypeError(f"localized_streams[{d}] must be a torch.cuda.Stream, got {type(s).__name__}")
    if sm_count is not None:
        _int("localized_sm_count", sm_count, minimum=1)
    if memset_stream is not None and problem.device.type == "cuda" and not isinstance(memset_stream,
                                                                                     torch.cuda.Stream):
        raise TypeError("localized_memset_stream must be a torch.cuda.Stream")
    problem.shards = parsed
    problem.localized_streams = list(streams) if streams is not None else None
    problem.localized_sm_count = sm_count
    problem.localized_memset_stream = memset_stream
