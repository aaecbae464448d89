"""Routing maps of a forward (semantics §5.1): which permuted row each (token, slot) pair occupies.

Each local expert's rows are contiguous and padded to a multiple of `tile_size`; slots whose expert id is outside
[offset, offset + num_local_experts) get no row. Buffer sizes depend only on T, K, E and the tile, so the same
maps serve any routing, and the torch code below needs no host synchronisation.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


def max_num_tiles(num_tokens: int, top_k: int, num_local_experts: int, tile_size: int) -> int:
    """Upper bound on the tiles any routing of T*K slots over E experts can fill (FlashInfer's formula)."""
    slots = num_tokens * top_k
    if slots <= num_local_experts:
        return slots
    return (slots + (tile_size - 1) * num_local_experts) // tile_size


def expected_experts_hit(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int) -> float:
    """Mean local experts a random routing hits: with i.i.d. router logits each expert is in a token's top-k with
    probability k/E, independently across tokens (sizing decisions made before any routing exists)."""
    return num_local_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@functools.lru_cache(maxsize=1024)
def expected_tile_fill(num_tokens: int, top_k: int, num_experts: int, tile: int) -> float:
    """Routed rows over the rows a random routing's tiles multiply (each expert's rows padded to a multiple of
    `tile`). An expert's rows are Binomial(T, k/E) under i.i.d. router logits; the pmf is summed over mean +- 12 sigma,
    walking out from its mode by the ratio of neighbouring terms (default_tactic asks on eager forwards: one lgamma
    term, then a multiply a term, and a cache for the token counts seen)."""
    p = min(1.0, top_k / num_experts)
    mean = num_tokens * p
    if mean == 0 or p == 1.0:
        return 1.0 if mean == 0 else mean / (math.ceil(mean / tile) * tile)
    sigma = math.sqrt(mean * (1.0 - p))
    lo, hi = max(0, int(mean - 12 * sigma)), min(num_tokens, int(mean + 12 * sigma) + 1)
    mode = min(max(int((num_tokens + 1) * p), lo), hi)
    odds = p / (1.0 - p)
    w_mode = math.exp(math.lgamma(num_tokens + 1) - math.lgamma(mode + 1) - math.lgamma(num_tokens - mode + 1)
                      + mode * math.log(p) + (num_tokens - mode) * math.log1p(-p))
    padded = mass = 0.0
    w = w_mode
    for rows in range(mode, hi + 1):  # pmf(x + 1) = pmf(x) (T - x) / (x + 1) p / (1 - p)
        mass += w
        padded += w * math.ceil(rows / tile) * tile
        w *= (num_tokens - rows) / (rows + 1) * odds
    w = w_mode
    for rows in range(mode - 1, lo - 1, -1):
        w *= (rows + 1) / (num_tokens - rows) / odds
        mass += w
        padded += w * math.ceil(rows / tile) * tile
    return mean * mass / padded


def expected_tiles(num_tokens: int, top_k: int, num_experts: int, num_local_experts: int, tile: int) -> float:
    """Mean `tile`-row routing tiles of the local experts under a random routing: each expert's Binomial(T, k/E)
    rows padded to whole tiles (expected_tile_fill). Where experts average fewer rows than a tile this is about
    expected_experts_hit; past that it also counts an expert's second and later tiles."""
    rows = num_tokens * min(1.0, top_k / num_experts)
    return num_local_experts * rows / (expected_tile_fill(num_tokens, top_k, num_experts, tile) * tile)


@dataclass
class Routing:
    local_expert: torch.Tensor  # int32 [T, K]: local expert of each slot, -1 when not local
    expert_counts: torch.Tensor  # int32 [E]: routed rows per local expert
    expert_offsets: torch.Tensor  # int32 [E + 1]: first padded permuted row of each expert
    expanded_to_permuted: torch.Tensor  # int32 [T, K]: permuted row of each slot, -1 when not local
    permuted_to_expanded: torch.Tensor  # int32 [max_tiles * tile]: t*K + k, -1 on padding rows
    tile_to_expert: torch.Tensor  # int32 [max_tiles]: local expert of each tile (0 past the live tiles)
    tile_to_mn_limit: torch.Tensor  # int32 [max_tiles]: exclusive end of the valid rows in each tile
    num_live_tiles: torch.Tensor  # int32 [1]
    tile_size: int


def compute_routing(token_selected_experts: torch.Tensor, num_local_experts: int, local_expert_offset: int,
                    tile_size: int) -> Routing:
    ids = token_selected_experts.to(torch.int64)
    num_tokens, top_k = ids.shape
    device = ids.device
    local = ids - local_expert_offset
    is_local = (local >= 0) & (local < num_local_experts)
    # Non-local slots are sorted into an extra bucket E that owns no rows.
    bucket = torch.where(is_local, local, torch.full_like(local, num_local_experts)).reshape(-1)
    bucket_counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    bucket_counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = bucket_counts[:num_local_experts]
    padded = (counts + tile_size - 1) // tile_size * tile_size
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)

    # Stable sort keeps slots of one expert in expanded order, so the maps are deterministic.
    order = torch.sort(bucket, stable=True).indices
    sorted_bucket = bucket[order]
    bucket_starts = torch.cumsum(bucket_counts, 0) - bucket_counts
    rank = torch.arange(bucket.numel(), device=device) - bucket_starts[sorted_bucket]
    row_of_sorted = torch.where(sorted_bucket < num_local_experts, offsets[sorted_bucket] + rank,
                                torch.full_like(rank, -1))
    expanded_to_permuted = torch.empty_like(row_of_sorted)
    expanded_to_permuted[order] = row_of_sorted

    num_tiles = max_num_tiles(num_tokens, top_k, num_local_experts, tile_size)
    num_rows = num_tiles * tile_size
    permuted_to_expanded = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    target = torch.where(expanded_to_permuted >= 0, expanded_to_permuted, torch.full_like(rank, num_rows))
    permuted_to_expanded[target] = torch.arange(bucket.numel(), device=device)
    permuted_to_expanded = permuted_to_expanded[:num_rows]

    tile_start = torch.arange(num_tiles, device=device) * tile_size
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)
    live = tile_expert < num_local_experts
    tile_expert = torch.where(live, tile_expert, torch.zeros_like(tile_expert))
    mn_limit = torch.minimum(offsets[:-1][tile_expert] + counts[tile_expert], tile_start + tile_size)
    mn_limit = torch.where(live, mn_limit, torch.zeros_like(mn_limit))

    as_i32 = lambda t: t.to(torch.int32)  # noqa: E731
    return Routing(
        local_expert=as_i32(torch.where(is_local, local, torch.full_like(local, -1))),
        expert_counts=as_i32(counts),
        expert_offsets=as_i32(offsets),
        expanded_to_permuted=as_i32(expanded_to_permuted.reshape(num_tokens, top_k)),
        permuted_to_expanded=as_i32(permuted_to_expanded),
        tile_to_expert=as_i32(tile_expert),
        tile_to_mn_limit=as_i32(mn_limit),
        num_live_tiles=as_i32(live.sum().reshape(1)),
        tile_size=tile_size,
    )
