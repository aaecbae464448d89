"""Streaming mainloop of the grouped GEMMs (sm_90a, version 3): swap-AB, weights decoded in registers.

The 4-bit weights are the MMA's M side (128 weight rows per CTA, 16 per warp) and the routed tokens its N side
(`tokens` per CTA = the routing tile), so a CTA streams each weight byte once for up to `tokens` tokens: at decode
the kernel is a weight stream, and all of it goes through one path:

  weights  global --TMA box (128 rows x 64 bytes) per 128-K step--> shared ring (`stages` deep) --> registers
           --> e2m1 decode (shift/mask into bf16 bit patterns, one bf16x2 multiply by the block scale) --> MMA A
           fragments
  tokens   global --> decoded to bf16 once per CTA and K-chunk --> shared tile --> MMA B fragments
  MMA      mma.sync m16n8k16 bf16 -> fp32 accumulators in registers

The ring is fed by the copy engine: one TMA box per step and one bulk copy of the step's scale tiles, counted on
the stage's mbarrier. There is no producer warp: warp 0 refills a slot once every warp has released it.
Per-thread 16-byte cp.async copies (version 2) spent the LSU's issue slots on addresses and peaked near 2.3 TB/s;
the copy engine moves 8 KB per instruction (benchmarks/results/h200_stream_variants.md, session 7).

K order inside the MMA is free as long as both operands agree. Thread t of a quad owns K [32t, 32t + 32) of each
128-K step (one 16-byte load per row); a decoded register holds the codes (i, i + 4) of an 8-code word, and the
token tile is stored in the same order (x0 x4 x1 x5 x2 x6 x3 x7 per 8 values), so each B fragment is one 16-byte
shared load.

Parallelism along K, for decode where few tiles are live: inside a CTA, `k_slices` warp groups take alternate
steps of the same rows; across CTAs, the k_split CTAs of a cluster take contiguous runs of steps and rank 0 adds
the others' accumulator tiles through distributed shared memory (add_peer_accumulators), in rank order, so
results stay reproducible.

Scale bookkeeping: the decoded weight bit pattern is w * 2^-126; it is multiplied by bf16(scale * 2^63), and the
token tile holds x * 2^63, so the fp32 accumulator is exactly sum(w * scale * x) (every step is an exact bf16
operation; semantics §2.1). Limits of that trick: token values must stay below 2^64 in magnitude and MXFP4 weight
scales inside [2^-62, 2^64]: below 2^-62 a decoded weight times 2^-63 leaves bf16's normal range (subnormal
results keep it exact down to 2^-69, if the multiply does not flush them), above 2^64 the scale times 2^63
overflows. Checked on the CPU for every e2m1 code and scale byte; NVFP4's e4m3 scales are all inside. Both limits
are far outside anything a real layer holds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.experimental.cuda import TensorMapL2Promotion, create_tensor_map_tiled_from_view

from ...slabs import RING_PITCH, chunk_position
from . import ptx
from .fp4 import e4m3_to_f32, swizzled_sf_offset, ue8m0_to_f32


@dataclass(frozen=True)
class StreamConfig:
    warps: int = 8  # each warp streams 16 weight rows (MMA M): 128 rows, one 64-row up/gate pair of the interleave
    k_slices: int = 1  # warp groups that take alternate 128-K steps of the same rows (summed at the end)
    k_step: int = 128  # K per pipeline stage
    stages: int = 6  # ring depth: stages x k_slices x 9 KB in flight
    token_elems: int = 32768  # bf16 elements of the shared token tile (64 KB): tokens x K-chunk (at most 4096)
    ctas_per_sm: int = 1  # CTAs the launch asks to fit per SM (2 caps registers at 128 for 256 threads)
    stages_per_wait: int = 1  # stages a warp waits for before consuming them together (independent decode chains)
    # Whole passes over the ring a mainloop iteration (stages a multiple of stages_per_wait): every slot's barrier,
    # weight and scale addresses are constants and the phase one bit a pass (10-19% fewer instructions a stage, the
    # mainloop's code once a group of the ring).
    unroll_ring: bool = False
    # "sync": each warp's mma.sync m16n8k16 per 8 tokens, B fragments loaded from the padded token tile. "wgmma":
    # one warpgroup wgmma per k16 for all the tokens, the decoded weights as its register A operand and the token
    # tile in the canonical K-major layout (a benchmarks/stream_variants.py variant, not shipped: waiting for its
    # wgmmas at every step, it measured 1.17-1.23x slower than "sync"). "wgmma_async": the same, with each step's
    # wgmmas left in flight under the next step (not run yet: whether ptxas keeps their A registers intact while
    # the next step decodes is what its rel_l2_to_default will show).
    mma: str = "sync"
    # A tile of 16+ tokens ("sync") has narrower copies of the mainloop that stage and multiply only its first
    # `live` tokens (mainloop_widths): a CTA runs the narrowest that holds its live rows, so experts with few rows
    # pay for fewer padding columns.
    narrow: bool = True
    # Token slabs in the ring: each stage also carries its step's 256 bytes of every live token row, one bulk copy
    # a stage from token slabs (moe_ext/slabs.py: the tile's rows already in the tile's order and scale, a step's rows
    # contiguous), so no K-chunk is staged by the threads. The staging stalled the warps on global loads at every
    # chunk: leave-one-out 6-16% of GEMM1 at T=256 on 16-token tiles; a copy a row (16-32 a stage) lost that
    # again (session 49).
    ring_tokens: bool = False

    @property
    def rows(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.k_slices


def config_for(tokens: int, gemm: int, three_ctas: bool = False) -> StreamConfig:
    """The mainloop of GEMM `gemm` (1 or 2) on `tokens`-token tiles, as measured on the H200
    (benchmarks/results/h200_stream_variants.md).

    A CTA's fixed costs (launch, prologue, token staging, accumulator exchange, epilogue) take 2-7 us per wave and
    leave the SM's weight stream idle, so where it pays, two 8-warp CTAs share an SM: one streams while the other
    starts or finishes. That needs a 4-stage ring (shared memory under half the SM's) and at most 128 registers a
    thread. It was 8-29% faster for GEMM1 on 8-token tiles and for both GEMMs on 64-token tiles (session 6, with
    the cp.async ring). GEMM2 on 8-token tiles keeps one CTA of two 8-warp K slices (twice the bytes in flight):
    Mixtral's GEMM2 (K = 14336 over 32 column tiles) was 1.2-1.4x slower with two CTAs.
    On 16-token tiles three CTAs share an SM (6 warps a scheduler to hide the decode chains' latencies; 80
    registers a thread, no spills; 4 stages and a 32 KB token tile fit 228 KB): whole forwards 1.07-1.14x faster
    than with two at T = 64 and 256 on five shapes (session 15, h200_session15_checks.md). On 32-token tiles it was
    0.89-1.06x (its K chunk halves again). On 8-token tiles it depends on the launch: 1.06-1.8x where three CTAs
    an SM fill the GPU (GEMM2 gains most: it drops the two K slices), 0.75-0.96x where a few hundred CTAs or fewer run
    (session 17, h200_session17_checks.md), so 8-token tiles have both forms (`three_ctas`, THREE_CTA_TILES) and
    the tactic picks one per GEMM (launcher.THREE_CTAS). 32-token tiles have both forms too since their mainloop
    runs quarter widths (session 19): at ~16 rows an expert (Mixtral T=64) the two-CTA form issues 0.56
    instructions a scheduler and cycle from 3.7 warps, latency bound, and the third CTA's warps outweigh the
    smaller K chunks' extra restaging where the launch is large (1.03-1.05x; 0.98x at 96 CTAs; session 20,
    h200_session20_checks.md).
    Every form but the 32-token three-CTA one waits for two stages at a time, and those up to 64 tokens run their
    ring unrolled (`unroll_ring`): whole forwards 0.99-1.05x (median 1.015) with the default tactics at T = 1-256 on
    five shapes, and 16-token tiles 1.02-1.09x (median 1.046) but 0.98x on gpt-oss-120b at T=256 (session 31,
    h200_session31_checks.md)."""
    three = StreamConfig(stages=4, ctas_per_sm=3, token_elems=16384)
    if tokens <= 16:  # at 32 tokens the grouped mainloop spills at the form's 80 registers
        three = replace(three, stages_per_wait=2, unroll_ring=True)
    if three_ctas:
        if tokens not in THREE_CTA_TILES:
            raise ValueError(f"three_ctas: only {THREE_CTA_TILES}-token tiles have a three-CTA form, not {tokens}")
        return three
    if tokens <= 8 and gemm == 2:
        return StreamConfig(k_slices=2, stages_per_wait=2, unroll_ring=True)
    if tokens == 16:
        return three
    if tokens <= 64:
        return StreamConfig(stages=4, ctas_per_sm=2, stages_per_wait=2, unroll_ring=True)
    return StreamConfig(stages_per_wait=2)


def shared_pieces(tokens: int, c: StreamConfig) -> tuple[int, int, int, int, int]:
    """Bytes of what allocate() takes: the weight ring (a 128-row x 64-byte slot per K slice and stage), its
    scale slots (1 KB each), the scale table, the token tile (which the fp32 accumulator tile reuses after the
    mainloop) and the ring's barriers (a full and an empty mbarrier per stage)."""
    slots = c.stages * c.k_slices
    staged = slots * tokens * RING_PITCH if c.ring_tokens else tokens * row_pitch(tokens, c)
    tile = max(staged, tokens * (c.rows + 4) * 4)
    return slots * c.rows * 64, slots * 1024, 256 * 4, tile, c.stages * 16


