"""The 64-row up/gate interleave of gated FC1 weights (semantics §1.5).

The logical FC1 weight of one expert is [up; gate], 2I rows. The kernels want every 128-row block j to hold
up rows 64j..64j+63 followed by gate rows 64j..64j+63, so block j produces intermediate columns 64j..64j+63.
"""
from __future__ import annotations

import torch

INTERLEAVE_ROWS = 64


def _check(rows: int) -> None:
    if rows % (2 * INTERLEAVE_ROWS):
        raise ValueError(f"gated FC1 needs 2I to be a multiple of {2 * INTERLEAVE_ROWS} rows, got 2I={rows}")


def interleave_up_gate(w: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """[..., 2I, ...] with rows [up; gate] along `dim` -> the interleaved physical row order."""
    dim = dim % w.dim()
    rows = w.shape[dim]
    _check(rows)
    half, groups = rows // 2, rows // (2 * INTERLEAVE_ROWS)
    up, gate = w.narrow(dim, 0, half), w.narrow(dim, half, half)
    shape = w.shape[:dim] + (groups, INTERLEAVE_ROWS) + w.shape[dim + 1:]
    stacked = torch.stack((up.reshape(shape), gate.reshape(shape)), dim=dim + 1)
    return stacked.reshape(w.shape).contiguous()


def deinterleave_up_gate(w: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Inverse of interleave_up_gate: interleaved rows -> [up; gate]."""
    dim = dim % w.dim()
    rows = w.shape[dim]
    _check(rows)
    groups = rows // (2 * INTERLEAVE_ROWS)
    paired = w.reshape(w.shape[:dim] + (groups, 2, INTERLEAVE_ROWS) + w.shape[dim + 1:])
    up = paired.select(dim + 1, 0).reshape(w.shape[:dim] + (rows // 2,) + w.shape[dim + 1:])
    gate = paired.select(dim + 1, 1).reshape(w.shape[:dim] + (rows // 2,) + w.shape[dim + 1:])
    return torch.cat((up, gate), dim=dim)


def split_up_gate(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved GEMM1 output columns [..., 2I] -> (up [..., I], gate [..., I])."""
    up_gate = deinterleave_up_gate(acc, dim=-1)
    half = acc.shape[-1] // 2
    return up_gate[..., :half], up_gate[..., half:]
