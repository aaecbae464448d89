"""Buffers of a forward, allocated once for up to `max_num_tokens` tokens and reused by every run.

Sizes depend only on the token capacity and the layer's shape, never on the routing, so a CUDA graph captured
over these buffers serves any routing and any T up to the capacity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import launcher
from .launcher import KernelBuffers
from .routing import Routing, max_num_tiles


@dataclass
class MoEWorkspace:
    max_num_tokens: int
    top_k: int
    num_local_experts: int
    tile_sizes: tuple  # routing tiles the buffers can hold (the Hopper kernels pick one per forward)
    # routing maps (semantics §5.1)
    local_expert: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    expanded_to_permuted: torch.Tensor
    permuted_to_expanded: torch.Tensor
    tile_to_expert: torch.Tensor
    tile_to_mn_limit: torch.Tensor
    num_live_tiles: torch.Tensor
    # FC2 input (bf16 and/or quantized with swizzled scales), per-row FC2 scales, per-slot expert outputs
    kernel_buffers: KernelBuffers
    output: torch.Tensor

    @classmethod
    def allocate(cls, *, max_num_tokens: int, top_k: int, num_local_experts: int, hidden_size: int,
                 intermediate_size: int, quant_mode: str, tile_sizes: tuple,
                 output_dtype: torch.dtype, device) -> "MoEWorkspace":
        tile_sizes = tuple(tile_sizes)
        tiles_of = {t: max(1, max_num_tiles(max_num_tokens, top_k, num_local_experts, t)) for t in tile_sizes}
        tiles = max(tiles_of.values())  # the tile maps hold the most tiles any routing tile needs,
        rows = max(n * t for t, n in tiles_of.items())  # the row maps the most rows
        # token slabs for the slab GEMM1's tiles, up to the tokens they are offered at
        slab_tokens = min(max_num_tokens, launcher.SLAB_MAX_TOKENS)
        slab_rows = max([max_num_tiles(slab_tokens, top_k, num_local_experts, t) * t
                         for t in tile_sizes if t in launcher.SLAB_TILES], default=0)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            max_num_tokens=max_num_tokens, top_k=top_k, num_local_experts=num_local_experts, tile_sizes=tile_sizes,
            local_expert=torch.empty(max_num_tokens, top_k, **i32),
            expert_counts=torch.empty(num_local_experts, **i32),
            expert_offsets=torch.empty(num_local_experts + 1, **i32),
            expanded_to_permuted=torch.empty(max_num_tokens, top_k, **i32),
            permuted_to_expanded=torch.empty(rows, **i32),
            tile_to_expert=torch.empty(tiles, **i32),
            tile_to_mn_limit=torch.empty(tiles, **i32),
            num_live_tiles=torch.empty(1, **i32),
            kernel_buffers=KernelBuffers.allocate(quant_mode, rows, intermediate_size, max_num_tokens, top_k,
                                                  hidden_size, device, slab_rows=slab_rows),
            output=torch.empty(max_num_tokens, hidden_size, dtype=output_dtype, device=device),
        )

    def routing_buffers(self, num_tokens: int, tile_size: int) -> Routing:
        """Views of the routing buffers sized for num_tokens and the routing tile (what the device routing kernel
        fills)."""
        if tile_size not in self.tile_sizes:
            raise ValueError(f"this workspace holds routing tiles {self.tile_sizes}, not {tile_size}")
        tiles = max_num_tiles(num_tokens, self.top_k, self.num_local_experts, tile_size)
        return Routing(
            local_expert=self.local_expert[:num_tokens],
            expert_counts=self.expert_counts,
            expert_offsets=self.expert_offsets,
            expanded_to_permuted=self.expanded_to_permuted[:num_tokens],
            permuted_to_expanded=self.permuted_to_expanded[:tiles * tile_size],
            tile_to_expert=self.tile_to_expert[:tiles],
            tile_to_mn_limit=self.tile_to_mn_limit[:tiles],
            num_live_tiles=self.num_live_tiles,
            tile_size=tile_size,
        )

    def store_routing(self, routing: Routing) -> Routing:
        """Copy routing maps into the workspace; returns the same maps as views of the workspace buffers."""
        views = self.routing_buffers(routing.local_expert.shape[0], routing.tile_size)
        for name in ("local_expert", "expert_counts", "expert_offsets", "expanded_to_permuted",
                     "permuted_to_expanded", "tile_to_expert", "tile_to_mn_limit", "num_live_tiles"):
            getattr(views, name).copy_(getattr(routing, name))
        return views
