"""Python side of the C++ launcher: device checks on torch tensors, then raw pointers to `moe_ext._C`.

The compiled kernels check nothing, and `_C` checks sizes and alignment; dtype, device and contiguity are
checked here, where the tensors are still torch tensors. Launches go to the current torch stream.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .activation import LOG2E
from .plan import ROLES
from .quant.swizzle import swizzled_size
from .routing import Routing, expected_experts_hit, expected_tile_fill, expected_tiles, max_num_tiles
from .slabs import slab_bytes


@functools.lru_cache(maxsize=None)
def _module():
    try:
        from . import _C
    except ImportError:
        return None
    return _C


def has_kernel(name: str) -> bool:
    return name in _linked_kernels()


def hopper_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


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


@functools.lru_cache(maxsize=None)
def _linked_kernels() -> frozenset:
    module = _module()
    return frozenset(module.kernels()) if module is not None and hasattr(module, "kernels") else frozenset()


class PerCall(NamedTuple):
    """A flat view of a tensor that changes every call (activations, routing, router weights): launch() records
    its position by role, so a recorded forward (moe_ext/plan.py) patches exactly these buffers."""

    role: str
    tensor: torch.Tensor


PER_CALL = frozenset(ROLES)


class Launch(NamedTuple):
    """One recorded kernel launch: buffers as (pointer, numel), the positions of per-call buffers by role, and the
    side stream it went to (None: the caller's current stream, whichever that is when replayed)."""

    name: str
    buffers: list
    scalars: list
    pdl: bool
    roles: tuple
    stream: object = None


class Memset(NamedTuple):
    """One recorded cudaMemsetAsync to zero (the fused finalize's output)."""

    ptr: int
    nbytes: int
    stream: object = None


class Call(NamedTuple):
    """One recorded host step between launches (an event fork or join), re-run as is."""

    fn: object


# While a ForwardPlan is recorded: the Launch, Memset and Call steps of the forward, in order.
_recorder: list | None = None
_side_stream = None  # the stream launches go to inside on_side_stream()


@contextlib.contextmanager
def recording():
    """Collect the steps made inside (moe_ext.plan builds a replayable forward from them)."""
    global _recorder
    previous, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = previous


@contextlib.contextmanager
def on_side_stream(stream):
    """Launch on `stream` (a shard's or the aux stream) instead of the caller's."""
    global _side_stream
    previous, _side_stream = _side_stream, stream
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        _side_stream = previous


def call(fn) -> None:
    """Run a host step of the forward now and, while recording, keep it for replays."""
    fn()
    if _recorder is not None:
        _recorder.append(Call(fn))


def launch(name: str, tensors: list, scalars: list[float], enable_pdl: bool, device: torch.device) -> None:
    """Launch exported kernel `name` on the current stream; tensors (flat views, or PerCall) in its declaration
    order."""
    module = _module()
    if module is None or not hasattr(module, "launch"):
        raise RuntimeError("moe_ext._C was built without the sm_90a kernels")
    buffers, roles = [], []
    for t in tensors:
        if isinstance(t, PerCall):
            roles.append((len(buffers), t.role))
            t = t.tensor
        buffers.append((t.data_ptr(), t.numel()))
    values = [float(v) for v in scalars]
    module.launch(name, buffers, values, bool(enable_pdl), torch.cuda.current_stream(device).cuda_stream)
    if _recorder is not None:
        _recorder.append(Launch(name, buffers, values, bool(enable_pdl), tuple(roles), _side_stream))


def memset_async(t: torch.Tensor, stream) -> None:
    """Zero `t` with cudaMemsetAsync on `stream` (None: the current one): a memset node, not a kernel, in a
    graph."""
    step = Memset(t.data_ptr(), t.numel() * t.element_size(), stream)
    _module().memset_async(step.ptr, step.nbytes, (stream or torch.cuda.current_stream(t.device)).cuda_stream)
    if _recorder is not None:
        _recorder.append(step)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, numel: int | None = None,
           align: int = 4) -> torch.Tensor:
    """Flat view of a contiguous tensor after the checks the compiled kernels cannot do."""
    if t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} tensor on {device}, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned")
    return PerCall(name, t.reshape(-1)) if name in PER_CALL else t.reshape(-1)


INT32_MAX = 2 ** 31 - 1


def _weight_view(t: torch.Tensor) -> torch.Tensor:
    """The flat weight as the kernels take it. Their tensor extents are int32, so a weight of more than 2^31
    bytes is handed over as its first 2^31 - 1 bytes: the kernels never read the extent (the GEMMs' TMA
    descriptors take their extents from the expert count and the shape, stream.expert_weight_view)."""
    return t if t.numel() <= INT32_MAX else t[:INT32_MAX]


def route(token_selected_experts: torch.Tensor, num_local_experts: int, local_expert_offset: int,
          out: Routing, enable_pdl: bool = True, decode: tuple | None = None, k_permuted: bool = False) -> Routing:
    """Fill `out` (sized by allocate_routing or a workspace) with the routing maps, on the current stream.
    decode = (format, x, x_sf, x_out): the same launch also decodes the NVFP4 / MXFP8 activations, or copies bf16
    ones (format "bf16"), checked flat views, into the bf16 x_out for GEMM1, in the wgmma GEMMs' K order where
    `k_permuted` (moe_ext/kernels/sm90/routing.py)."""
    ids = token_selected_experts
    device = ids.device
    if ids.dtype != torch.int32 or ids.dim() != 2 or device.type != "cuda":
        raise ValueError("token_selected_experts must be a contiguous [T, K] int32 CUDA tensor")
    if out.expanded_to_permuted.shape != ids.shape:
        raise ValueError(f"routing buffers are for {tuple(out.expanded_to_permuted.shape)} slots, ids are "
                         f"{tuple(ids.shape)}")
    if not 1 <= num_local_experts <= 2048:
        raise ValueError(f"num_experts must be in [1, 2048] for the routing kernel, got {num_local_experts}")
    i32 = torch.int32
    tiles = out.tile_to_expert.numel()
    tensors = [
        _check("token_selected_experts", ids, i32, device),
        _check("expert_counts", out.expert_counts, i32, device, num_local_experts),
        _check("expert_offsets", out.expert_offsets, i32, device, num_local_experts + 1),
        _check("expanded_to_permuted", out.expanded_to_permuted, i32, device, ids.numel()),
        _check("permuted_to_expanded", out.permuted_to_expanded, i32, device, tiles * out.tile_size),
        _check("tile_to_expert", out.tile_to_expert, i32, device),
        _check("tile_to_mn_limit", out.tile_to_mn_limit, i32, device, tiles),
        _check("num_live_tiles", out.num_live_tiles, i32, device, 1),
    ]
    name = "moe_routing"
    scalars = [num_local_experts, local_expert_offset, out.tile_size]
    if decode is not None:
        name = f"moe_routing_decode_{decode[0]}"
        tensors += list(decode[1:])
        scalars.append(int(k_permuted))
    launch(name, tensors, scalars, enable_pdl, device)
    return out

ACTIVATION_KIND = {"swiglu": 0, "situ": 1, "geglu_tanh": 2, "relu2": 3}
# Routing tiles (tokens per CTA) the GEMM kernels are compiled for: moe_ext/kernels/sm90/stream.py TOKEN_TILES.
TOKEN_TILES = (8, 16, 32, 64, 128)


def mode_kernels(mode: str) -> list:
    """The kernels every forward of this kernel mode launches besides its GEMMs: in the quantized modes the routing
    launch that also decodes x to bf16, and in w4a4_pt the per-token FC2 quantizer (both GEMM families read bf16)."""
    extra = ["moe_routing"] if mode == "w4a16" else [f"moe_routing_decode_{X_FORMAT[mode]}"]
    return extra + (["moe_fc2_quant_per_token"] if mode == "w4a4_pt" else [])


@functools.lru_cache(maxsize=None)
def streaming_tiles(mode: str, kind: str) -> tuple:
    """The routing tiles with both streaming GEMM kernels linked for this mode (with `_pt`) and activation kind
    (none without the mode's other kernels)."""
    if not all(has_kernel(name) for name in mode_kernels(mode)):
        return ()
    return tuple(t for t in TOKEN_TILES
                 if has_kernel(gemm1_kernel(mode, kind, t, 1)) and has_kernel(gemm2_kernel(mode, t, 1)))


