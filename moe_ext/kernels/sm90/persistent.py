"""A persistent form of the streaming mainloop (stream.py): one CTA a slot, work items taken by stride, and the
weight ring running on from one item into the next.

A streaming CTA costs ~1.5-2.3 K steps beyond its own (session 47: GEMM1 split in two ran 10.8% longer at gpt-oss-120b
T=256, 23-step CTAs), part of it the ring's fill: the first copies' latency, paid while nothing else of the CTA's
is in flight. Here the next item's first stages go out as soon as the current item's last stages are released, so
they land under its epilogue and the next item's token staging; the scale table, barriers and descriptor prefetch
are set up once a CTA.

Ring bookkeeping: an item takes `padded` stages, its K steps rounded up to whole passes over the ring. A padding
stage carries no copy (warp 0 completes its full barrier with a plain arrive, once the slot is released) and is not
consumed, so every item starts at slot 0 and its passes use the slots as tma_mainloop's unrolled ring does. A
slot's barriers complete `passes` phases an item, so pass r of the CTA's j-th item waits on parity
(j * passes + r) & 1.

For the mainloop forms that wait for stages_per_wait stages at a time on an unrolled ring, one K slice, no cluster
split (stream.config_for's 16-token form).
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import ptx
from . import stream as streaming
from .fp4 import swizzled_sf_offset


class Item(NamedTuple):
    """One work item: weight-row tile `n_tile` (rows [first_row, first_row + rows) of `expert`) for the routing tile
    whose token rows are permuted rows [row0, limit)."""

    n_tile: Int32
    expert: Int32
    first_row: Int32
    row0: Int32
    limit: Int32


def persistent_ctas(cfg: streaming.StreamConfig, num_sms: int = 132) -> int:
    """CTAs of a persistent launch: every slot of an H100 / H200 SXM (132 SMs) at the form's CTAs an SM."""
    return num_sms * cfg.ctas_per_sm


def check_config(cfg: streaming.StreamConfig) -> None:
    if cfg.k_slices != 1 or cfg.stages_per_wait < 2 or not cfg.unroll_ring or cfg.mma != "sync":
        raise ValueError(f"the persistent mainloop runs one K slice on an unrolled ring of stage groups, not {cfg}")


@cute.jit
def issue_or_pad(sm, lane, src: streaming.TmaSource, stage, steps, block: cutlass.Constexpr,
                 cfg: cutlass.Constexpr):
    """Stage `stage` of an item into slot stage % stages: its copies where the item has that K step, else a plain
    arrive that completes the slot's full barrier (a padding stage)."""
    if stage < steps:
        streaming.issue_tma_stage(sm, lane, src, 0, stage, steps, block, cfg)
    else:
        if lane == 0:
            cute.arch.mbarrier_arrive(sm.full + stage % cfg.stages)


