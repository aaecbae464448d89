"""The 128x4 "MMA" scale-factor layout of semantics §1.4 and the forms in which callers hand it to us.

A scale matrix of R rows and S columns per expert is padded to m_tiles = ceil(R/128) row tiles and
k_tiles = ceil(S/4) column tiles; each 128x4 atom is a contiguous 512-byte block:

    off(e, r, c) = e*mt*kt*512 + (r//128)*kt*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4

Callers may pass the same bytes as FlashInfer's 6-D MMA view (shape (32, 4, mt, 4, kt, E)), as a flat tensor or
as any contiguous 2-D tensor, in uint8 or an 8-bit float dtype; `sf_bytes` turns each of them into flat uint8.
"""
from __future__ import annotations

import math

import torch

ATOM_ROWS = 128
ATOM_COLS = 4
ATOM_BYTES = ATOM_ROWS * ATOM_COLS
SF_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def sf_tiles(rows: int, cols: int) -> tuple[int, int]:
    """(m_tiles, k_tiles) of a [rows, cols] scale matrix."""
    return math.ceil(rows / ATOM_ROWS), math.ceil(cols / ATOM_COLS)


def swizzled_size(num_groups: int, rows: int, cols: int) -> int:
    m_tiles, k_tiles = sf_tiles(rows, cols)
    return num_groups * m_tiles * k_tiles * ATOM_BYTES


def swizzle_offsets(num_groups: int, rows: int, cols: int, device=None) -> torch.Tensor:
    """int64 [num_groups, rows, cols]: byte offset of each scale factor in the swizzled buffer."""
    m_tiles, k_tiles = sf_tiles(rows, cols)
    e = torch.arange(num_groups, device=device).view(-1, 1, 1)
    r = torch.arange(rows, device=device).view(1, -1, 1)
    c = torch.arange(cols, device=device).view(1, 1, -1)
    return (
        e * (m_tiles * k_tiles * ATOM_BYTES)
        + (r // 128) * (k_tiles * ATOM_BYTES)
        + (c // 4) * ATOM_BYTES
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + c % 4
    )


def swizzle_sf(sf: torch.Tensor) -> torch.Tensor:
    """Linear scale bytes [E, R, S] (or [R, S]) -> flat uint8 swizzled buffer with zeroed padding."""
    sf = _as_uint8(sf)
    grouped = sf if sf.dim() == 3 else sf.unsqueeze(0)
    num_groups, rows, cols = grouped.shape
    out = torch.zeros(swizzled_size(num_groups, rows, cols), dtype=torch.uint8, device=sf.device)
    out[swizzle_offsets(num_groups, rows, cols, sf.device).reshape(-1)] = grouped.reshape(-1)
    return out


def unswizzle_sf(buffer: torch.Tensor, num_groups: int, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_sf: any accepted form of the swizzled bytes -> linear uint8 [num_groups, rows, cols]."""
    flat = sf_bytes(buffer, swizzled_size(num_groups, rows, cols))
    return flat[swizzle_offsets(num_groups, rows, cols, flat.device)]


def mma_view(buffer: torch.Tensor, num_groups: int, rows: int, cols: int) -> torch.Tensor:
    """The non-contiguous 6-D view FlashInfer's `convert_sf_to_mma_layout` returns; shares storage with buffer."""
    m_tiles, k_tiles = sf_tiles(rows, cols)
    flat = sf_bytes(buffer, swizzled_size(num_groups, rows, cols))
    return torch.as_strided(
        flat,
        (32, 4, m_tiles, 4, k_tiles, num_groups),
        (16, 4, k_tiles * ATOM_BYTES, 1, ATOM_BYTES, m_tiles * k_tiles * ATOM_BYTES),
        flat.storage_offset(),
    )


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _is_mma_view(t: torch.Tensor, expected_bytes: int) -> bool:
    if t.dim() != 6 or t.shape[0] != 32 or t.shape[1] != 4 or t.shape[3] != 4:
        return False
    m_tiles, k_tiles = t.shape[2], t.shape[4]
    strides = (16, 4, k_tiles * ATOM_BYTES, 1, ATOM_BYTES, m_tiles * k_tiles * ATOM_BYTES)
    return t.stride() == strides and t.numel() == expected_bytes


def check_sf_form(t: torch.Tensor, expected_bytes: int, name: str) -> None:
    """Raise unless `t` is one of the accepted forms of `expected_bytes` swizzled scale bytes (metadata only)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SF_BYTE_DTYPES:
        raise TypeError(f"{name} must hold 8-bit scale bytes (uint8 or float8), got {t.dtype}")
    if _is_mma_view(t, expected_bytes) or (t.dim() in (1, 2) and t.is_contiguous() and t.numel() == expected_bytes):
        return
    raise ValueError(
        f"{name}: expected the 128x4-swizzled scale layout of {expected_bytes} bytes, as the 6-D MMA view or a "
        f"contiguous 1-D/2-D tensor; got shape {tuple(t.shape)} with strides {t.stride()}"
    )


def sf_bytes(t: torch.Tensor, expected_bytes: int, name: str = "scale factors") -> torch.Tensor:
    """Flat uint8 view of swizzled scale bytes given in any accepted form (no copy)."""
    check_sf_form(t, expected_bytes, name)
    if t.dim() == 6:
        return torch.as_strided(_as_uint8(t), (expected_bytes,), (1,), t.storage_offset())
    return _as_uint8(t).reshape(-1)