def token_tiles(mode: str, kind: str) -> tuple:
    """Every routing tile a forward of this mode and activation can take: the streaming ones, then the tiles only
    the wgmma GEMMs run (PADDED_WGMMA_TILE where offered, WIDE_WGMMA_TILE)."""
    return _token_tiles(mode, kind, OFFER_PADDED_WGMMA_TILE)


@functools.lru_cache(maxsize=None)
def _token_tiles(mode: str, kind: str, padded: bool) -> tuple:
    wgmma_only = [t for t in ((PADDED_WGMMA_TILE,) if padded else ()) + (WIDE_WGMMA_TILE,)
                  if has_wgmma(mode, kind) and has_kernel(gemm1_kernel(mode, kind, t, WGMMA))
                  and has_kernel(gemm2_kernel(mode, t, WGMMA))]
    return streaming_tiles(mode, kind) + tuple(wgmma_only)


K_SPLITS = (1, 2, 4)  # CTAs of a cluster that share one GEMM tile's K steps (cluster split-K)
# The "split" of a GEMM that selects its warp-specialised wgmma kernel (gemm1_wgmma.py, gemm2_wgmma.py):
# 128-token tiles, bf16 operands, no K split. Both GEMMs take wgmma or neither does: the wgmma GEMMs read their
# token operands in their own K order (x from the routing launch, the FC2 input from the wgmma GEMM1).
WGMMA = 0
WGMMA_TILE = 128
# 32- and 64-token routing tiles run the wgmma GEMMs too, both GEMMs, as (tile, WGMMA or WGMMA_WIDE, WGMMA or
# WGMMA_WIDE): one m64n32 / m64n64 wgmma block a tile, for experts of fewer rows than a 128-token tile would pad to.
NARROW_WGMMA_TILES = (32, 64)
WGMMA_MIN_ROWS = 32  # expected rows per local expert from which the default tactic takes the wgmma GEMMs
NARROW_WGMMA_MIN_ROWS = {32: 12, 64: WGMMA_MIN_ROWS}  # ... on each narrow tile (below: the streaming GEMMs)
# 256-row routing tiles run only the wgmma GEMMs (both): each decoded weight stage feeds two 128-token blocks, for
# experts with 512+ rows on average (wgmma_mainloop.TOKEN_BLOCK).
WIDE_WGMMA_TILE = 256
WIDE_TILE_MIN_ROWS = 512
# 144-row routing tiles run only the wgmma GEMMs (both; GEMM2 also with 256-row weight tiles, GEMM1 with 128-row
# ones only): one m64n144 block, for experts that average a little under 128 rows, whose 128-row tiles leave about
# half of them a second, mostly padding, tile (wgmma_mainloop.PADDED_TILE). Offered (tactics, workspaces) under
# OFFER_PADDED_WGMMA_TILE: on since session 38 ran tests/test_hopper_kernels.py (335 passed) on its build.
PADDED_WGMMA_TILE = 144
OFFER_PADDED_WGMMA_TILE = True
# The default tactic takes the 144-row tile where GEMM2 keeps its 256-row weight tiles on it and its tiles multiply
# fewer rows than 128-row ones by this factor (routing.expected_tile_fill; it gives up GEMM1's 256-row weight tiles).
# Session 38, T=4096, whole forwards against the default (128, WGMMA_WIDE, WGMMA_WIDE): DeepSeek-V3 (fill 0.68 ->
# 0.83) 1.04x and its EP8 shard 1.08x as (144, WGMMA, WGMMA_WIDE); gpt-oss-120b, whose GEMM2 rows (2944) take no
# 256-row tiles, 0.99x as (144, WGMMA, WGMMA); at ~256 rows an expert (Qwen3-30B-A3B T=4096: fill 0.81 -> 0.88)
# 0.96x; Mixtral-8x7B (1024 rows) 0.91-0.93x.
PADDED_TILE_MIN_GAIN = 1.15
# The "split" of a GEMM that selects its wgmma kernel with 256-row weight tiles (32- to 128-token routing tiles): two
# weight halves share each gathered token stage, halving the token rows a CTA reads per MMA. The GEMM's weight rows
# (of one launch) must be a multiple of 256.
WGMMA_WIDE = -1
WIDE_WEIGHT_ROWS = 256
# The "split" of a GEMM that selects its streaming kernel's three-CTAs-an-SM form, no K split (8- and 32-token
# tiles, stream.config_for): it pays where a launch's CTAs fill three an SM, and loses where a few hundred run.
THREE_CTAS = -2
# The "split" (both GEMMs) that runs the whole forward as one cooperative launch: routing, GEMM1, GEMM2 and the fused
# finalize (moe_ext/kernels/sm90/decode_fused.py), for w4a16 / w4a4 / w4a8 layers with fused finalize and T * top_k <=
# DECODE_MAX_PAIRS, on 8-token routing tiles.
FUSED_DECODE = -3
DECODE_TILE = 8
DECODE_MODES = ("w4a16", "w4a4", "w4a8")  # decode_fused.MODES (kernel modes: w4a4 with per-token scales is not one)
DECODE_MAX_PAIRS = 64  # decode_fused.MAX_PAIRS
DECODE_SPLITS = 8  # decode_fused.MAX_SPLITS: GEMM1 partial tiles a weight tile may leave in the workspace
DECODE_CTAS_PER_SM = 2  # decode_fused.CONFIG.ctas_per_sm: the cooperative grid
DECODE_GEMM2_MIN_STEPS = 4  # decode_fused.GEMM2_MIN_STEPS: 128-K steps of a GEMM2 K range at least
DECODE_READINESS_WORD = 4  # decode_fused.READINESS_WORD: the count buffer's first row tile word
# Whether FUSED_DECODE may take the form that splits GEMM2's K (decode_fused's split_gemm2) where
# decode_splits_gemm2 says so. On since session 38 (tests/test_fused_decode.py passed on its build; graph replays of
# the heuristic's tactic: DeepSeek-V3 EP8 T=1 26.5-26.8 µs, gpt-oss-120b T=1 40.7-41.2, against 31.0 and 45.5 for
# the unsplit kernel in session 36).
DECODE_SPLIT_GEMM2 = True
# Whether FUSED_DECODE may take the forms whose GEMM1 epilogues build the bf16 FC2 input and whose token stagings
# issue their loads ahead of the weight copies (decode_fused's fc2_by_gemm1), where decode_fc2_by_gemm1 says so.
# Session 39 (H100, graph replays, two rounds, against the forms that build the FC2 input in GEMM2's staging): 1-3 µs
# faster at Qwen3-30B-A3B T = 2 / 4, DeepSeek-V3 EP8 T = 2 / 4 / 8 and gpt-oss-120b T = 1 / 2, 2.4 µs slower at
# Qwen3 T=1 and 0.35 slower at EP8 T=1, where GEMM1's items are short K ranges that each pay the ranges' meeting.
# Session 40 (H100, each form forced by `moe_ext.bench --decode-form`, two rounds, five shapes, T = 1-8): the rule
# picks the faster form at every point where they differ (DeepSeek-V3 T=1 90.7 -> 87.9 µs with this form).
DECODE_FC2_BY_GEMM1 = True
# 128-K steps of GEMM1's expected K ranges up to which FUSED_DECODE keeps the other forms where the ranges split
# (decode_fc2_by_gemm1): the two measured losses above had 8 and 7, the wins 14 and more or no split.
DECODE_FC2_MIN_RANGE_STEPS = 9
# Whether FUSED_DECODE may take the unsplit fc2_by_gemm1 form's deep-ring variant (decode_fused.DEEP_CONFIG: a
# 6-stage ring, DECODE_DEEP_RING_STAGES) where decode_deep_ring says so, and from how many GEMM1 weight tiles an SM
# (expected: routing.expected_tiles on 8-token tiles x n1 / 128). H100 graph replays, two rounds, against the 4-stage
# form (h100_session44_checks.md): Qwen3-30B-A3B T = 4 / 8 (2.6 / 4.7 tiles an SM) 44.9 -> 44.0 / 73.55 -> 71.05 µs,
# DeepSeek-V3 T = 2 / 4 / 8 (3.8 / 7.4 / 13.9) 0.6 / 0.85 / 1.65% faster, Mixtral T = 4 / 8 (9.3 / 12.2) 0.6 /
# 1.0%; slower at Qwen3 T=2 (1.4: +0.35 µs) and DeepSeek-V3 EP8 T=4 (0.9: +1.85), level at EP8 T=8 (1.7). Only the
# SwiGLU object is built (the kind these shapes, gpt-oss-120b's too, run). Session 45 (h100_session45_checks.md):
# gpt-oss-120b T = 2 / 4 / 8 / 16 1.5 / 0.3 / 1.7 / 3.6% faster, Mixtral T = 2-16 level to 1.0%.
DECODE_DEEP_RING = True
DECODE_DEEP_RING_STAGES = 6  # decode_fused.DEEP_CONFIG.stages
DECODE_DEEP_RING_TILES_PER_SM = 2.0
# The GEMM2 "split" that selects the 16-token w4a16 GEMM2's persistent form (moe_gemm2_w4a16_t16_persistent,
# kernels/sm90/persistent.py: 396 CTAs, three an SM of 132, take the (routing tile, 128-row weight tile) items by
# stride, the weight ring running on from one item into the next; no K split). Offered to the tuner only: against
# the unsplit GEMM2 on one H100 (h100_session48_checks.md) GEMM2 ran 1.04x faster at DeepSeek-V3 T=256 and
# gpt-oss-120b T=256 and 0.90x / 0.93x at Qwen3-30B-A3B T=64 and DeepSeek-V3 EP8 T=256 (whole forwards 1.013x,
# 1.002x, 0.975x, 0.98x).
PERSISTENT = -4
PERSISTENT_TILE = 16
# Whether the untuned heuristic may pick FUSED_DECODE (default_tactic's `fused_decode`): on since session 35 ran
# tests/test_fused_decode.py on the fixed build (h200_session35_checks.md).
DEFAULT_FUSED_DECODE = True
# GEMM1 weight tiles an SM (expected: 8-token routing tiles, routing.expected_tiles, x n1 / 128) up to which the
# default takes FUSED_DECODE, unless GEMM2's few long items would idle its grid (default_tactic's
# `decode_gemm2_idle`). Fitted at 18 on an H100 in sessions 43-44 (the one-launch forward 1.02-1.28x at 3.4-17.4
# tiles an SM, 0.84x at 19.1). The token slabs (sessions 50-51) then made the chain 1.02-1.14x faster, and 7 is
# where the tuner's w4a16 picks split since. On the H100 (h100_session54_quant_decode_t*.json) it kept FUSED_DECODE
# at 0.5-5.9 tiles an SM (Mixtral T=2, DeepSeek-V3 T=2, Qwen3 T = 2-8, EP8 T = 2 / 4) and took a chain at 7.4+
# (DeepSeek-V3 T = 4 / 8, Mixtral T = 4 / 8 / 16; gpt-oss-120b already from 2.7). On the H200 (session56_checks.md)
# the tuned chain beat the one-launch forward at T=8 on every shape: 1.11-1.22x at 10-13.9 tiles an SM (gpt-oss-120b,
# Mixtral, DeepSeek-V3), and 1.05x / 1.15x at 1.7 / 4.7 (DeepSeek-V3 EP8, Qwen3), which 7 still leaves on FUSED_DECODE.
FUSED_DECODE_TILES_PER_SM = 7
# GEMM1 CTAs an SM (expected, on 8-token tiles) from which the default tactic takes 16-token tiles instead: with its
# ring unrolled the 16-token mainloop (three CTAs an SM) beat the 8-token default by 1.02-1.06x at T = 8-64 on five
# shapes (5.8-62 CTAs an SM: the tactic table and replay A/Bs, h200_session31_checks.md). Below (T = 1, EP8 T=8:
# 0.4-3.4) the table was mixed, the best 16-token tactic 0.94-1.03x of the 8-token default, and replays are pending.
SIXTEEN_OVER_EIGHT_WAVES = 4
THREE_CTA_TILES = (8, 32)  # moe_ext/kernels/sm90/stream.py THREE_CTA_TILES
# Routing tiles whose streaming GEMM1 reads token slabs (moe_ext/kernels/sm90/gemm1.py SLAB_TILES; every mode but
# w4a4_pt): a gather launch (moe_token_slabs) writes each routed row's x into them after the routing launch. They
# take 2.125 bytes a routed row and hidden value (DeepSeek-V3: 1 GB at T=8192), so the tactics that read them are
# offered up to SLAB_MAX_TOKENS tokens, the limit a workspace sizes them for (a tuner bucket edge,
# tuning.token_bucket; DeepSeek-V3: ~120 MB). The tuner took 16-token streaming tiles up to T=256 on the H200 and
# 32- to 128-token wgmma ones beyond (h200.json), which stay offered.
SLAB_TILES = (16, 32)
SLAB_MAX_TOKENS = 512


