"""Token slabs: the routed rows of the activations as the slab GEMM1s read them (a 128-K step of a routing tile's
rows is one bulk copy into their ring), in torch. The kernels' own writer is moe_ext/kernels/sm90/token_slabs.py;
this is the layout's definition, for the launcher's sizes, tests and benchmarks.

Routing tile m's step s is `tile` rows of RING_PITCH bytes at byte (m * steps + s) * tile * RING_PITCH. Row r holds
the step's 128 values of token permuted_to_expanded[m * tile + r] // top_k the way the streaming GEMMs' token tile
holds them (stream.py): 16-byte chunk c of 8 values at chunk_position(c), its values in the order (x0 x4)(x1 x5)(x2
x6)(x3 x7) of the decoded weight pairs, each times 2^63 (the scale split of the exact decode, stream.py).
"""
from __future__ import annotations

import torch

STEP = 128  # K values a step (stream.StreamConfig.k_step)
RING_PITCH = 272  # bytes of a slab row: a step's 256 and 16 that stagger the rows' shared-memory banks
TWO_P63 = 2.0 ** 63


def chunk_position(chunk):
    """Where 8-value chunk `chunk` of a step sits in a token row: bit 1 flips with bit 3, so the four threads of a
    quad (32 K apart) read different banks. Python or kernel integers."""
    return chunk ^ (((chunk >> 3) & 1) << 1)


def slab_bytes(rows: int, k: int) -> int:
    """Bytes of the token slabs of `rows` routed rows (whole routing tiles) and K = k."""
    return rows * (k // STEP) * RING_PITCH


def token_slabs(x_bf16: torch.Tensor, permuted_to_expanded: torch.Tensor, tile_to_mn_limit: torch.Tensor,
                num_live_tiles: int, tile: int, top_k: int) -> torch.Tensor:
    """The token slabs (as bytes) of the routed rows of the [T, K] bf16 activations; padding rows and bytes are
    zero."""
    t, k = x_bf16.shape
    steps, rows = k // STEP, permuted_to_expanded.numel()
    position = torch.tensor([chunk_position(c) for c in range(16)], device=x_bf16.device)
    ordered = (x_bf16.reshape(t, steps, 16, 2, 4).transpose(-1, -2)[:, :, position].reshape(t, steps, STEP).float()
               * TWO_P63).to(torch.bfloat16)
    out = torch.zeros(rows // tile, tile, steps, RING_PITCH // 2, dtype=torch.bfloat16, device=x_bf16.device)
    p = torch.arange(num_live_tiles * tile, device=x_bf16.device)
    live = p[p < tile_to_mn_limit.to(p.device)[p // tile]]
    tokens = permuted_to_expanded.to(p.device)[live].long() // top_k
    out.view(-1, steps, RING_PITCH // 2)[live, :, :STEP] = ordered[tokens]
    return out.transpose(1, 2).contiguous().reshape(-1).view(torch.uint8)