def shared_bytes(tokens: int, c: StreamConfig) -> int:
    """Dynamic shared memory of one CTA."""
    return sum(shared_pieces(tokens, c))


def mainloop_widths(tokens: int, c: StreamConfig) -> tuple[int, ...]:
    """The token widths the mainloop is compiled for, each a multiple of the first (StreamConfig.narrow). A
    padding column costs about what a live one does (the m16n8k16 MMAs, their B loads and the staging), so 32-
    and 64-token tiles come in quarters: at ~16 rows an expert (Mixtral T=64) the rows land on 16 or 24 columns
    of a 32-token tile where halves paid 32 for any expert past 16. A 16-token tile halves (an 8-token width is
    one MMA column); 128-token tiles halve too (four copies of their 16-column loop would double the code)."""
    if not (c.narrow and c.mma == "sync" and tokens >= 16):
        return (tokens,)
    parts = 4 if tokens in (32, 64) else 2
    return tuple(tokens // parts * (i + 1) for i in range(parts))


def chains(tokens: int, c: StreamConfig) -> int:
    """Independent accumulator sets per n-tile: with one n-tile, four sets break the mma.sync dependency chain
    (wgmma runs its accumulation asynchronously)."""
    return 4 if tokens <= 8 and c.mma == "sync" else 1


def accumulator_size(tokens: int, c: StreamConfig) -> int:
    return chains(tokens, c) * tokens // 8 * 4


TOKEN_TILES = (8, 16, 32, 64, 128)  # the routing tiles the kernels are compiled for (tokens per CTA)
THREE_CTA_TILES = (8, 32)  # tiles also compiled in a three-CTAs-an-SM form (config_for's three_ctas)

BF16X2_2P63 = 0x5F005F00  # bf16 2^63 in both halves
TWO_P63 = 9.223372036854775808e18


def k_chunk(tokens: int, c: StreamConfig) -> int:
    """K values of the token tile staged at a time: a power of two, so the mainloop finds a step's place in it
    with one AND."""
    chunk = min(4096, c.token_elems // tokens)
    assert chunk & (chunk - 1) == 0, "token_elems / tokens must be a power of two"
    return chunk


def row_pitch(tokens: int, c: StreamConfig) -> int:
    """Bytes between token rows of the shared tile: one 16-byte chunk of padding staggers the banks."""
    if c.ring_tokens:
        return RING_PITCH
    return (k_chunk(tokens, c) + 8) * 2



class Smem(NamedTuple):
    threads: int
    pitch: int  # row_pitch of the token tile
    weights: Int32  # shared address of the weight ring: slots of 128 rows x 64 bytes (one 128-K step)
    scales: Int32  # a 1 KB slot per weight slot: the step's swizzled scale tiles
    scale_lut: Int32  # 256 x bf16x2: scale byte -> (scale * 2^63, scale * 2^63)
    tokens: Int32  # the token tile
    out: cute.Tensor  # fp32 [tokens, rows] accumulator tile, over the token tile (used after the mainloop)
    full: cute.Pointer  # one mbarrier per stage, complete when the stage's bytes have landed
    empty: cute.Pointer  # one mbarrier per stage, complete when every warp is done reading it
    token_slot: int  # ring_tokens: bytes of a slot's token rows (slot s at sm.tokens + s * token_slot); else 0


def allocate(tokens: int, c: StreamConfig) -> Smem:
    smem = cutlass.utils.SmemAllocator()
    ring_w, ring_s, lut, tile, bars = (
        smem.allocate_tensor(cutlass.Uint8, cute.make_layout(n), 1024 if i == 0 else 16)  # TMA lands 1 KB-aligned
        for i, n in enumerate(shared_pieces(tokens, c)))
    out = cute.make_tensor(cute.recast_ptr(tile.iterator, dtype=Float32),
                           cute.make_layout((tokens, c.rows), stride=(c.rows + 4, 1)))
    full = cute.recast_ptr(bars.iterator, dtype=Int64)
    return Smem(c.threads, row_pitch(tokens, c), ring_w.iterator.toint(), ring_s.iterator.toint(),
                lut.iterator.toint(), tile.iterator.toint(), out, full, full + c.stages,
                tokens * RING_PITCH if c.ring_tokens else 0)


def fill_scale_lut(sm: Smem, tid, block: int) -> None:
    """Each thread writes the entries of scale bytes tid, tid + threads, ... (e4m3 for NVFP4, ue8m0 for MXFP4); a
    barrier must follow before the first consume_tma_step. A lookup is one shared load where the conversion was ~15
    instructions."""
    for i in range(max(1, 256 // sm.threads)):
        code = (tid + i * sm.threads) % 256
        entry = scale_table_entry(code, block)
        ptx.st_shared_b32(sm.scale_lut + code * 4, entry)


def scale_table_entry(code, block: int) -> Int32:
    """bf16x2 (scale * 2^63) of scale byte `code`: e4m3 (NVFP4, block 16) or ue8m0 (MXFP4, block 32). Times a
    decoded e2m1 pattern (value * 2^-126) it gives value * scale * 2^-63 in one exact multiply."""
    value = (e4m3_to_f32(code) if block == 16 else ue8m0_to_f32(code)) * Float32(TWO_P63)
    return ptx.pack_bf16x2(value, value)


class StepPlace(NamedTuple):
    """A thread's fixed shared-memory offsets in every 128-K step (step_place), made once a mainloop and pinned
    (ptx.pinned): computed inside the step, they were recomputed from tid at every step, ~15-25 SASS of a
    ~240-instruction step in the 80-register three-CTA forms (docs/experiments/stream_step_place_sass.txt)."""

    weights: Int32  # its 16 bytes of weight row r in slot 0: sm.weights + r * 64 + t * 16 (row r + 8: + 512)
    group: Int32  # its 4 scale bytes of row r in a step's scale tiles (row r + 8: group8)
    group8: Int32
    scale_byte: Int32  # the first of those bytes this thread looks up (_scale_pairs)
    tokens: Int32  # its token row's first chunk of the thread's quad: sm.tokens + (lane // 4) * pitch + t * 64
    swap: Int32  # the tile's 16-byte chunk swizzle of the quad position t (see tile_address): (t >> 1) << 1


def step_place(sm: Smem, tid, c: StreamConfig, block: int) -> StepPlace:
    """StepPlace of thread `tid`. At the 64-byte weight row pitch a quarter-warp's eight 16-byte loads (rows r and
    r + 1, chunks t = 0..3) cover 128 consecutive bytes: no bank conflict."""
    lane = tid % 32
    r = ((tid // 32) % c.warps) * 16 + lane // 4
    t = lane % 4
    tiles = (t // 2 if block == 16 else 0) * 512

    def group(row):
        return tiles + (row % 32) * 16 + (row // 32) * 4

    return StepPlace(*(ptx.pinned(v) for v in (
        sm.weights + r * 64 + t * 16, group(r), group(r + 8), (2 * t) % 4 if block == 16 else t,
        sm.tokens + (lane // 4) * sm.pitch + t * 64, (t >> 1) << 1)))


def _scale_pairs(sm: Smem, group: Int32, first_byte, block: int) -> list:
    """bf16x2 (scale * 2^63) for each of the 4 words a thread holds of one row (NVFP4: two blocks of 16, bytes
    first_byte and first_byte + 1 of its 4-byte group; MXFP4: one block of 32, byte first_byte)."""
    if block == 16:
        lo = ptx.ld_shared_b32(sm.scale_lut + ptx.byte_of(group, first_byte) * 4)
        hi = ptx.ld_shared_b32(sm.scale_lut + ptx.byte_of(group, first_byte + 1) * 4)
        return [lo, lo, hi, hi]
    s2 = ptx.ld_shared_b32(sm.scale_lut + ptx.byte_of(group, first_byte) * 4)
    return [s2, s2, s2, s2]


def consume_tma_step(sm: Smem, place: StepPlace, slot, scales, tile_offset, acc: cute.Tensor, tokens: int,
                     block: int, c: StreamConfig, live: int):
    """acc += this thread's share of the 128-K step in weight slot `slot` (128 rows x 64 bytes, rows dense) with
    its scale tiles at shared address `scales`; its tokens start at byte `tile_offset` of the token tile rows (the
    step's position inside the staged K-chunk); the MMAs cover its first `live` tokens."""
    rows = place.weights + slot * (c.rows * 64)
    operands = (ptx.ld_shared_v4(rows), ptx.ld_shared_v4(rows + 8 * 64),
                _scale_pairs(sm, ptx.ld_shared_b32(scales + place.group), place.scale_byte, block),
                _scale_pairs(sm, ptx.ld_shared_b32(scales + place.group8), place.scale_byte, block), tile_offset, acc)
    if c.mma == "sync":
        multiply_step(sm, place, *operands, tokens, c, live)
    else:
        multiply_step_wgmma(sm, *operands, tokens, c)


def multiply_step(sm: Smem, place: StepPlace, w0: list, w1: list, s0: list, s1: list, tile_offset,
                  acc: cute.Tensor, tokens: int, c: StreamConfig, live: int):
    """Decode this thread's 16 bytes of rows r and r + 8 (with their bf16x2 scales) and multiply them into acc
    with the first `live` tokens of the tile."""
    row_base = place.tokens + tile_offset
    for j in range(4):
        a0 = ptx.e2m1x8_to_bf16x2(w0[j], s0[j])
        a1 = ptx.e2m1x8_to_bf16x2(w1[j], s1[j])
        chunk = Int32(j) ^ place.swap
        for nt in range(live // 8):
            b = ptx.ld_shared_v4(row_base + nt * 8 * sm.pitch + chunk * 16)
            for h in range(2):
                base = ((2 * j + h) % chains(tokens, c) * (tokens // 8) + nt) * 4
                prev = [acc[base + i] for i in range(4)]
                d = ptx.mma_bf16_16816([a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1]],
                                       [b[2 * h], b[2 * h + 1]], prev)
                for i in range(4):
                    acc[base + i] = d[i]


def multiply_step_wgmma(sm: Smem, w0: list, w1: list, s0: list, s1: list, tile_offset, acc: cute.Tensor,
                        tokens: int, c: StreamConfig):
    """multiply_step as one warpgroup wgmma per k16 for all the tokens. A warp's mma.sync A fragment is exactly its
    16-row slice of the warpgroup's m64 A operand, and the accumulator order per 8 tokens is the same, so the decode
    and the accumulator layout do not change; the token tile is read through descriptors (wgmma_tile_offset)."""
    a0 = [ptx.e2m1x8_to_bf16x2(w0[j], s0[j]) for j in range(4)]
    a1 = [ptx.e2m1x8_to_bf16x2(w1[j], s1[j]) for j in range(4)]
    # tile_offset = 2 x the step's K inside the chunk, and a step takes 256 * tokens bytes. The descriptor's K-half
    # and 8-token strides, and each virtual step's start (constants that stay inside the 14-bit address field:
    # shared memory < 256 KB), are read off wgmma_tile_offset at thread slot t = 0 (group j of the step).
    step = ptx.smem_descriptor_k_major(sm.tokens + tile_offset * tokens, wgmma_tile_offset(tokens, 0, 0, 1),
                                       wgmma_tile_offset(tokens, 8, 0, 0))
    ptx.wgmma_fence()
    for j in range(4):
        for h in range(2):
            desc = step + Int64(wgmma_tile_offset(tokens, 0, j, 2 * h) >> 4)
            d = ptx.wgmma_bf16_rs([acc[i] for i in range(tokens // 2)],
                                  [a0[j][2 * h], a1[j][2 * h], a0[j][2 * h + 1], a1[j][2 * h + 1]], desc)
            for i in range(tokens // 2):
                acc[i] = d[i]
    ptx.wgmma_commit()
    # "wgmma_async": the step's wgmmas stay in flight under the next step's loads and decode; this wait only
    # retires the previous step's (its A registers are then free again).
    ptx.wgmma_wait(1 if c.mma == "wgmma_async" else 0)


def wgmma_tile_offset(tokens: int, row, group, word) -> Int32:
    """Byte offset in the token K-chunk of word `word` (tile order: values x_word, x_word+4) of the 8-value group
    `group` (K = 8 group) of token `row`, in the wgmma layout. A 128-K step is 8 virtual k16 steps v = 2j + h of
    32 * tokens bytes, each two 16 * tokens-byte K halves (core matrix c) of 8-token x 16-byte core matrices. The
    thread t of a quad holding weight word j (K = 32t + 8j .. + 7 of the step) feeds slot 2t + e of half c of step
    (j, h) with K = 32t + 8j + 2h + c + 4e, so word w = 2h + c of group 4t + j lands in 4 bytes at slot 2t."""
    step, m = group // 16, group % 16
    t, j = m // 4, m % 4
    v = 2 * j + word // 2
    return (step * 256 * tokens + v * 32 * tokens + (word % 2) * 16 * tokens + (row // 8) * 128 + (row % 8) * 16
            + t * 4)


def sf_step_bytes(block: int) -> int:
    """Swizzled scale bytes of 128 rows x one 128-K step (NVFP4: two 512-byte tiles, MXFP4: one)."""
    return 512 * StreamConfig.k_step // block // 4


def expert_weight_view(w: cute.Tensor, experts, rows_per_expert, k_extent) -> cute.Tensor:
    """The 4-bit weight `w` (flat bytes) as [experts, rows_per_expert, k_extent / 2] bytes, for a TMA descriptor
    built in the launch function (the exported host code encodes it from these runtime extents at each launch).
    The expert stride is 64-bit (DeepSeek-V3's W1 is 3.8e9 bytes); the launcher checks the 16-byte alignment the
    descriptor needs."""
    k_bytes = k_extent // 2
    return cute.make_tensor(w.iterator, cute.make_layout(
        (experts, rows_per_expert, k_bytes), stride=(Int64(rows_per_expert) * Int64(k_bytes), k_bytes, 1)))


def weight_map(w: cute.Tensor, experts, rows_per_expert, k_extent, c: StreamConfig):
    """A TMA descriptor (cutlass.experimental.cuda.TensorMap) for boxes of (1 expert, c.rows rows, 64 bytes: one
    128-K step) of expert_weight_view; coordinates (byte, row, expert). It asks for 128-byte L2 promotion, which
    cute's TMA atom has no parameter for: a stream of 64-byte-wide boxes ran 2.9-3.3 TB/s on the H200 without it and
    4.37-4.45 with it (benchmarks/results/h200_session28_tma_box_stream.txt); whole decode forwards gained
    1.01-1.06x (h200_session29_checks.md). The wgmma GEMMs keep cute's atom: there it cost 1-5% at T >= 1024."""
    return create_tensor_map_tiled_from_view(expert_weight_view(w, experts, rows_per_expert, k_extent),
                                             (1, c.rows, 64), stride_order=(2, 1, 0),
                                             l2_promotion=TensorMapL2Promotion.l2_128b)


def tile_address(sm: Smem, row, chunk) -> Int32:
    """Shared address of 8-value chunk `chunk` of token row `row`."""
    return sm.tokens + row * sm.pitch + chunk_position(chunk) * 16


def permute_bf16x8(u: list) -> list:
    """bf16 x0..x7 in 4 registers -> the tile order (x0 x4)(x1 x5)(x2 x6)(x3 x7)."""
    return [ptx.prmt(u[0], u[2], 0x5410), ptx.prmt(u[0], u[2], 0x7632),
            ptx.prmt(u[1], u[3], 0x5410), ptx.prmt(u[1], u[3], 0x7632)]


def bf16x8_to_tile(u: list) -> list:
    return [ptx.mul_bf16x2(v, Int32(BF16X2_2P63)) for v in permute_bf16x8(u)]


def token_group(values_bf16: cute.Tensor, offset: Int64) -> list:
    """The 8 bf16 activation values starting at element `offset` of a row-major token matrix, in tile order (the
    quantized modes' activations arrive decoded: gemm1.py)."""
    return bf16x8_to_tile(ptx.ld_global_v4(values_bf16.iterator.toint() + offset * 2))


def store_chunk(sm: Smem, row, chunk, values: list, valid, tokens: int, c: StreamConfig) -> None:
    zero = Int32(0)
    v = [Int32(cutlass.select_(valid, x, zero)) for x in values]
    if c.mma != "sync":
        for w in range(4):
            ptx.st_shared_b32(sm.tokens + wgmma_tile_offset(tokens, row, chunk, w), v[w])
    else:
        ptx.st_shared_v4(tile_address(sm, row, chunk), v[0], v[1], v[2], v[3])


def store_accumulators(sm: Smem, tid, acc: cute.Tensor, tokens: int, c: StreamConfig, add: bool) -> None:
    """Registers (all chains summed) -> sm.out[token, weight row], written or added (the K slices take turns,
    between barriers, so the sum has a fixed order)."""
    warp = (tid // 32) % c.warps
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    for nt in range(tokens // 8):
        for i in range(4):
            value = acc[nt * 4 + i]
            for chain in range(1, chains(tokens, c)):
                value = value + acc[(chain * (tokens // 8) + nt) * 4 + i]
            at = (nt * 8 + 2 * t + i % 2, warp * 16 + g + 8 * (i // 2))
            sm.out[at] = sm.out[at] + value if add else value


def add_peer_accumulators(sm: Smem, tid, peer, tokens: int, c: StreamConfig) -> None:
    """sm.out += the accumulator tile of cluster CTA `peer` (its K range), read through distributed shared memory.
    Call between cluster barriers; peers are added in rank order, so the sum is reproducible."""
    for i in range(tokens * c.rows // c.threads):
        index = tid + i * c.threads
        at = (index // c.rows, index % c.rows)
        address = sm.tokens + (at[0] * (c.rows + 4) + at[1]) * 4
        sm.out[at] = sm.out[at] + ptx.ld_shared_cluster_f32(address, peer)


def k_range(steps, rank, k_split):
    """First step and step count of cluster CTA `rank` when `k_split` CTAs share the K steps in contiguous runs."""
    per_rank = (steps + k_split - 1) // k_split
    first = cute.math.min(rank * per_rank, steps)
    return first, cute.math.min(per_rank, steps - first)


class TokenLoads(NamedTuple):
    """A load_group of two forms, chosen at run time: `unrolled` (a short gather returning row-order words as a
    LoadsFirst load does, staged with all of a thread's loads issued before its first store, the first chunk's
    ahead of the weight copies) where `unrolled_when` holds, else `looped` (a load too long to copy once a task,
    staged in a loop after the copies). decode_fused.py's one loop over both GEMMs stages x
    (one 16-byte load a task) and the FC2 input (the K ranges' partials summed and activated) through the same
    mainloop."""

    unrolled: object
    looped: object
    unrolled_when: object  # a run-time Boolean


class LoadsFirst(NamedTuple):
    """A load_group whose staging issues all of a thread's loads of a K-chunk before its first store (load_chunk):
    decode_fused.py's gathers, whose row map is read from shared memory. `load(r, k, k_end)` returns the 4 words
    of 8 bf16 values in row order, converted to the tile order only where they are stored: converted as they
    are loaded, ptxas put the conversion (the first use of the loads) ahead of the first chunk's weight copies,
    which then waited for the loads (1-2.5 us an item). `decode(raw)`, where given, takes bf16x8_to_tile's place:
    it turns what `load` returned into the 4 tile-order words (decode_fused.py's quantized activations, codes and
    their scale, go straight to the tile order)."""

    load: object
    decode: object = None


class TokensReady(NamedTuple):
    """A wait that a run's token loads must follow: decode_fused.py's GEMM2 items, whose FC2 input other CTAs
    write. Where `when` holds at run time, warp 0 issues the run's first `stages` weight copies before every thread
    runs `wait(tid, *args)`, so they land while the CTA waits; the loads and the other copies keep their places.
    (The wait takes its values as arguments: a closure's captures do not reach a staged branch.)"""

    wait: object
    args: tuple
    when: object  # a run-time Boolean
    stages: int


class TokenSlabs(NamedTuple):
    """The load_group of a ring_tokens mainloop: `tile_base` is the global byte address of this routing tile's slab
    of step 0 in a token slab matrix (moe_ext/slabs.py), `rows` how many of its rows are live (run time); each stage
    is one bulk copy of a step's live rows."""

    tile_base: object
    rows: object


def tile_slabs(matrix: cute.Tensor, tile, k_extent, live_rows, tokens: int) -> TokenSlabs:
    """The TokenSlabs of routing tile `tile` in `matrix` (a token_slabs matrix of K = k_extent, tiles of `tokens`
    rows), `live_rows` of them live."""
    slab = Int64(tile) * Int64(k_extent // StreamConfig.k_step) * Int64(tokens * RING_PITCH)
    return TokenSlabs(matrix.iterator.toint() + slab, live_rows)


def slab_chunk_address(tile_base, row, k, tokens) -> Int64:
    """Global byte address of the 8 values at K = k (a multiple of 8) of row `row` of a routing tile of `tokens`
    rows whose step-0 slab starts at `tile_base` (TokenSlabs.tile_base). A writer stores them bf16x8_to_tile'd."""
    step = k // StreamConfig.k_step
    chunk = (k % StreamConfig.k_step) // 8
    return tile_base + (Int64(step) * Int64(tokens) + Int64(row)) * RING_PITCH + Int64(chunk_position(chunk) * 16)


def launch_grid(tiles, n_tiles, k_split, c: StreamConfig) -> tuple:
    """A streaming GEMM's grid over (routing tile, weight tile, K range). A ring_tokens GEMM runs a routing tile's
    weight tiles next to each other (weight tile fastest), so its token slabs (x copied once a routed row: 8x x's
    bytes at top_k 8) are read while they are still in L2; block_coords reads the CTA's place back."""
    return (n_tiles, tiles, k_split) if c.ring_tokens else (tiles, n_tiles, k_split)


def block_coords(c: StreamConfig) -> tuple:
    """(routing tile, weight tile, K range inside the cluster) of this CTA in a launch_grid grid."""
    x, y, rank = cute.arch.block_idx()
    return (y, x, rank) if c.ring_tokens else (x, y, rank)


class FirstCopies(NamedTuple):
    """issue_first_copies' arguments: stage_first_chunk issues them around its token loads and stores."""

    sm: object
    tid: object
    src: object
    first: object
    steps: object
    num_stages: object
    block: int
    cfg: StreamConfig
    trace: object
    skip: object = None  # stages issued before a TokensReady wait (run time), or None


def chunk_tasks(tokens: int, c: StreamConfig, live: int) -> int:
    """8-value chunks each thread stages per K-chunk of the first `live` token rows."""
    return live * k_chunk(tokens, c) // 8 // c.threads


@cute.jit
def accumulate(sm, tid, w_sf, w_map, expert, first_row, rows_per_expert, k_extent, rank, k_split,
               live_rows, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
               load_group: cutlass.Constexpr, cluster_reduce: cutlass.Constexpr = True,
               trace: cutlass.Constexpr = None, ready: cutlass.Constexpr = None):
    """The mainloop of one CTA over weight rows [first_row, first_row + cfg.rows) of `expert` in a 4-bit weight
    (scales `w_sf`; `w_map` from weight_map): leaves its accumulator
    tile (summed over K slices, and on cluster rank 0 over the cluster's ranks) in sm.out. `load_group(r, k,
    k_end)` returns the 8 tile-order bf16x2 registers of token row r at K = k and whether they are valid (the
    kernel's gather and decode of its activations), or a TokenLoads or LoadsFirst (their docstrings).

    The k_split CTAs of a cluster take contiguous runs of K steps; inside a CTA, K slice `part` takes every
    k_slices-th step of the run: its j-th step is first + j * k_slices + part. `live_rows`: the tile's token rows
    that are not padding; the narrowest mainloop width that holds them runs (mainloop_widths). Without
    `cluster_reduce` each CTA keeps its own K range's partial tile (the caller reduces them: decode_fused.py).
    `trace(tid, event)`, if given, runs in every thread after the run's first token staging (event 0), once its
    first group of stages has landed (event 1), after its first weight copies were issued (2) and, for a
    LoadsFirst group, once the thread's first loads are in and stored (3): timeline marks (decode_fused.py's
    timeline build; the forms that wait a group of stages at a time). `ready`, a TokensReady or None: a wait
    before the token loads.
    """
    fill_scale_lut(sm, tid, block)  # read after the first staging barrier below
    acc = cute.make_rmem_tensor((accumulator_size(tokens, cfg),), Float32)
    acc.fill(0.0)
    first, steps = k_range(k_extent // cfg.k_step, rank, k_split)
    k_end = (first + steps) * cfg.k_step
    part = tid // (cfg.threads // cfg.k_slices)

    loop_args = (sm, tid, w_sf, w_map, expert, first_row, rows_per_expert, k_extent, first, steps, k_end,
                 part, acc, tokens, cfg, block, load_group)

    narrowest_mainloop(tma_mainloop, loop_args, live_rows, mainloop_widths(tokens, cfg), (trace, ready))
    if cutlass.const_expr(cfg.mma == "wgmma_async"):
        ptx.wgmma_wait(0)
    cute.arch.sync_threads()
    for sl in cutlass.range_constexpr(cfg.k_slices):
        if part == sl:
            store_accumulators(sm, tid, acc, tokens, cfg, add=sl > 0)
        cute.arch.sync_threads()
    if cutlass.const_expr(cluster_reduce):
        # Cluster split-K: rank 0 adds the other ranks' tiles in rank order; they wait until it has read them. A
        # cluster of one skips the barriers: their release fence stalled every warp (ncu, gpt-oss-120b T=256 on
        # (16,1,1): 11-13% of both GEMMs' stall samples at the two arrives and waits).
        if k_split > 1:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if rank == 0:
                for peer in cutlass.range(1, k_split):
                    add_peer_accumulators(sm, tid, peer, tokens, cfg)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()


@cute.jit
def narrowest_mainloop(mainloop: cutlass.Constexpr, loop_args: tuple, live_rows, widths: cutlass.Constexpr,
                       after: cutlass.Constexpr = ()):
    """mainloop(*loop_args, width, *after) at the narrowest of `widths` that holds the live rows (tma_mainloop, or
    persistent.item_mainloop), through a tree of comparisons on the CTA-uniform row count (an expert's rows past
    this tile take the full width). The same four widths chosen by equality on a computed index ran 1.33x slower
    than halves on the H200 (session 18), its loops full of R2UR moves the halves' lacked."""
    if cutlass.const_expr(len(widths) == 1):
        mainloop(*loop_args, widths[0], *after)
    else:
        half = len(widths) // 2
        if live_rows <= widths[half - 1]:
            narrowest_mainloop(mainloop, loop_args, live_rows, widths[:half], after)
        else:
            narrowest_mainloop(mainloop, loop_args, live_rows, widths[half:], after)


def task_position(tid, m: int, threads: int, per_row: int):
    """(row, item) of task tid + m * threads over rows of `per_row` items (token staging's 8-value chunks, the GEMM1
    epilogue's column groups). Where threads and rows divide evenly the task's constant part is split at trace time:
    a thread's addresses then differ by immediate offsets instead of holding one register per task (under three
    CTAs' 80-register cap the 32-token tile's 8 staging addresses spilled one)."""
    if threads % per_row == 0:
        return tid // per_row + m * (threads // per_row), tid % per_row
    if per_row % threads == 0:
        return (m * threads) // per_row, tid + (m * threads) % per_row
    task = tid + m * threads
    return task // per_row, task % per_row


@cute.jit
def stage_tokens(sm, tid, first, k_run, k_end, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr,
                 load_group: cutlass.Constexpr, live: cutlass.Constexpr):
    """Stage the K-chunk at k_run (inside the run starting at step `first`) of the first `live` token rows,
    decoded to bf16, in the tile order, between two CTA barriers."""
    if cutlass.const_expr(cfg.mma == "wgmma_async"):
        ptx.wgmma_wait(0)  # the last steps' wgmmas still read the tile this staging overwrites
    cute.arch.sync_threads()
    if cutlass.const_expr(isinstance(load_group, LoadsFirst)):
        store_loaded(sm, load_chunk(tid, first, k_run, k_end, tokens, cfg, load_group.load, live), tokens, cfg,
                     load_group.decode)
    elif cutlass.const_expr(isinstance(load_group, TokenLoads)):
        if load_group.unrolled_when:
            store_loaded(sm, load_chunk(tid, first, k_run, k_end, tokens, cfg, load_group.unrolled, live), tokens, cfg)
        else:
            for m in cutlass.range(chunk_tasks(tokens, cfg, live), unroll=1):
                stage_task(sm, tid, m, first, k_run, k_end, tokens, cfg, load_group.looped)
    else:
        for m in cutlass.range_constexpr(chunk_tasks(tokens, cfg, live)):
            stage_task(sm, tid, m, first, k_run, k_end, tokens, cfg, load_group)
    if cutlass.const_expr(cfg.mma != "sync"):
        ptx.fence_proxy_async_shared()  # the tile is read by wgmma (async proxy)
    cute.arch.sync_threads()


def load_chunk(tid, first, k_run, k_end, tokens: int, cfg: StreamConfig, load_group, live: int) -> list:
    """A K-chunk's staging tasks, loaded (load_task's tuples), every load before any store: a task's row map read
    (shared memory) may not pass the previous task's store to the tile (shared too), so staged task by task they
    chain one global load latency each (3.5 us for decode_fused's 8 at T=1)."""
    return [load_task(tid, m, first, k_run, k_end, tokens, cfg, load_group)
            for m in range(chunk_tasks(tokens, cfg, live))]


def store_loaded(sm, loaded: list, tokens: int, cfg: StreamConfig, decode=None) -> None:
    """Stores load_chunk's tasks (row-order bf16 words, or what `decode` takes) in the tile order: converted here,
    not as they are loaded, where ptxas would put the conversion, the loads' first use, ahead of the first copies'
    issue."""
    for r, c, values, valid in loaded:
        store_chunk(sm, r, c, (bf16x8_to_tile if decode is None else decode)(values), valid, tokens, cfg)


def load_task(tid, m, first, k_run, k_end, tokens: int, cfg: StreamConfig, load_group) -> tuple:
    """Task m of a K-chunk's staging, loaded: its row and 8-value chunk, the values and whether they are valid."""
    r, c = task_position(tid, m, cfg.threads, k_chunk(tokens, cfg) // 8)
    return (r, c, *load_group(r, first * cfg.k_step + k_run + c * 8, k_end))


def stage_task(sm, tid, m, first, k_run, k_end, tokens: int, cfg: StreamConfig, load_group) -> None:
    """Task m of a K-chunk's staging: one 8-value chunk of one token row."""
    store_chunk(sm, *load_task(tid, m, first, k_run, k_end, tokens, cfg, load_group), tokens, cfg)


class TmaSource(NamedTuple):
    """Where a CTA's TMA stages come from: the weight boxes (rows [first_row, first_row + rows) of `expert` through
    the descriptor at `w_map`, one 128-K step a box) and the global address of its scale tiles at K = 0 (128 rows of
    the 128x4 layout are one tile row, so each step's scales are sf_step_bytes contiguous bytes, and consecutive
    steps are consecutive)."""

    w_map: Int64  # the descriptor's generic address
    expert: Int32
    first_row: Int32
    scales: Int64
    token_slab: Int64 = None  # ring_tokens: the routing tile's slab of step 0 (TokenSlabs.tile_base)
    token_rows: Int32 = None  # ring_tokens: the live rows a stage copies (at most the mainloop's width)


@cute.jit
def issue_tma_stage(sm: Smem, lane, src: TmaSource, first, stage, steps, block: cutlass.Constexpr,
                    c: cutlass.Constexpr):
    """One warp starts the copies of stage `stage` (steps [stage * k_slices, ...) of the run starting at step
    `first`, as many as the run still has) into slot stage % stages: lane 0 announces their bytes on the slot's
    full barrier and copies the scale tiles, the weight boxes and, with ring_tokens, the step's token slab."""
    slot = stage % c.stages
    bar = sm.full + slot
    n = cute.math.min(c.k_slices, steps - stage * c.k_slices)
    step = first + stage * c.k_slices
    if lane == 0:
        token_bytes = 0
        if cutlass.const_expr(c.ring_tokens):
            token_bytes = src.token_rows * RING_PITCH
        cute.arch.mbarrier_arrive_and_expect_tx(bar, n * (c.rows * 64 + sf_step_bytes(block)) + token_bytes)
        ptx.cp_async_bulk(sm.scales + slot * (c.k_slices * 1024), src.scales + Int64(step) * sf_step_bytes(block),
                          n * sf_step_bytes(block), bar.toint())
        for u in cutlass.range_constexpr(c.k_slices):
            if u < n:
                ptx.tma_load_3d(sm.weights + (slot * c.k_slices + u) * (c.rows * 64), src.w_map,
                                (step + u) * 64, src.first_row, src.expert, bar.toint())
        if cutlass.const_expr(c.ring_tokens):
            ptx.cp_async_bulk(sm.tokens + slot * sm.token_slot, src.token_slab + Int64(step) * sm.token_slot,
                              token_bytes, bar.toint())


def address_of(t) -> Int64:
    """The global address of a weight's scales (a tensor) or TMA descriptor (a TensorMap), or `t` itself where the
    caller already chose one (decode_fused.py runs one mainloop for both GEMMs)."""
    if isinstance(t, Int64):
        return t
    return t.iterator.toint() if isinstance(t, cute.Tensor) else t.get_ptr().toint()


@cute.jit
def tma_mainloop(sm, tid, w_sf, w_map, expert, first_row, rows_per_expert, k_extent, first, steps, k_end,
                 part, acc: cute.Tensor, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
                 load_group: cutlass.Constexpr, live: cutlass.Constexpr, trace: cutlass.Constexpr = None,
                 ready: cutlass.Constexpr = None):
    """Stages of k_slices 128-K steps (K slice `part` reads step `part` of each) arrive by TMA: one box per step
    and one bulk copy of its scale tiles, counted on the stage's full barrier. No warp waits for a producer: every
    warp releases a stage it has read on the stage's empty barrier, and warp 0 refills the slot at its next stage
    (refill_tma_stage)."""
    chunk = k_chunk(tokens, cfg)
    src = TmaSource(address_of(w_map), expert, first_row, address_of(w_sf) + Int64(
        swizzled_sf_offset(expert, first_row, 0, rows_per_expert, k_extent // block)))
    num_stages = (steps + cfg.k_slices - 1) // cfg.k_slices
    place = step_place(sm, tid, cfg, block)
    if tid == 0:
        ptx.prefetch_tensormap(src.w_map)
        for s in cutlass.range_constexpr(cfg.stages):
            cute.arch.mbarrier_init(sm.full + s, 1)
            cute.arch.mbarrier_init(sm.empty + s, cfg.warps * cfg.k_slices)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    if cutlass.const_expr(cfg.ring_tokens):
        assert isinstance(load_group, TokenSlabs) and cfg.k_slices == 1 and trace is None and ready is None
        src = src._replace(token_slab=load_group.tile_base, token_rows=cute.math.min(load_group.rows, live))
        issue_first_copies(sm, tid, src, first, steps, num_stages, block, cfg)
    else:
        copies = FirstCopies(sm, tid, src, first, steps, num_stages, block, cfg, trace)
        if cutlass.const_expr(ready is not None):
            copies = copies._replace(skip=copies_before_wait(copies, ready))
        if cutlass.const_expr(isinstance(load_group, LoadsFirst)):
            # The first group of stages, then the rest once the tokens are stored: the whole grid's first groups go
            # ahead of its later stages in the memory queues, so they land sooner.
            held_back = cfg.stages_per_wait if cfg.stages_per_wait > 1 else cfg.stages
            stage_first_chunk(copies, k_end, tokens, load_group, live, held_back)
        elif cutlass.const_expr(isinstance(load_group, TokenLoads)):
            if load_group.unrolled_when:
                stage_first_chunk(copies, k_end, tokens, LoadsFirst(load_group.unrolled), live, cfg.stages)
            else:
                issue_first_copies(*copies)
        else:
            issue_first_copies(*copies)
    first_single = 0  # the stages taken one at a time: all of them, or those after the whole groups
    if cutlass.const_expr(cfg.stages_per_wait > 1):
        # Groups of stages_per_wait whole stages: every wait first, then the consumptions with no branch between
        # them (the scheduler can interleave their decode chains), then the releases.
        per_group = cfg.stages_per_wait
        assert (chunk // (cfg.k_slices * cfg.k_step)) % per_group == 0 and cfg.stages > per_group
        groups = steps // (cfg.k_slices * per_group)
        first_group = 0  # the groups taken by the generic loop below: all, or those after the whole ring passes
        if cutlass.const_expr(cfg.unroll_ring):
            ring = cfg.stages // per_group  # groups a pass over the ring
            assert ring * per_group == cfg.stages, "a pass over the ring is whole groups"
            passes = groups // ring
            for r in cutlass.range(passes):
                for h in cutlass.range_constexpr(ring):
                    group_step(sm, tid, place, src, first, r * ring + h, h * per_group, r % 2, steps, k_end,
                               num_stages, part, acc, tokens, cfg, block, load_group, live, trace)
            first_group = passes * ring
        for g in cutlass.range(first_group, groups):
            group_step(sm, tid, place, src, first, g, None, None, steps, k_end, num_stages, part, acc, tokens, cfg,
                       block, load_group, live, trace)
        first_single = groups * per_group
        if tid < 32 and groups > 0:  # the last group's stages but its last (the loop below refills that one)
            for u in cutlass.range_constexpr(per_group - 1):
                refill_tma_stage(sm, tid, src, first, first_single - per_group + u, num_stages, steps, block, cfg)
    for i in cutlass.range(first_single, num_stages):
        if tid < 32 and i > 0:  # warp 0 refills the previous stage's slot once every warp has read it
            refill_tma_stage(sm, tid, src, first, i - 1, num_stages, steps, block, cfg)
        k_run = i * cfg.k_slices * cfg.k_step
        in_chunk = k_run & (chunk - 1)  # k_run >= 0 and chunk a power of two: one AND, not a signed remainder
        if cutlass.const_expr(not cfg.ring_tokens):
            if restages(k_run, chunk, load_group):
                stage_tokens(sm, tid, first, k_run, k_end, tokens, cfg, load_group, live)
        consume_tma_stage(sm, place, i, in_chunk, part, steps, acc, tokens, block, cfg, live)
        release_tma_stage(sm, tid, i, cfg)


@cute.jit
def issue_first_copies(sm, tid, src, first, steps, num_stages, block: cutlass.Constexpr, cfg: cutlass.Constexpr,
                       trace: cutlass.Constexpr = None, skip=None, start: cutlass.Constexpr = 0,
                       stop: cutlass.Constexpr = None):
    """Warp 0 issues the run's first stages `start` to `stop` (default: as many as the ring holds), but those below
    `skip` (run time, or None: none), which went out before a TokensReady wait."""
    if tid < 32:
        for s in cutlass.range_constexpr(start, cfg.stages if stop is None else stop):
            if cutlass.const_expr(skip is None):
                if s < num_stages:
                    issue_tma_stage(sm, tid, src, first, s, steps, block, cfg)
            else:
                if (s < num_stages) & (skip <= s):
                    issue_tma_stage(sm, tid, src, first, s, steps, block, cfg)
    if cutlass.const_expr(trace is not None and start == 0):
        if cutlass.const_expr(skip is None):
            trace(tid, 2)
        else:
            if skip == 0:  # else the issue before the wait was the first
                trace(tid, 2)


@cute.jit
def copies_before_wait(copies: FirstCopies, ready: TokensReady) -> Int32:
    """Where ready.when holds, the run's first ready.stages copies, then ready's wait; the stages it issued."""
    wait, args = ready.wait, ready.args  # called as ready.wait(...) the tuple would count as changed by the branch
    if ready.when:
        issue_first_copies(*copies, 0, ready.stages)
        wait(copies.tid, *args)
    return Int32(cutlass.select_(ready.when, Int32(ready.stages), Int32(0)))


@cute.jit
def stage_first_chunk(copies: FirstCopies, k_end, tokens: cutlass.Constexpr, loads, live: cutlass.Constexpr,
                      held_back: cutlass.Constexpr):
    """The run's first token chunk with its loads issued ahead of its first weight copies (issue_first_copies'
    arguments `copies`), stored after them: loads issued after the copies queue behind the whole grid's first
    boxes (3.5-5 us an item at T=1, 0.7-1.8 ahead of them). Copies from stage `held_back` on wait until the tokens
    are stored (session 40, H100: 0.4-0.7 us faster at the fc2_by_gemm1 forms' points)."""
    sm, tid, first, cfg, trace = copies.sm, copies.tid, copies.first, copies.cfg, copies.trace
    loaded = load_chunk(tid, first, 0, k_end, tokens, cfg, loads.load, live)
    issue_first_copies(*copies, 0, held_back)
    store_loaded(sm, loaded, tokens, cfg, loads.decode)
    if cutlass.const_expr(trace is not None):
        trace(tid, 3)
    if cutlass.const_expr(held_back < cfg.stages):
        issue_first_copies(*copies, held_back, cfg.stages)
    cute.arch.sync_threads()


def restages(k_run, chunk: int, load_group):
    """Whether the step at k_run starts a K-chunk the mainloop stages: not a LoadsFirst group's first chunk, nor a
    TokenLoads group's where its unrolled load runs (stage_first_chunk staged those before the first copies)."""
    starts = k_run & (chunk - 1) == 0
    if isinstance(load_group, LoadsFirst):
        return starts & (k_run > 0)
    if isinstance(load_group, TokenLoads):
        return starts & ((k_run > 0) | (Int32(load_group.unrolled_when) == 0))
    return starts


@cute.jit
def group_step(sm: Smem, tid, place: StepPlace, src, first, g, first_slot, phase, steps, k_end, num_stages, part,
               acc: cute.Tensor, tokens: cutlass.Constexpr, cfg: cutlass.Constexpr, block: cutlass.Constexpr,
               load_group: cutlass.Constexpr, live: cutlass.Constexpr, trace: cutlass.Constexpr = None):
    """Group `g` of stages_per_wait whole stages: warp 0 refills the previous group's slots, every wait first, then
    the consumptions with no branch between them (the scheduler can interleave their decode chains), then the
    releases. `first_slot` and `phase`: the group's first ring slot (a constant) and its barriers' phase where the
    caller knows them, else None (taken from g)."""
    per_group = cfg.stages_per_wait
    chunk = k_chunk(tokens, cfg)
    if tid < 32 and g > 0:
        for u in cutlass.range_constexpr(per_group):
            refill_tma_stage(sm, tid, src, first, (g - 1) * per_group + u, num_stages, steps, block, cfg)
    k_run = g * per_group * cfg.k_slices * cfg.k_step
    if cutlass.const_expr(not cfg.ring_tokens):
        if restages(k_run, chunk, load_group):
            stage_tokens(sm, tid, first, k_run, k_end, tokens, cfg, load_group, live)
    if cutlass.const_expr(trace is not None):
        if g == 0:
            trace(tid, 0)
    known = first_slot is not None
    stages = [first_slot + u if known else g * per_group + u for u in range(per_group)]  # slots where known
    for u in cutlass.range_constexpr(per_group):
        if cutlass.const_expr(known):
            cute.arch.mbarrier_wait(sm.full + stages[u], phase)
        else:
            cute.arch.mbarrier_wait(sm.full + stages[u] % cfg.stages, (stages[u] // cfg.stages) % 2)
    if cutlass.const_expr(trace is not None):
        if g == 0:
            trace(tid, 1)
    for u in cutlass.range_constexpr(per_group):
        consume_tma_stage(sm, place, stages[u], (k_run + u * cfg.k_slices * cfg.k_step) & (chunk - 1), part, steps,
                          acc, tokens, block, cfg, live, wait=False, check=False)
    for u in cutlass.range_constexpr(per_group):
        release_tma_stage(sm, tid, stages[u], cfg)


@cute.jit
def consume_tma_stage(sm: Smem, place: StepPlace, stage, chunk_offset, part, steps, acc: cute.Tensor,
                      tokens: cutlass.Constexpr, block: cutlass.Constexpr, c: cutlass.Constexpr,
                      live: cutlass.Constexpr, wait: cutlass.Constexpr = True, check: cutlass.Constexpr = True):
    """Wait for stage `stage` (unless the caller did) and consume this K slice's step of it, if the run has that
    step (`check`: only a run's last stage can lack one); `chunk_offset`: the stage's K offset inside the staged
    token chunk; the MMAs cover the first `live` tokens."""
    slot = stage % c.stages
    if cutlass.const_expr(wait):
        cute.arch.mbarrier_wait(sm.full + slot, (stage // c.stages) & 1)
    scales = sm.scales + slot * (c.k_slices * 1024) + part * sf_step_bytes(block)
    tile_offset = (chunk_offset + part * c.k_step) * 2
    if cutlass.const_expr(c.ring_tokens):
        tile_offset = slot * sm.token_slot
    step_args = (sm, place, slot * c.k_slices + part, scales, tile_offset, acc, tokens, block, c, live)
    if cutlass.const_expr(check):
        if stage * c.k_slices + part < steps:
            consume_tma_step(*step_args)
    else:
        consume_tma_step(*step_args)


@cute.jit
def release_tma_stage(sm: Smem, tid, stage, c: cutlass.Constexpr):
    """This warp is done reading stage `stage`: lane 0 arrives on the slot's empty barrier (its release orders the
    warp's reads, which sync_warp gathered, before the refill that waits on the barrier)."""
    cute.arch.sync_warp()
    if tid % 32 == 0:
        cute.arch.mbarrier_arrive(sm.empty + stage % c.stages)


@cute.jit
def refill_tma_stage(sm: Smem, lane, src: TmaSource, first, stage, num_stages, steps, block: cutlass.Constexpr,
                     c: cutlass.Constexpr):
    """Warp 0 refills the slot of stage `stage` with stage `stage + stages`, if the run has it, once every warp has
    released it. Warp 0 asks one stage after its own release, when the others have nearly always released too, so
    the wait costs no more than the atomic counter it replaced (whose last warp refilled: an acquire-release atomic
    and a warp-aggregation sequence in every warp's step); the proxy fence orders the warps' reads, acquired
    through the barrier, before the copy engine's writes."""
    if stage + c.stages < num_stages:
        cute.arch.mbarrier_wait(sm.empty + stage % c.stages, (stage // c.stages) % 2)
        ptx.fence_proxy_async_shared()
        issue_tma_stage(sm, lane, src, first, stage + c.stages, steps, block, c)