SLAB_GATHER = "moe_token_slabs"
# The name part of a GEMM2 that reads the FC2 input as token slabs (its GEMM1s store them so: no launch more). The
# persistent GEMM2 stages row-major rows, so it is built for w4a4_pt alone, whose per-token quantizer reads them so.
FC2_SLABS = "_slabs"


def reads_slabs(mode: str, tile: int, split1: int) -> bool:
    """Whether this GEMM1 (kernel mode, routing tile, GEMM1 split) is a slab GEMM1: a streaming form on SLAB_TILES
    of a build that links the gather. build.py builds the gather exactly where it builds the slab GEMM1s, so a build
    without it (an older one, the base of an A/B) runs its staging GEMM1s on these tiles."""
    return mode != "w4a4_pt" and _slab_form(tile, split1) and has_kernel(SLAB_GATHER)


def _slab_form(tile: int, split: int) -> bool:
    """A streaming form (a K split or THREE_CTAS) on SLAB_TILES: the forms built to read token slabs."""
    return tile in SLAB_TILES and split in K_SPLITS + (THREE_CTAS,)


def slab_rows(mode: str, tile: int, split1: int, rows: int) -> int:
    """The routed rows whose token slabs a forward's buffers hold: all `rows` for a slab GEMM1, else none."""
    return rows if reads_slabs(mode, tile, split1) else 0


def slab_elements(rows: int, hidden: int) -> int:
    """bf16 elements of the token slabs of `rows` routed rows (whole routing tiles)."""
    return slab_bytes(rows, hidden) // 2


# The GEMM2 each kernel mode runs: w4a4's FC2 input arrives decoded and its weights are NVFP4, as w4a16's.
_GEMM2_MODE = {"w4a4": "w4a16"}
X_FORMAT = {"w4a4": "nvfp4", "w4a4_pt": "nvfp4", "w4a8": "mxfp8"}


def is_wgmma(split: int) -> bool:
    return split in (WGMMA, WGMMA_WIDE)


def _kernel_suffix(split: int) -> str:
    return {WGMMA: "_wgmma", WGMMA_WIDE: f"_wgmma_n{WIDE_WEIGHT_ROWS}", THREE_CTAS: "_3cta",
            PERSISTENT: "_persistent"}.get(split, "")


def gemm1_kernel(mode: str, kind: str, tile: int, split: int) -> str:
    return f"moe_gemm1_{mode}_{kind}_t{tile}" + _kernel_suffix(split)


def gemm2_kernel(mode: str, tile: int, split: int) -> str:
    """The linked GEMM2 of this form: on SLAB_TILES' streaming forms the slab one (FC2_SLABS) where the build has
    it."""
    name = f"moe_gemm2_{_GEMM2_MODE.get(mode, mode)}_t{tile}"
    if _slab_form(tile, split) and has_kernel(name + FC2_SLABS + _kernel_suffix(split)):
        name += FC2_SLABS
    return name + _kernel_suffix(split)