@cute.jit
def refill(sm, lane, src, next_src, has_next, stage, steps, padded, base, block: cutlass.Constexpr,
           cfg: cutlass.Constexpr):
    """Warp 0 re-arms the slot of stage `stage` once every warp has released it, with stage + stages: the item's
    own (or a padding stage), or past the item's end the next item's first stages, if there is a next item."""
    cute.arch.mbarrier_wait(sm.empty + stage % cfg.stages, (stage // cfg.stages + base) & 1)
    ptx.fence_proxy_async_shared()
    later = stage + cfg.stages
    if later < padded:
        issue_or_pad(sm, lane, src, later, steps, block, cfg)
    else:
        if has_next:
            issue_or_pad(sm, lane, next_src, later - padded, steps, block, cfg)


class Ring(NamedTuple):
    """An item's place on the ring: its stages (`steps` real, `padded` in all), the parity of its first pass and
    the sources of its copies and of the next item's (`has_next`: whether there is one)."""

    steps: Int32
    padded: Int32
    base: Int32
    src: streaming.TmaSource
    next_src: streaming.TmaSource
    has_next: cutlass.Boolean


@cute.jit
def item_group(sm, tid, place, ring: Ring, g, first_slot: cutlass.Constexpr, phase, k_end, acc: cute.Tensor,
               tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
               load_group: cutlass.Constexpr, live: cutlass.Constexpr, check: cutlass.Constexpr):
    """Group `g` of stages_per_wait stages (slots first_slot.., barrier parity `phase`), as stream.group_step: warp
    0 re-arms the previous group's slots, the tokens are restaged where a K-chunk starts, every wait, then the
    consumptions (of real stages only where `check`: the item's last pass holds its padding), then the
    releases."""
    per_group = cfg.stages_per_wait
    chunk = streaming.k_chunk(tokens, cfg)
    if tid < 32 and g > 0:
        for u in cutlass.range_constexpr(per_group):
            refill(sm, tid, ring.src, ring.next_src, ring.has_next, (g - 1) * per_group + u, ring.steps,
                   ring.padded, ring.base, block, cfg)
    k_run = g * per_group * cfg.k_step
    if streaming.restages(k_run, chunk, load_group) & (k_run < k_end):
        streaming.stage_tokens(sm, tid, 0, k_run, k_end, tokens, cfg, load_group, live)
    for u in cutlass.range_constexpr(per_group):
        cute.arch.mbarrier_wait(sm.full + first_slot + u, phase)
    for u in cutlass.range_constexpr(per_group):
        offset = (k_run + u * cfg.k_step) & (chunk - 1)
        if cutlass.const_expr(check):
            if g * per_group + u < ring.steps:
                streaming.consume_tma_stage(sm, place, first_slot + u, offset, 0, ring.steps, acc, tokens, block,
                                            cfg, live, wait=False, check=False)
        else:
            streaming.consume_tma_stage(sm, place, first_slot + u, offset, 0, ring.steps, acc, tokens, block, cfg,
                                        live, wait=False, check=False)
    for u in cutlass.range_constexpr(per_group):
        streaming.release_tma_stage(sm, tid, first_slot + u, cfg)


@cute.jit
def item_mainloop(sm, tid, place, ring: Ring, passes, k_end, acc: cute.Tensor, tokens: cutlass.Constexpr,
                  cfg: cutlass.Constexpr, block: cutlass.Constexpr, load_group: cutlass.Constexpr,
                  live: cutlass.Constexpr):
    """An item's passes over the ring: all but the last without checks, the last (which holds the padding) with."""
    groups = cfg.stages // cfg.stages_per_wait
    args = (k_end, acc, tokens, cfg, block, load_group, live)
    for r in cutlass.range(passes - 1):
        for h in cutlass.range_constexpr(groups):
            item_group(sm, tid, place, ring, r * groups + h, h * cfg.stages_per_wait, (r + ring.base) & 1, *args,
                       False)
    last = passes - 1
    for h in cutlass.range_constexpr(groups):
        item_group(sm, tid, place, ring, last * groups + h, h * cfg.stages_per_wait, (last + ring.base) & 1, *args,
                   True)


def item_source(item: Item, w_map_address: Int64, sf_address: Int64, rows_per_expert, k_extent,
                block: int) -> streaming.TmaSource:
    """Where an item's copies come from (stream.TmaSource, as tma_mainloop builds it for a CTA)."""
    return streaming.TmaSource(w_map_address, item.expert, item.first_row, sf_address + Int64(
        swizzled_sf_offset(item.expert, item.first_row, 0, rows_per_expert, k_extent // block)))


@cute.jit
def stream_items(sm, tid, w_sf, w_map, rows_per_expert, k_extent, first_item, stride, num_items,
                 item_of: cutlass.Constexpr, load_group_of: cutlass.Constexpr, epilogue: cutlass.Constexpr,
                 tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr):
    """Items first_item, first_item + stride, ... below num_items: `item_of(i)` gives item i (an Item),
    `load_group_of(item)` its token loads (stream.accumulate's load_group), and `epilogue(item)` runs with the
    item's accumulator tile in sm.out (every thread, between barriers)."""
    check_config(cfg)
    streaming.fill_scale_lut(sm, tid, block)
    acc = cute.make_rmem_tensor((streaming.accumulator_size(tokens, cfg),), Float32)
    steps = k_extent // cfg.k_step
    passes = (steps + cfg.stages - 1) // cfg.stages
    padded = passes * cfg.stages
    k_end = steps * cfg.k_step
    place = streaming.step_place(sm, tid, cfg, block)
    w_map_address = streaming.address_of(w_map)
    sf_address = streaming.address_of(w_sf)
    if tid == 0:
        ptx.prefetch_tensormap(w_map_address)
        for s in cutlass.range_constexpr(cfg.stages):
            cute.arch.mbarrier_init(sm.full + s, 1)
            cute.arch.mbarrier_init(sm.empty + s, cfg.warps)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    where = (w_map_address, sf_address, rows_per_expert, k_extent, block)  # item_source's other arguments
    mine = Int32(cutlass.select_(first_item < num_items, (num_items - first_item + stride - 1) // stride,
                                 Int32(0)))
    if tid < 32 and mine > 0:
        first_src = item_source(item_of(first_item), *where)
        for s in cutlass.range_constexpr(cfg.stages):
            issue_or_pad(sm, tid, first_src, s, steps, block, cfg)
    for j in cutlass.range(mine, unroll=1):
        i = first_item + j * stride
        item = item_of(i)
        ring = Ring(steps, padded, (j * passes) & 1, item_source(item, *where),
                    item_source(item_of(cute.math.min(i + stride, num_items - 1)), *where), j + 1 < mine)
        acc.fill(0.0)
        loop_args = (sm, tid, place, ring, passes, k_end, acc, tokens, cfg, block, load_group_of(item))
        streaming.narrowest_mainloop(item_mainloop, loop_args, item.limit - item.row0,
                                     streaming.mainloop_widths(tokens, cfg))
        cute.arch.sync_threads()  # every warp is done with the token tile that the accumulators overwrite
        if tid < 32:  # the last group's slots, every warp having released them: the next item's next stages
            for u in cutlass.range_constexpr(cfg.stages_per_wait):
                refill(sm, tid, ring.src, ring.next_src, ring.has_next, padded - cfg.stages_per_wait + u, steps,
                       padded, ring.base, block, cfg)
        streaming.store_accumulators(sm, tid, acc, tokens, cfg, add=False)
        cute.arch.sync_threads()
        epilogue(item)