def fc2_slabs(mode: str, tile: int) -> bool:
    """Whether the FC2 input of this mode's `tile`-token streaming forward is token slabs (moe_ext/slabs.py, K = I):
    where the build links slab GEMM2s, which build.py builds with the GEMM1s that store them (gemm2.reads_slabs)."""
    return FC2_SLABS in gemm2_kernel(mode, tile, 1)


def wide_weights(mode: str, kind: str, n1: int, hidden: int) -> tuple[bool, bool]:
    """Whether GEMM1 (n1 weight rows a launch) and GEMM2 (hidden rows) can take WGMMA_WIDE: the wgmma forward and
    the GEMM's 256-row kernel linked (on the narrow wgmma tiles too, where those are linked, and for GEMM2 on the
    padded tile, where its GEMM2 is linked: GEMM1 has no 256-row form there), and its weight rows a multiple of
    256."""
    tiles = (WGMMA_TILE,) + narrow_wgmma_tiles(mode, kind)
    padded = (PADDED_WGMMA_TILE,) if has_kernel(gemm2_kernel(mode, PADDED_WGMMA_TILE, WGMMA)) else ()
    linked = has_wgmma(mode, kind)
    return (linked and n1 % WIDE_WEIGHT_ROWS == 0
            and all(has_kernel(gemm1_kernel(mode, kind, t, WGMMA_WIDE)) for t in tiles),
            linked and hidden % WIDE_WEIGHT_ROWS == 0
            and all(has_kernel(gemm2_kernel(mode, t, WGMMA_WIDE)) for t in tiles + padded))


def kernel_forms(mode: str, kind: str, n1: int, hidden: int) -> dict:
    """What the linked kernels of this kernel mode and activation offer GEMMs of n1 (GEMM1) and hidden (GEMM2)
    weight rows a launch: the keyword arguments of tactics() beyond the tiles, and of default_tactic() but
    `persistent` (a form only the tuner takes)."""
    return dict(wgmma=has_wgmma(mode, kind), wide=wide_weights(mode, kind, n1, hidden),
                three_ctas=has_three_ctas(mode, kind), narrow_wgmma=narrow_wgmma_tiles(mode, kind),
                persistent=has_kernel(gemm2_kernel(mode, PERSISTENT_TILE, PERSISTENT)))


@functools.lru_cache(maxsize=None)
def has_three_ctas(mode: str, kind: str) -> bool:
    """Whether both GEMMs' three-CTA streaming kernels (THREE_CTAS) are linked for this mode and activation."""
    return all(has_kernel(gemm1_kernel(mode, kind, t, THREE_CTAS)) and has_kernel(gemm2_kernel(mode, t, THREE_CTAS))
               for t in THREE_CTA_TILES)


@functools.lru_cache(maxsize=None)
def has_wgmma(mode: str, kind: str) -> bool:
    """Whether the wgmma forward of this kernel mode and activation is linked: both wgmma GEMMs and the 128-token
    tile's other kernels (streaming_tiles, which also asks for the mode's routing launch and quantizer; w4a16 also
    needs the routing launch that copies x into the wgmma K order)."""
    return (WGMMA_TILE in streaming_tiles(mode, kind) and has_kernel(gemm1_kernel(mode, kind, WGMMA_TILE, WGMMA))
            and has_kernel(gemm2_kernel(mode, WGMMA_TILE, WGMMA))
            and (mode != "w4a16" or has_kernel("moe_routing_decode_bf16")))


@functools.lru_cache(maxsize=None)
def narrow_wgmma_tiles(mode: str, kind: str) -> tuple:
    """The NARROW_WGMMA_TILES whose wgmma forward is linked (both GEMMs, the tile's streaming kernels, and the
    128-token wgmma forward)."""
    if not has_wgmma(mode, kind):
        return ()
    return tuple(t for t in NARROW_WGMMA_TILES if t in streaming_tiles(mode, kind)
                 and has_kernel(gemm1_kernel(mode, kind, t, WGMMA)) and has_kernel(gemm2_kernel(mode, t, WGMMA)))


def tactics(tiles: tuple, wgmma: bool = False, wide: tuple = (False, False), three_ctas: bool = False,
            narrow_wgmma: tuple = (), persistent: bool = False) -> list[tuple]:
    """Hopper tactics: (routing tile, GEMM1 K split or WGMMA, GEMM2 K split or WGMMA); WGMMA on both GEMMs or neither. A
    tile outside TOKEN_TILES (WIDE_WGMMA_TILE, PADDED_WGMMA_TILE) runs only as (tile, WGMMA, WGMMA), the padded one also
    as (tile, WGMMA, WGMMA_WIDE) where `wide` allows. `wide` (wide_weights): the GEMMs that may take WGMMA_WIDE on
    128-token tiles. `three_ctas` (has_three_ctas): on THREE_CTA_TILES, either GEMM may take
    THREE_CTAS in place of a K split. `narrow_wgmma` (narrow_wgmma_tiles): these streaming tiles also run both GEMMs on
    wgmma kernels (either of them WGMMA_WIDE where `wide` allows). `persistent`: on PERSISTENT_TILE, GEMM2 may take
    PERSISTENT beside any GEMM1 split."""

    def forms(t: int) -> tuple:
        return K_SPLITS + (THREE_CTAS,) if three_ctas and t in THREE_CTA_TILES else K_SPLITS

    out = [(t, s1, s2) for t in tiles if t in TOKEN_TILES for s1 in forms(t) for s2 in forms(t)]
    if persistent and PERSISTENT_TILE in tiles:
        out += [(PERSISTENT_TILE, s1, PERSISTENT) for s1 in K_SPLITS]
    if wgmma and WGMMA_TILE in tiles:
        out.append((WGMMA_TILE, WGMMA, WGMMA))
    firsts = (WGMMA, WGMMA_WIDE) if wide[0] else (WGMMA,)
    seconds = (WGMMA, WGMMA_WIDE) if wide[1] else (WGMMA,)
    if wgmma and WGMMA_TILE in tiles:
        out += [(WGMMA_TILE, s1, s2) for s1 in firsts for s2 in seconds if WGMMA_WIDE in (s1, s2)]
    if wgmma:
        out += [(t, s1, s2) for t in narrow_wgmma if t in tiles for s1 in firsts for s2 in seconds]
        out += [(t, WGMMA, WGMMA) for t in tiles if t not in TOKEN_TILES]
        out += [(t, WGMMA, WGMMA_WIDE) for t in tiles if t == PADDED_WGMMA_TILE and wide[1]]
    return out


def decode_gemm1_tiles(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int, n1: int) -> float:
    """GEMM1's expected 128-row weight tiles in the one-launch decode: its 8-token routing tiles
    (routing.expected_tiles) x n1 / 128. FUSED_DECODE_TILES_PER_SM and DECODE_DEEP_RING_TILES_PER_SM are measured
    in it."""
    return expected_tiles(num_tokens, top_k, num_experts, num_local_experts, DECODE_TILE) * n1 / 128


def default_tactic(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int, n1: int, hidden: int,
                   tiles: tuple, num_sms: int, wgmma: bool = False, wide: tuple = (False, False),
                   three_ctas: bool = False, narrow_wgmma: tuple = (), fused_decode: bool = False,
                   decode_gemm2_idle: bool = False) -> tuple:
    """The heuristic for untuned shapes.

    Tile: up to 64, the smallest with room for twice an expert's average rows. Decode streams an expert's weights
    once per tile, routing is uneven, and small tiles keep padding rows out of the MMAs: at 8 rows on average
    16-token tiles were 1.29-1.40x faster than 8-token ones, at 16 rows 32-token tiles 1.9x, at 2 rows 8-token
    tiles 1.06-1.07x faster than 16 (GEMMs alone, benchmarks/results/h200_session8_checks.md §4). Beyond, the
    largest tile an expert's rows fill: fewer tiles re-read each expert, and a 128-token tile halves the weight
    decode per MMA (measured 1.2-1.36x over 64 at T=4096, benchmarks/results/h200_tile128_profile.md).
    K split: the CTAs one GEMM would launch (expected live tiles under uniform routing x N / 128) are doubled by
    splitting K across a cluster while they still fit one per SM, so a decode step with few experts hit still
    streams from every SM.
    With the wgmma kernels linked, every shape whose experts average WGMMA_MIN_ROWS+ rows takes them on 128-token tiles
    (both GEMMs, unless either would split K: then both stream): session 4 measured them 1.16-1.61x faster than the best
    streaming tile at 16-64 rows per expert (benchmarks/results/h200_session4_checks.md); since the streaming kernels'
    three-CTA forms, the tuner keeps 16-token streaming tiles at 16 rows (Qwen3 T=256, Mixtral T=64: Mixtral's wgmma
    default 589 µs against 474) and wgmma from 32 (h200.json, sessions 16-17). Where both GEMMs run wgmma on 128-token
    tiles, each GEMM whose weight rows allow it (`wide`, wide_weights) takes 256-row weight tiles: at T = 4096 (128-256
    rows per expert) 1.04-1.14x faster on GEMM1 and 1.03-1.13x on GEMM2 than 128-row ones
    (benchmarks/results/h200_session14_checks.md §2). Where experts average 32-63 rows and the 64-token wgmma GEMMs are
    linked (`narrow_wgmma`), both GEMMs take them instead, in the widest weight tiles allowed: one m64n64 block where a
    128-token tile multiplies a padding half; at 32 rows (T=1024 on DeepSeek-V3, its EP8 shard and gpt-oss-120b)
    1.17-1.29x faster kernels, at 64 (Qwen3 T=1024, Mixtral T=256) 0.78-0.91x. Where they average 12-31 rows
    (NARROW_WGMMA_MIN_ROWS), the 32-token wgmma tiles, in the widest weight tiles allowed: at 12-24 rows 1.06-1.60x
    faster kernels than the streaming default, at 8 rows (gpt-oss T=256) 0.96x (h200_session25_checks.md; slower
    than streaming before the wgmma token K order, session 23).
    Where the 144-row tile is offered (OFFER_PADDED_WGMMA_TILE), GEMM2's rows take 256-row weight tiles and 144-row
    tiles would multiply PADDED_TILE_MIN_GAIN fewer rows than 128-row ones (routing.expected_tile_fill: experts
    averaging a little under 128 rows), it takes (144, WGMMA, WGMMA_WIDE): DeepSeek-V3 T=4096 1.04x, its EP8 shard
    1.08x (h200_session38_checks.md).
    An 8-token tile whose GEMM1 would launch SIXTEEN_OVER_EIGHT_WAVES+ CTAs an SM takes 16 tokens instead.
    On a THREE_CTA_TILES tile (`three_ctas`), an unsplit GEMM whose expected CTAs fill three an SM takes THREE_CTAS:
    GEMM1 1.06-1.21x and GEMM2 1.27-1.80x there; at 256 CTAs it was 0.76-0.96x (h200_session17_checks.md).
    Where the one-launch forward can run (`fused_decode`: fits_fused_decode) and GEMM1's expected weight tiles
    (routing.expected_tiles on 8-token tiles x n1 / 128) fit one an SM (so its K splits at least in two across the
    two-CTA grid), it takes FUSED_DECODE: Qwen3-30B-A3B T=1 1.36x, DeepSeek-V3 EP8 T = 1 / 2 / 4 1.25 / 1.74 /
    1.68x in graph replays (h200_session35_checks.md); and up to
    FUSED_DECODE_TILES_PER_SM (7) tiles an SM where GEMM2's expected items do not leave the grid idle
    (`decode_gemm2_idle`: decode_splits_gemm2 would split them and the split form is not taken; gpt-oss-120b T=1,
    4 experts x 23 hidden tiles of 23 K steps, ran 0.90x unsplit). The backend asks for it only under
    DEFAULT_FUSED_DECODE.
    """
    if fused_decode and num_tokens * top_k <= DECODE_MAX_PAIRS:
        tiles1 = decode_gemm1_tiles(num_tokens, top_k, num_experts, num_local_experts, n1)
        if tiles1 <= num_sms or (tiles1 <= FUSED_DECODE_TILES_PER_SM * num_sms and not decode_gemm2_idle):
            return (DECODE_TILE, FUSED_DECODE, FUSED_DECODE)
    local_slots = num_tokens * top_k * num_local_experts / max(1, num_experts)
    per_expert = local_slots / max(1, num_local_experts)
    streaming = [t for t in tiles if t in TOKEN_TILES]
    roomy = [t for t in streaming if t >= 2 * per_expert]
    tile = min(roomy) if roomy and min(roomy) <= 64 else max(t for t in streaming if t <= max(64, per_expert))
    if wgmma and per_expert >= WGMMA_MIN_ROWS:
        tile = WGMMA_TILE
    if wgmma and WIDE_WGMMA_TILE in tiles and per_expert >= WIDE_TILE_MIN_ROWS:
        return (WIDE_WGMMA_TILE, WGMMA, WGMMA)
    fitting = [t for t in narrow_wgmma if t in tiles and per_expert < t]
    if wgmma and fitting and per_expert >= NARROW_WGMMA_MIN_ROWS[min(fitting)]:
        return (min(fitting), *(WGMMA_WIDE if w else WGMMA for w in wide))
    if wgmma and tile == WGMMA_TILE and PADDED_WGMMA_TILE in tiles and wide[1] and (
            expected_tile_fill(num_tokens, top_k, num_experts, PADDED_WGMMA_TILE)
            >= PADDED_TILE_MIN_GAIN * expected_tile_fill(num_tokens, top_k, num_experts, WGMMA_TILE)):
        return (PADDED_WGMMA_TILE, WGMMA, WGMMA_WIDE)
    # Live tiles: the expected experts hit with 50% margin (a split that overshoots one wave costs more than one
    # that undershoots gains), never more than the slots that can be local.
    hit = expected_experts_hit(num_tokens, top_k, num_experts, num_local_experts)
    live = max(min(1.5 * hit, num_tokens * top_k, num_local_experts), math.ceil(local_slots / tile))
    if tile == 8 and 16 in tiles and live * n1 / 128 >= SIXTEEN_OVER_EIGHT_WAVES * num_sms:
        tile = 16  # live already counts 8-token tiles, at least as many as 16-token ones

    def split(rows: int) -> int:
        ctas = max(1.0, live * rows / 128)
        if three_ctas and tile in THREE_CTA_TILES and ctas >= 3 * num_sms:
            return THREE_CTAS
        return max(s for s in K_SPLITS if s == 1 or ctas * s <= num_sms)

    splits = (split(n1), split(hidden))
    if wgmma and tile == WGMMA_TILE and splits == (1, 1):
        splits = tuple(WGMMA_WIDE if w else WGMMA for w in wide)
    return (tile, *splits)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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


@dataclass
class KernelBuffers:
    """Scratch of one kernel forward, flat: the activations as GEMM1 reads them (bf16: decoded in the quantized
    modes, in the wgmma K order for the wgmma GEMMs), the FC2 input (bf16; in the quantized modes its quantization
    decoded), per-row FC2 scales (per-token mode) and the per-slot expert outputs the finalize kernel combines."""

    x_decoded: torch.Tensor
    token_slabs: torch.Tensor  # the slab GEMM1's routed rows of x (reads_slabs; moe_token_slabs writes them)
    intermediate_bf16: torch.Tensor
    row_scale: torch.Tensor
    slot_output: torch.Tensor
    decode_partials: torch.Tensor  # FUSED_DECODE's K ranges' partial tiles (fp32): GEMM1's, then GEMM2's
    # FUSED_DECODE's counts (decode_count_words): zeroed once, left consistent by every launch
    decode_counts: torch.Tensor

    @staticmethod
    def sizes(quant_mode: str, rows: int, inter: int, tokens: int, top_k: int, hidden: int,
              wgmma: bool = True, slab_rows: int = 0) -> dict:
        """Element counts of each buffer (0 where the mode does not use it). `wgmma`: whether the forward may run
        the wgmma GEMMs (w4a16 then copies x into their K order; its streaming forward reads x itself).
        `slab_rows`: the routed rows a slab GEMM1 may read (reads_slabs), 0 where none runs."""
        return dict(
            x_decoded=tokens * hidden if quant_mode != "w4a16" or wgmma else 0,
            token_slabs=slab_elements(slab_rows, hidden),
            intermediate_bf16=slab_elements(rows, inter),  # either layout fits (fc2_slabs: 17/16 of row-major)
            row_scale=rows if quant_mode == "w4a4" else 0,
            slot_output=tokens * top_k * hidden,
            decode_partials=decode_partial_floats(min(tokens * top_k, DECODE_MAX_PAIRS), 2 * inter, hidden)
            if quant_mode in DECODE_MODES else 0,
            decode_counts=decode_count_words(min(tokens * top_k, DECODE_MAX_PAIRS), 2 * inter, hidden),
        )

    @classmethod
    def allocate(cls, quant_mode: str, rows: int, inter: int, tokens: int, top_k: int, hidden: int,
                 device, wgmma: bool = True, slab_rows: int = 0) -> "KernelBuffers":
        dtypes = dict(x_decoded=torch.bfloat16, token_slabs=torch.bfloat16, intermediate_bf16=torch.bfloat16,
                      row_scale=torch.float32, slot_output=torch.bfloat16, decode_partials=torch.float32,
                      decode_counts=torch.int32)
        sizes = cls.sizes(quant_mode, rows, inter, tokens, top_k, hidden, wgmma, slab_rows)
        return cls(**{name: (torch.zeros if name == "decode_counts" else torch.empty)(max(n, 1), dtype=dtypes[name],
                                                                                     device=device)
                      for name, n in sizes.items()})

    def view(self, quant_mode: str, rows: int, inter: int, tokens: int, top_k: int, hidden: int,
             wgmma: bool = True, slab_rows: int = 0) -> "KernelBuffers":
        """The leading parts needed for a smaller problem (workspace buffers sized for the capacity)."""
        sizes = self.sizes(quant_mode, rows, inter, tokens, top_k, hidden, wgmma, slab_rows)
        return KernelBuffers(**{name: getattr(self, name)[:max(n, 1)] for name, n in sizes.items()})


@functools.lru_cache(maxsize=None)
def _dummies(device: torch.device) -> dict:
    """One-element stand-ins for the tensors a mode's kernel takes but does not read."""
    return {dtype: torch.zeros(4, dtype=dtype, device=device)
            for dtype in (torch.bfloat16, torch.uint8, torch.float32)}


def _scale_or_dummy(name: str, t: torch.Tensor | None, device: torch.device, numel: int) -> torch.Tensor:
    """A float32 scale only some modes have (fc2_input_scale, per_token_scale): checked, or the stand-in."""
    return _dummies(device)[torch.float32] if t is None else _check(name, t, torch.float32, device, numel)


def decode_kernel(kind: str, split_gemm2: bool = False, fc2_by_gemm1: bool = False, deep_ring: bool = False,
                  mode: str = "w4a16") -> str:
    return (f"moe_decode_{mode}_{kind}" + ("_split2" if split_gemm2 else "") + ("_fc2" if fc2_by_gemm1 else "")
            + (f"_ring{DECODE_DEEP_RING_STAGES}" if deep_ring else ""))


def decode_partial_floats(pairs: int, n1: int, hidden: int) -> int:
    """FUSED_DECODE's fp32 workspace for `pairs` rows: GEMM1's DECODE_SPLITS K ranges of n1 columns, then GEMM2's
    of `hidden` (decode_fused.gemm2_partial), then the bf16 FC2 input (decode_fused.fc2_input_address; n1 // 2
    floats a row hold the inter bf16 values of gated and ungated activations alike)."""
    return DECODE_SPLITS * pairs * (n1 + hidden) + pairs * n1 // 2


def decode_count_words(pairs: int, n1: int, hidden: int) -> int:
    """FUSED_DECODE's u32 counts (decode_fused.READINESS_WORD and what follows it): the zeroing's (4 words), one a
    row tile of any launch (DECODE_MAX_PAIRS: each flips once a launch, so a buffer shared by launches of other
    sizes keeps them in step), then an arrival count a GEMM1 item (row tile, 128 weight rows) and one a GEMM2 item
    (row tile, 128 hidden rows) of the split form; at most `pairs` row tiles."""
    return DECODE_READINESS_WORD + DECODE_MAX_PAIRS + pairs * (-(-n1 // 128) + -(-hidden // 128))


def decode_splits(ctas: int, items: int, steps: int, min_steps: int) -> int:
    """decode_fused.splits on the host: the K ranges a weight tile of `steps` 128-K steps takes when `items` items
    share a grid of `ctas` CTAs, each range at least `min_steps` steps, at most DECODE_SPLITS."""
    return max(1, min(max(1, ctas // max(1, items)), DECODE_SPLITS, steps // min_steps))


def decode_splits_gemm2(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int, hidden: int,
                        inter: int, ctas: int) -> bool:
    """Whether FUSED_DECODE takes the kernel form that also splits GEMM2's K (decode_fused.make_kernel's
    split_gemm2): where, with a tile an expected expert hit, GEMM2's items (tile, 128 hidden rows) leave room for
    two K ranges each in the grid and its K holds two ranges of DECODE_GEMM2_MIN_STEPS (decode_fused.splits
    decides the ranges in the kernel from the real tiles). Session 36's first build, one kernel deciding at run
    time, against the unsplit kernel (graph replays, h200_session36_checks.md): DeepSeek-V3 EP8 T=1 31.1 -> 26.5 µs
    (56 items of 16 K steps), T=2 1.04x, gpt-oss-120b T=1 1.12x, Mixtral T=1 / 2 1.67x / 1.24x; Qwen3-30B-A3B T=1
    (2 ranges of 3 steps) 0.93x, and 0.97-0.99x wherever GEMM2 did not split: hence a form of its own."""
    hit = max(1.0, expected_experts_hit(num_tokens, top_k, num_experts, num_local_experts))
    return decode_splits(ctas, math.ceil(hit * (hidden // 128)), inter // 128, DECODE_GEMM2_MIN_STEPS) >= 2


def offers_fused_decode(mode: str, kind: str, fused_finalize: bool, localized: bool, tiles: tuple) -> bool:
    """Whether a layer can run FUSED_DECODE at small enough T: w4a16, w4a4 or w4a8 (not w4a4 with per-token scales)
    with fused finalize, no localized shards, the 8-token routing tile among `tiles` and the kernel linked (the
    quantized modes' in its fc2_by_gemm1 form, their only one)."""
    return (mode in DECODE_MODES and fused_finalize and not localized and DECODE_TILE in tiles
            and has_kernel(decode_kernel(kind, fc2_by_gemm1=mode != "w4a16", mode=mode)))


def fits_fused_decode(problem) -> bool:
    """Whether FUSED_DECODE can run this problem: offers_fused_decode, and at most DECODE_MAX_PAIRS (token, expert)
    pairs."""
    kind = problem.activation.kind
    return (offers_fused_decode(problem.kernel_mode, kind, problem.use_fused_finalize, problem.shards is not None,
                                token_tiles(problem.kernel_mode, kind))
            and 0 < problem.num_tokens * problem.top_k <= DECODE_MAX_PAIRS)


def _decode_gemm2_wants_split(problem) -> bool:
    """decode_splits_gemm2 for this problem on the cooperative grid of its device."""
    return decode_splits_gemm2(problem.num_tokens, problem.top_k, problem.num_experts, problem.num_local_experts,
                               problem.hidden_size, problem.intermediate_size,
                               DECODE_CTAS_PER_SM * num_sms(problem.device))


def _decode_split_form_taken(kind: str, mode: str) -> bool:
    """Whether FUSED_DECODE may take the split_gemm2 form: DECODE_SPLIT_GEMM2 on and the form linked (the
    quantized modes': its fc2_by_gemm1 form)."""
    return DECODE_SPLIT_GEMM2 and has_kernel(decode_kernel(kind, True, mode != "w4a16", mode=mode))


def decode_gemm1_ranges(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int, hidden: int,
                       n1: int, ctas: int) -> int:
    """The K ranges decode_fused.splits gives each GEMM1 weight tile, with one routing tile an expected expert hit."""
    tiles = math.ceil(max(1.0, expected_experts_hit(num_tokens, top_k, num_experts, num_local_experts)) - 1e-9)
    return decode_splits(ctas, tiles * (n1 // 128), hidden // 128, 2)


def decode_fc2_by_gemm1(problem) -> bool:
    """Whether FUSED_DECODE takes an fc2_by_gemm1 form (DECODE_FC2_BY_GEMM1): everywhere but where GEMM1's weight
    tiles split into K ranges of fewer than DECODE_FC2_MIN_RANGE_STEPS steps, whose meeting in the epilogue (an
    arrival and a sum, ~1.7 µs) outweighs what GEMM2's staging saves."""
    ranges = decode_gemm1_ranges(problem.num_tokens, problem.top_k, problem.num_experts, problem.num_local_experts,
                                 problem.hidden_size, problem.n1, DECODE_CTAS_PER_SM * num_sms(problem.device))
    return DECODE_FC2_BY_GEMM1 and (ranges == 1 or problem.hidden_size // 128 // ranges >= DECODE_FC2_MIN_RANGE_STEPS)


def decode_kernel_for(problem) -> str:
    """The FUSED_DECODE kernel form `problem` launches: the one that splits GEMM2's K where DECODE_SPLIT_GEMM2 allows
    it, decode_splits_gemm2 expects it to pay and it is linked, else the unsplit one; in its fc2_by_gemm1 form
    where decode_fc2_by_gemm1 says so and that is linked; the unsplit fc2 form on its deep ring where
    decode_deep_ring says so and that is linked. The quantized modes have the fc2_by_gemm1 forms only."""
    kind, mode = problem.activation.kind, problem.kernel_mode
    split = _decode_split_form_taken(kind, mode) and _decode_gemm2_wants_split(problem)
    fc2 = mode != "w4a16" or (decode_fc2_by_gemm1(problem)
                              and has_kernel(decode_kernel(kind, split, fc2_by_gemm1=True)))
    deep = (fc2 and not split and decode_deep_ring(problem)
            and has_kernel(decode_kernel(kind, fc2_by_gemm1=True, deep_ring=True, mode=mode)))
    return decode_kernel(kind, split, fc2, deep, mode)


def decode_deep_ring(problem) -> bool:
    """Whether the unsplit fc2_by_gemm1 form takes its deep-ring variant (DECODE_DEEP_RING): where GEMM1's expected
    weight tiles reach DECODE_DEEP_RING_TILES_PER_SM an SM, so CTAs stream several items back to back and the ring's
    depth, not an item's first landing (later under a deeper burst), sets the pace."""
    tiles1 = decode_gemm1_tiles(problem.num_tokens, problem.top_k, problem.num_experts, problem.num_local_experts,
                                problem.n1)
    return DECODE_DEEP_RING and tiles1 >= DECODE_DEEP_RING_TILES_PER_SM * num_sms(problem.device)


def decode_gemm2_idle(problem) -> bool:
    """Whether FUSED_DECODE would run GEMM2's few long items unsplit (decode_splits_gemm2 says they idle the grid,
    but the split form is off or not linked): default_tactic then takes it only where GEMM1 fits one tile an SM."""
    return _decode_gemm2_wants_split(problem) and not _decode_split_form_taken(problem.activation.kind,
                                                                               problem.kernel_mode)


def decode_forward(problem, buffers: KernelBuffers, out: torch.Tensor, enable_pdl: bool) -> torch.Tensor:
    """The whole forward as one cooperative launch (FUSED_DECODE; moe_ext/kernels/sm90/decode_fused.py): no
    routing maps, no memset node; the kernel zeroes `out` itself before its fused finalize adds into it."""
    if not fits_fused_decode(problem):
        raise ValueError(f"FUSED_DECODE runs {'/'.join(DECODE_MODES)} layers with fused finalize, no localized "
                         f"shards and at most {DECODE_MAX_PAIRS} (token, expert) pairs; got {problem.kernel_mode}, "
                         f"fused finalize {problem.use_fused_finalize}, T * top_k = "
                         f"{problem.num_tokens * problem.top_k}")
    device = problem.device
    T, K, H, I, E = (problem.num_tokens, problem.top_k, problem.hidden_size, problem.intermediate_size,
                     problem.num_local_experts)
    n1 = problem.n1
    u8, i32, f32, bf16 = torch.uint8, torch.int32, torch.float32, torch.bfloat16
    w = problem.weights
    partials = decode_partial_floats(T * K, n1, H)
    arrivals = decode_count_words(T * K, n1, H)
    block = problem.sf_block
    dummy = _dummies(device)
    if problem.quant_mode == "w4a16":
        x = [_check("x", problem.x, bf16, device, T * H, 16), dummy[u8]]
    else:  # the codes and their linear scales, which GEMM1's staging decodes
        x = [_check("x", problem.x.view(u8), u8, device, T * H // (2 if problem.quant_mode == "w4a4" else 1), 16),
             _check("x_sf", problem.x_sf, u8, device, T * H // block)]
    fc2_scale = _scale_or_dummy("fc2_input_scale", problem.fc2_input_scale, device, 1)
    launch(decode_kernel_for(problem), [
        *x,
        _check("token_selected_experts", problem.token_selected_experts, i32, device, T * K),
        _check("token_final_scales", problem.token_final_scales, f32, device, T * K),
        _weight_view(_check("w1_weight", w.w1, u8, device, E * n1 * H // 2, 16)),
        _check("w1_weight_sf", w.w1_sf_bytes(), u8, device, swizzled_size(E, n1, H // block), 16),
        _check("w1_alpha", problem.w1_alpha, f32, device, E),
        _weight_view(_check("w2_weight", w.w2, u8, device, E * H * I // 2, 16)),
        _check("w2_weight_sf", w.w2_sf_bytes(), u8, device, swizzled_size(E, H, I // block), 16),
        _check("w2_alpha", problem.w2_alpha, f32, device, E),
        fc2_scale,
        _check("moe_output", out, bf16, device, T * H, 16),
        _check("decode_partials", buffers.decode_partials[:partials], f32, device, partials, 16),
        _check("decode_counts", buffers.decode_counts[:arrivals], i32, device, arrivals),
    ], [H, I, n1, K, E, problem.local_expert_offset, *activation_params(problem.activation),
        DECODE_CTAS_PER_SM * num_sms(device)], enable_pdl, device)
    return out


def forward(problem, routing: Routing, buffers: KernelBuffers, out: torch.Tensor, enable_pdl: bool,
            k_splits: tuple = (1, 1), aux=None, shard_streams=None) -> torch.Tensor:
    """routing -> GEMM1 (-> per-token FC2 quantize) -> GEMM2 (-> finalize) on the current stream; every grid
    depends on T only, so the sequence can be captured in a CUDA graph once and replayed for any routing.

    k_splits: the cluster K split of GEMM1 and GEMM2 (K_SPLITS, THREE_CTAS, GEMM2's PERSISTENT, or WGMMA /
    WGMMA_WIDE for the wgmma kernels). In w4a4 / w4a8 the routing launch also decodes x to bf16 and GEMM1 stores the
    FC2 input's quantization decoded, so both GEMMs of either family read bf16. Fused finalize:
    `out` is zeroed (on the `aux` ForkJoin's stream, overlapping GEMM1, or in order on the current stream without
    one) and GEMM2 adds each router-weighted row into it; deterministic: GEMM2 writes per-slot rows and the
    finalize kernel sums them. Localized shards (problem.shards): FC1 of each shard writes its half of the
    intermediate columns, FC2 of each its half of the output columns, on the `shard_streams` ForkJoin's streams
    (or one after the other)."""
    device = problem.device
    T, K, H, I, E = (problem.num_tokens, problem.top_k, problem.hidden_size, problem.intermediate_size,
                     problem.num_local_experts)
    if H % 128 or I % 128:
        raise ValueError(f"the sm_90a kernels need H % 128 == 0 and I % 128 == 0 (H={H}, I={I})")
    mode = problem.kernel_mode
    block = problem.sf_block
    fused = problem.use_fused_finalize
    if FUSED_DECODE in k_splits:
        if k_splits != (FUSED_DECODE, FUSED_DECODE) or routing.tile_size != DECODE_TILE:
            raise ValueError(f"k_splits {k_splits}: FUSED_DECODE runs both GEMMs on {DECODE_TILE}-token tiles")
        return decode_forward(problem, buffers, out, enable_pdl)
    wgmma = is_wgmma(k_splits[0])
    if wgmma != is_wgmma(k_splits[1]):  # the wgmma GEMMs' token operands are in their K order (routing.py)
        raise ValueError(f"k_splits {k_splits}: both GEMMs run the wgmma kernels or neither does")
    wgmma_only = [(WGMMA, WGMMA)] + ([(WGMMA, WGMMA_WIDE)] if routing.tile_size == PADDED_WGMMA_TILE else [])
    if routing.tile_size not in TOKEN_TILES and k_splits not in wgmma_only:
        raise ValueError(f"k_splits {k_splits}: a {routing.tile_size}-token routing tile runs only the wgmma "
                         f"kernels, {' or '.join(map(str, wgmma_only))}")
    wide_tiles = NARROW_WGMMA_TILES + (WGMMA_TILE, PADDED_WGMMA_TILE)  # the padded one: GEMM2 only, above
    if WGMMA_WIDE in k_splits and routing.tile_size not in wide_tiles:
        raise ValueError(f"k_splits {k_splits}: WGMMA_WIDE runs on {wide_tiles}-token routing tiles, not "
                         f"{routing.tile_size}")
    if THREE_CTAS in k_splits and routing.tile_size not in THREE_CTA_TILES:
        raise ValueError(f"k_splits {k_splits}: THREE_CTAS runs on {THREE_CTA_TILES}-token routing tiles, not "
                         f"{routing.tile_size}")
    if PERSISTENT in k_splits and (k_splits[0] == PERSISTENT or routing.tile_size != PERSISTENT_TILE):
        raise ValueError(f"k_splits {k_splits}: PERSISTENT runs GEMM2 on {PERSISTENT_TILE}-token routing tiles")
    u8, i32, f32, bf16 = torch.uint8, torch.int32, torch.float32, torch.bfloat16
    dummy = _dummies(device)
    rows = routing.permuted_to_expanded.numel()
    slabs = reads_slabs(mode, routing.tile_size, k_splits[0])
    if slabs and T > SLAB_MAX_TOKENS:
        raise ValueError(f"k_splits {k_splits}: the {routing.tile_size}-token GEMM1 reads token slabs, offered up to "
                         f"{SLAB_MAX_TOKENS} tokens, not {T}")
    sizes = KernelBuffers.sizes(problem.quant_mode, rows, I, T, K, H, wgmma,
                                slab_rows(mode, routing.tile_size, k_splits[0], rows))
    buf = {name: _check(name, getattr(buffers, name)[:n], getattr(buffers, name).dtype, device, n, 16) if n
           else dummy[getattr(buffers, name).dtype] for name, n in sizes.items()}
    decode = None
    if problem.quant_mode == "w4a16" and wgmma:  # the routing launch copies x into the wgmma K order
        x_bf16 = buf["x_decoded"]
        decode = ("bf16", _check("x", problem.x.view(u8), u8, device, T * H * 2, 16), dummy[u8], x_bf16)
    elif problem.quant_mode == "w4a16":
        x_bf16 = _check("x", problem.x, bf16, device, T * H, 16)
    else:  # the routing launch decodes x, once, for GEMM1
        x_q = _check("x", problem.x.view(u8), u8, device, T * H // (2 if problem.quant_mode == "w4a4" else 1), 16)
        x_bf16 = buf["x_decoded"]
        decode = (X_FORMAT[mode], x_q, _check("x_sf", problem.x_sf, u8, device, T * H // block), x_bf16)
    route(problem.token_selected_experts, E, problem.local_expert_offset, routing, enable_pdl, decode=decode,
          k_permuted=wgmma)
    maps = [routing.permuted_to_expanded, routing.tile_to_expert, routing.tile_to_mn_limit, routing.num_live_tiles]
    if slabs:  # GEMM1 reads the routed rows' token slabs (its x argument)
        launch(SLAB_GATHER, [x_bf16, routing.permuted_to_expanded, routing.tile_to_mn_limit,
                                   routing.num_live_tiles, buf["token_slabs"]], [H, K, routing.tile_size],
               enable_pdl, device)
        x_bf16 = buf["token_slabs"]
    fc2_scale = _scale_or_dummy("fc2_input_scale", problem.fc2_input_scale, device, 1)
    pts = _scale_or_dummy("per_token_scale", problem.per_token_scale, device, T)
    scales = _check("token_final_scales", problem.token_final_scales, f32, device, T * K)
    out_flat = _check("moe_output", out, bf16, device, T * H, 16)
    w1_alpha = _check("w1_alpha", problem.w1_alpha, f32, device, E)
    w2_alpha = _check("w2_alpha", problem.w2_alpha, f32, device, E)
    tile = routing.tile_size
    parts = problem.shards if problem.shards is not None else [problem.weights]
    n1, h_part = problem.n1 // len(parts), H // len(parts)  # weight rows of each part's FC1 and FC2
    inter_part = I // len(parts)
    for split, rows, what in ((k_splits[0], n1, "W1 rows"), (k_splits[1], h_part, "W2 rows (hidden)")):
        if split == WGMMA_WIDE and rows % WIDE_WEIGHT_ROWS:
            raise ValueError(f"k_splits {k_splits}: WGMMA_WIDE needs the GEMM's {what} a multiple of "
                             f"{WIDE_WEIGHT_ROWS}, got {rows}")
    act = activation_params(problem.activation)

    def gemm1(d: int) -> None:
        w = parts[d]
        launch(gemm1_kernel(mode, problem.activation.kind, tile, k_splits[0]), [
            x_bf16, pts,
            _weight_view(_check("w1_weight", w.w1, u8, device, E * n1 * H // 2, 16)),
            _check("w1_weight_sf", w.w1_sf_bytes(), u8, device, swizzled_size(E, n1, H // block), 16),
            w1_alpha, *maps, buf["intermediate_bf16"], fc2_scale,
        ], [H, n1, I, d * inter_part, K, *act, max(1, k_splits[0])], enable_pdl, device)

    def gemm2(d: int) -> None:
        w = parts[d]
        launch(gemm2_kernel(mode, tile, k_splits[1]), [
            buf["intermediate_bf16"], buf["row_scale"],
            _weight_view(_check("w2_weight", w.w2, u8, device, E * h_part * I // 2, 16)),
            _check("w2_weight_sf", w.w2_sf_bytes(), u8, device, swizzled_size(E, h_part, I // block), 16),
            w2_alpha, scales, *maps, out_flat if fused else buf["slot_output"],
        ], [h_part, I, H, d * h_part, K, fused, max(1, k_splits[1])], enable_pdl, device)

    def on_parts(kernel) -> None:
        if shard_streams is None or len(parts) == 1:
            for d in range(len(parts)):
                kernel(d)
            return
        call(shard_streams.fork)
        for d, stream in enumerate(shard_streams.streams):
            with on_side_stream(stream):
                kernel(d)
        call(shard_streams.join)

    if fused:  # zero the output while GEMM1 runs
        if aux is None:
            memset_async(out_flat, None)
        else:
            call(aux.fork)
            memset_async(out_flat, aux.streams[0])
    on_parts(gemm1)
    if mode == "w4a4_pt":  # GEMM2 reads the quantization decoded, in place of h
        launch("moe_fc2_quant_per_token", [buf["intermediate_bf16"], routing.permuted_to_expanded, fc2_scale,
                                           buf["row_scale"]], [I, int(wgmma)], enable_pdl, device)
    if fused and aux is not None:
        call(aux.join)
    on_parts(gemm2)
    if not fused:
        launch("moe_finalize", [
            buf["slot_output"], _check("expanded_to_permuted", routing.expanded_to_permuted, i32, device, T * K),
            scales, out_flat,
        ], [H, K], enable_pdl, device)
    return out
