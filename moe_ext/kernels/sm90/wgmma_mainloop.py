"""Warp-specialised wgmma mainloop (sm_90a) for large token counts, register-A form: 4-bit weights decoded by the
consumers straight into the wgmma's register A operand, gathered bf16 token rows as B from shared memory, fp32
accumulators.

CTA tile: 128 weight rows (the wgmma M side, two consumer warpgroups of 64) x 32, 64, 128, 144 or 256 routed token
rows (one routing tile of one local expert, in blocks of up to 144: one wgmma N each) x all of K in stages of 64,
`stages` deep. A 256-row tile decodes each weight stage once for both blocks (twice the MMA per decode
instruction); 32- and 64-row tiles cut the MMA of a 128-row one where experts have fewer rows (no padding token
rows multiplied for nothing), for the same decode.
Persistent: `ctas` CTAs (one per SM) loop over the work items (routing tile, column tile); each role carries its
ring states from one item to the next, so the copier fills the next item's stages while the consumers run this
item's epilogue out of their own s_c.
384 threads, two roles:

  warpgroup 0, copier (setmaxnreg down)
    tokens: 16-byte cp.async of the rows `a_row_offset(m)` names (the kernel's gather) into the swizzled token
       stage, then cp.async.mbarrier.arrive.noinc on the stage's `copied` barrier (lands with the copies).
    weights: warp 0 copies the stage's raw weights as one TMA box (128 rows x 32 code bytes) and the 512-byte
       scale atom of the 128x4 layout as one bulk copy, both completing on the same barrier (its one expect_tx
       arrival). The copier never waits for its own copies and runs up to `stages` ahead.
  warpgroups 1-2, consumers (setmaxnreg up)
    wait for `copied`; each thread reads 8 contiguous code bytes and one scale byte of each of its two weight rows
    from the slot and decodes them into the mma fragment it owns, in one of two register buffers: one bf16
    multiply per e2m1 pair, by a shared table entry bf16x2(scale * 2^63), exact (the accumulators hold the
    products times 2^-63); each decoded pair is an A register as it is, because the token operands are stored in
    the matching K order (K_GROUP, stage_position); wgmma m64n128k16 RS per k16 block; then retire the previous
    stage's wgmmas (wait_group 1), which frees the other register buffer and the previous stage's slot.

Against the shared-memory form it replaced (a decoder warpgroup storing decoded weights to shared memory for SS
wgmmas): no decoded sB round trip, no proxy fence, and each stage moves about 57 KB of shared memory instead of
89 KB. The decode issues from the consumer warps (115 SASS instructions per thread and stage of 128 weight rows
since the token K order of session 24, which ran 1.18-1.24x faster than the plain order's 157: those picked each
lane's bytes, scales and fragment halves with 34 prmt and 8 more shared loads; 171 before the mask-multiply-mask
e2m1 decode of session 16), overlapping the previous stage's wgmmas. Measured at T = 4096 on five shapes
(benchmarks/results/h200_session12_checks.md): GEMM1 1.11-1.22x and GEMM2 1.15-1.21x faster than the shared-memory
form; the same register-A form with the shared-memory form's decode (block scales decoded in registers, 253 SASS a
stage) ran 0.96-1.05x: the consumers' decode instructions, not shared memory, bound it. Scale range: exact for every e4m3 scale and ue8m0 scales in
[2^-62, 2^64], as the streaming kernels (stream.py).
"""
# (no `from __future__ import annotations`: cute.struct reads its annotations as live objects)
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.tensor_utils import LayoutEnum

from . import ptx
from .fp4 import swizzled_sf_offset
from .stream import TWO_P63, expert_weight_view, scale_table_entry

WARPGROUP = 128
# The decode multiplies each e2m1 pair once, by a table entry bf16x2(scale * 2^63) (stream.scale_table_entry), so
# the accumulators hold the products times 2^-63; the epilogues multiply by this (exact: a power of two).
ACCUMULATOR_SCALE = TWO_P63
COPIER, FIRST_CONSUMER = 0, 1  # warpgroups
CONSUMERS = 256
# Token rows of one wgmma N and one s_c pass (at most; a 32- or 64-row routing tile is one block, WgmmaConfig.
# token_block); a 256-row routing tile is two such blocks sharing each decoded weight fragment (two m64n128k16 per
# k16 block), so a stage's decode feeds twice the MMA.
TOKEN_BLOCK = 128
# Weight rows of one register A operand (two consumer warpgroups of 64) and of one s_c pass; a 256-row weight tile
# is two such halves sharing each token stage (two m64n128k16 per k16 block with different A), so a stage's token
# rows feed twice the MMA.
WEIGHT_HALF = 128
SM_SHARED_BYTES = 228 * 1024  # shared memory of a Hopper SM; each resident CTA reserves 1 KB of it
MAX_SHARED_BYTES = SM_SHARED_BYTES - 1024  # opt-in dynamic shared memory of a Hopper CTA (227 KB)
# Token rows of one wgmma N beyond a 128-row block: a routing tile of this many rows is one block (m64n144k16), for
# experts that average a little under 128 rows (DeepSeek-V3 at T=4096: 128 +- 11), where 128-row tiles spend a
# second, mostly padding, tile on about half of them (useful rows 0.67 of those multiplied; 144: 0.83).
PADDED_TILE = 144
TILES = (32, 64, 128, PADDED_TILE, 256)  # the routing tiles the wgmma GEMMs are built for
# (routing tile, weight rows) of every wgmma GEMM built: at most two accumulators (blocks x halves) fit the registers
SHAPES = ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128), (256, 128), (128, 256), (PADDED_TILE, 128))
# ... and the GEMM2 only ones (config_for_tile): its token stages come by TMA, so its copier needs few registers
GEMM2_SHAPES = SHAPES + ((PADDED_TILE, 256),)


# K order of the wgmma GEMMs' bf16 operands. The order of K inside an MMA is free as long as both operands agree,
# so the consumers give lane q (lane % 4) of a quad the 8 contiguous code bytes of K [16 q, 16 q + 16) of each
# 64-K stage (one load a row, one block scale a row) and use each decoded pair, codes (j, j + 4) of a word, as an
# A fragment register as it is. The token operands (GEMM1's x, GEMM2's FC2 input) are stored in the same order:
# offset o = 16 q + 8 p + 4 e + j of each 64-value group of a row sits at stage_position(o) = 16 j + 8 p + 2 q + e
# (wgmma k16 block j, its half p, lane q's pair, element e). The routing launch writes x that way and the wgmma
# GEMM1 the FC2 input, for the wgmma GEMMs only (the streaming kernels read plain rows).
K_GROUP = 64


def stage_position(offset: int) -> int:
    """Where offset `offset` (0..63) of a 64-value group of a row sits in the wgmma GEMMs' token K order."""
    q, rest = divmod(offset, 16)
    p, rest = divmod(rest, 8)
    e, j = divmod(rest, 4)
    return 16 * j + 8 * p + 2 * q + e


def write_k_permuted(group_addr: Int64, words: list, first) -> None:
    """Store bf16 values of a 64-value row group in stage_position order: `words` are bf16x2 words of offsets
    [first, first + 2 len(words)) in plain order (pairs (o, o + 1)), one, two (aligned) or four 16-offset quarters.
    Each position pair (o, o + 4) is one prmt of two words; the pairs of the quarters of one k16 half are adjacent:
    16-byte stores for a whole group, 8-byte ones for half, 4-byte ones for a quarter (whose `first` may be a
    run-time value)."""
    quarters = len(words) // 8
    if quarters not in (1, 2, 4) or len(words) % 8:
        raise ValueError(f"write_k_permuted: {len(words)} words, expected 8, 16 or 32")
    for j in range(4):
        for p in range(2):
            # offsets (16 q + 8 p + j, + 4) of each quarter q: words 8 q + (8 p + j) // 2 and + 2
            run = [ptx.prmt(words[8 * q + (8 * p + j) // 2], words[8 * q + (8 * p + j + 4) // 2],
                            0x5410 if j % 2 == 0 else 0x7632) for q in range(quarters)]
            addr = group_addr + Int64(2 * stage_position(8 * p + j)) + Int64(4 * (first // 16))
            if quarters == 4:
                ptx.st_global_v4(addr, *run)
            elif quarters == 2:
                ptx.st_global_v2(addr, *run)
            else:
                ptx.st_global_b32(addr, run[0])


@dataclass(frozen=True)
class WgmmaConfig:
    bm: int = 128  # routed rows per CTA (= the routing tile): 32, 64, 128, PADDED_TILE or 256
    bn: int = 128  # weight rows per CTA: 128 or 256 (two halves)
    bk: int = 64  # K per stage: 128 bytes of bf16 = one 128B-swizzle row
    stages: int = 6  # token tile + raw weight ring depth (20.5 KB a stage)
    # Persistent CTAs, work items ctas apart. 132 = the SMs of an H100 SXM / H200 (one 214 KB CTA each); on a GPU
    # with fewer SMs the extra CTAs wait for a free SM.
    ctas: int = 132
    ctas_per_sm: int = 1  # 2: two CTAs share an SM (ctas = 264), each within half its registers and shared memory
    # fp32 padding of an s_c row (pitch 132 = 4 mod 32): the epilogue's 16-byte row reads by 8 consecutive rows
    # cover all 32 banks; the accumulator's 8-byte stores pay a 2-way conflict once per tile.
    pad: int = 4
    # setmaxnreg: 128 * copier_regs + 256 * consumer_regs <= 65536
    copier_regs: int = 40
    consumer_regs: int = 232
    sf_block: int = 16  # weight scale block: 16 (NVFP4, e4m3 scales) or 32 (MXFP4, ue8m0 scales)
    # Gathered token bytes a raster group of routing tiles may keep in L2 (a third of the H200's 50 MB): e.g. 8
    # tiles at K = 7168, 4 at K = 14336, 32 at K = 2048.
    group_bytes: int = 16 << 20
    # Token stages as TMA boxes (warp 0 of the copier, one 128 x bk box a block) instead of the copier's cp.async
    # gather: for token rows contiguous per routing tile (GEMM2's FC2 input, in permuted order).
    tma_tokens: bool = False
    # Zeros in the routing tile's padding rows: the copier zero-fills its padding token rows and GEMM1 stores its
    # padding FC2-input rows as zeros (GEMM2 loads them), so the wgmmas multiply zeros there. Zeros draw less power
    # than data, and prefill forwards run at the H200's power cap: DeepSeek-V3 T=4096 (128-token tiles, a third of
    # their rows padding) 1.02x, and on 64-token tiles at T=1024 DeepSeek-V3 1.04-1.05x, gpt-oss-120b 1.02-1.03x;
    # Mixtral T=4096 (256-token tiles, ~1/10 padding) 0.99x. The 64- and 128-token tiles take it (32-token ones,
    # for experts of 12-24 rows, not measured).
    zero_padding: bool = False

    @property
    def threads(self) -> int:
        return FIRST_CONSUMER * WARPGROUP + CONSUMERS

    @property
    def pitch(self) -> int:
        return WEIGHT_HALF + self.pad

    @property
    def token_block(self) -> int:
        """Token rows of one wgmma N (one s_c pass): the tile, or TOKEN_BLOCK-row blocks of a multiple of it."""
        return TOKEN_BLOCK if self.bm % TOKEN_BLOCK == 0 else self.bm

    @property
    def blocks(self) -> int:
        """Token blocks of token_block rows in the routing tile."""
        return self.bm // self.token_block

    @property
    def halves(self) -> int:
        """Weight halves of WEIGHT_HALF rows in the CTA's weight tile."""
        return self.bn // WEIGHT_HALF

    def check(self) -> None:
        assert self.bm in TILES and self.bn in (128, 256), "the thread mappings assume 32- to 144-row blocks"
        assert self.blocks * self.halves <= 2, "at most two 64 x 128 fp32 accumulators a consumer thread"
        assert self.bk == 64, "one stage must be one 4-block group of the 128x4 scale layout"
        assert self.stages >= 3, "the consumers hold up to two stages (wgmma wait_group(1))"
        assert self.sf_block in (16, 32), "NVFP4 (16) or MXFP4 (32) weights"
        regs = WARPGROUP * self.copier_regs + CONSUMERS * self.consumer_regs
        # setmaxnreg moves registers within the CTA's launch allocation (ptxas gives each thread the most that
        # min_blocks_per_mp = ctas_per_sm allows, in steps of 8: 168 of 384 threads at one CTA an SM, 80 at two):
        # an increase past it waits forever.
        launch = self.threads * (65536 // (self.ctas_per_sm * self.threads) // 8 * 8)
        assert regs <= launch, "registers the CTA gets at launch"
        assert self.shared_bytes <= self.max_shared_bytes, "shared memory: the launch would fail"

    @property
    def max_shared_bytes(self) -> int:
        """Shared memory a CTA may take with ctas_per_sm of them on an SM (MAX_SHARED_BYTES at one)."""
        return SM_SHARED_BYTES // self.ctas_per_sm - 1024

    @property
    def shared_bytes(self) -> int:
        """The Storage struct's bytes (make_storage), alignment padding included."""
        up = lambda n, a: -(-n // a) * a  # noqa: E731
        n = 16 * self.stages  # copied / empty mbarriers
        n = up(n, 1024) + self.stages * self.bn * self.bk // 2  # raw codes
        n = up(n, 16) + self.stages * self.halves * 512 + 256 * 4  # raw scales, scale table
        n = up(n, 1024) + self.blocks * self.stages * self.token_block * self.bk * 2  # token blocks
        return up(n, 16) + self.token_block * self.pitch * 4  # s_c


DEFAULT = WgmmaConfig()


def config_for_tile(tile: int, sf_block: int, weight_rows: int = 128) -> WgmmaConfig:
    """The config of a routing tile and weight tile: a 256-row routing tile holds two token blocks a stage (36.5 KB:
    4 stages with s_c) and two accumulators (setmaxnreg 56 / 224: the copier keeps 16 gather addresses); a 256-row
    weight tile two raw weight halves a stage (25 KB: 6 stages with s_c), two accumulators and two register A
    buffers a half. 32- and 64-row routing tiles have smaller stages (4 or 8 KB of tokens) and s_c: more stages
    keep more weight bytes in flight in the same shared memory."""
    if tile == 32 and weight_rows == 128:
        # Two CTAs an SM: four consumer warpgroups instead of two to hide the decode's latencies where the
        # single CTA issued from 1 eligible warp of 3 (Mixtral T=64); 104 consumer registers hold the one m64n32
        # accumulator (the 256-row form's two serialise its wgmmas at 104), 32 + 2 x 104 of 80 a thread at launch.
        # Whole forwards with the default tactics, against one CTA an SM: gpt-oss-120b T = 384-960 1.007-1.024x,
        # DeepSeek-V3 T = 384-960 and Mixtral T = 64-96 within 1.2% (h200_session32_checks.md).
        return WgmmaConfig(bm=32, bn=128, stages=11, sf_block=sf_block, ctas=264, ctas_per_sm=2,
                           copier_regs=32, consumer_regs=104)
    if tile in (32, 64):
        return WgmmaConfig(bm=tile, bn=weight_rows, stages=10 if tile == 32 else 8, sf_block=sf_block,
                           zero_padding=tile == 64)
    if tile == 256:
        assert weight_rows == 128, "two token blocks and two weight halves would need four accumulators"
        return WgmmaConfig(bm=256, stages=4, copier_regs=56, consumer_regs=224, sf_block=sf_block)
    if tile == PADDED_TILE and weight_rows == 256:
        # GEMM2 only (GEMM2_SHAPES): two m64n144 accumulators serialise every wgmma at 232 consumer registers; at 240
        # the copier keeps 24, too few for GEMM1's gather (its 9 row addresses spill in every stage) but enough for
        # GEMM2's TMA token boxes. 5 stages of 27 KB and the 76 KB s_c.
        return WgmmaConfig(bm=tile, bn=256, stages=5, sf_block=sf_block, copier_regs=24, consumer_regs=240)
    if tile == PADDED_TILE:  # 6 stages of 22.5 KB and the 76 KB s_c
        return WgmmaConfig(bm=tile, sf_block=sf_block, zero_padding=True)
    return WgmmaConfig(bn=weight_rows, sf_block=sf_block, zero_padding=True)


def make_tiled_mma(cfg: WgmmaConfig):
    """bf16 x bf16 -> fp32, swap-AB: A = weight rows from registers (M, two consumer warpgroups of 64 stacked),
    B = token rows from shared memory (N = bm), both K-major. Call inside a jit."""
    return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (2, 1, 1), tiler_mn=(64, cfg.token_block), a_source=OperandSource.RMEM)


def token_layout(cfg: WgmmaConfig):
    """128B-swizzled K-major stage layout of one token block (token_block rows x bk, the wgmma B operand),
    `stages` deep. Call inside a jit."""
    layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (WEIGHT_HALF, cfg.token_block, cfg.bk), BFloat16,
                                           cfg.stages)
    assert str(layout.inner) == "S<3,4,3>", "issue_token_stage swizzles its shared addresses by hand"
    return layout


def make_storage(cfg: WgmmaConfig, tok_layout):
    @cute.struct
    class Storage:
        copied_mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]  # copied[stages], empty[stages]
        # Raw weight slot of each stage as the TMA box lands: [stage][row] 32 code bytes, and the stage's 512-byte
        # scale atom of the 128x4 layout for each weight half (bulk copies): [stage][half].
        raw_codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cfg.stages * cfg.bn * cfg.bk // 2], 1024]
        raw_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cfg.stages * cfg.halves * 512], 16]
        scale_lut: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 256 * 4], 16]  # bf16x2 per scale byte
        tokens: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.blocks * cute.cosize(tok_layout)], 1024]
        sC: cute.struct.Align[cute.struct.MemRange[Float32, cfg.token_block * cfg.pitch], 16]  # one block a pass

    return Storage


def allocate(cfg: WgmmaConfig, tok_layout):
    """(token tile, s_c, raw code ring address, raw scale ring address, scale table address, copied): the CTA's
    shared memory and its pipeline; all threads call it. Kernels keep the pieces as separate locals (a runtime
    branch turns the Python ints inside a carried tuple into runtime values). `copied` counts the copier's 128
    cp.async arrivals and the one expect_tx arrival of the TMA bytes per stage; its empty side counts the 256
    consumer threads' releases.
    The token tile (bm, bk, stages) carries its swizzle in the pointer; s_c is fp32 (token_block, WEIGHT_HALF)
    [token][weight row] with row pitch cfg.pitch, the accumulator tile of one token block and weight half for the
    epilogue (its own memory: the
    ring already holds the next work item's stages while the epilogue reads it)."""
    st = cutlass.memory.SmemAllocator().allocate(make_storage(cfg, tok_layout))
    copied = pipeline.PipelineCpAsync.create(barrier_storage=st.copied_mbar.data_ptr(), num_stages=cfg.stages,
                                             producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                                      WARPGROUP + 1),
                                             consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                                      CONSUMERS))
    block = cute.cosize(tok_layout)  # elements; a multiple of the swizzle's 1024 bytes
    tokens = [cute.make_tensor(cute.recast_ptr(st.tokens.data_ptr() + b * block, tok_layout.inner, dtype=BFloat16),
                               tok_layout.outer) for b in range(cfg.blocks)]
    return (tokens,
            st.sC.get_tensor(cute.make_layout((cfg.token_block, WEIGHT_HALF), stride=(cfg.pitch, 1))),
            st.raw_codes.data_ptr().toint(), st.raw_scales.data_ptr().toint(), st.scale_lut.data_ptr().toint(),
            copied)


class Raster(NamedTuple):
    """The order of a GEMM's work items (routing tile, column tile): groups of `group` consecutive routing tiles,
    all column tiles of a group before the next, routing tile fastest inside it. The CTAs of one wave then share
    a few routing tiles' gathered token rows (`group` tiles of bm x K bf16, held in L2 across the group's column
    tiles) instead of reading each tile's rows from memory again at every column tile."""

    live: Int32  # routing tiles
    columns: Int32  # column tiles (rows_per_expert / bn)
    group: Int32  # routing tiles a group


def make_raster(cfg: WgmmaConfig, live, rows_per_expert, k_extent) -> Raster:
    group = cute.math.max(Int32(cfg.group_bytes) // (Int32(cfg.bm * 2) * k_extent), Int32(1))
    return Raster(live, rows_per_expert // cfg.bn, group)


def raster_position(w, live, columns, group, minimum):
    """(routing tile, column tile) of work item w in the raster order (Raster); plain arithmetic and `minimum`,
    so the host tests run it on ints."""
    first = (w // (group * columns)) * group
    size = minimum(group, live - first)  # the last group may be short
    index = w - first * columns
    return first + index % size, index // size


class WorkItem:
    """Work item w of a persistent CTA in `raster`'s order: its routing tile's expert, first row and row limit,
    and its column tile."""

    def __init__(self, cfg: WgmmaConfig, w, raster: Raster, tile_to_expert: cute.Tensor,
                 tile_to_mn_limit: cute.Tensor):
        tile, self.n_tile = raster_position(w, raster.live, raster.columns, raster.group, cute.math.min)
        self.expert = tile_to_expert[tile]
        self.limit = tile_to_mn_limit[tile]
        self.row0 = tile * cfg.bm


# ----------------------------------------------------------------------------------------------------------------
# Copier (warpgroup 0)
# ----------------------------------------------------------------------------------------------------------------
def token_copy_partition(cfg: WgmmaConfig, tokens, tid):
    """Thread t copies 16-byte chunk t % 8 of rows t // 8 + 16 i (i < token_block / 16) of each stage of one token
    block. Returns the cp.async atom, the block's partition ((8,1), token_block / 16, 1, stages) and the (m, k)
    coordinate of each chunk."""
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
    g2s = cute.make_tiled_copy_tv(cp_atom, cute.make_layout((WARPGROUP // 8, 8), stride=(8, 1)),
                                  cute.make_layout((1, 8))).get_slice(tid)
    return cp_atom, g2s.partition_D(tokens), g2s.partition_D(cute.make_identity_tensor((cfg.token_block, cfg.bk)))


def token_sources(tAcA, a_base: Int64, a_row_offset, live_rows=None):
    """Global address of each of this thread's token chunks at K = 0 (64-bit: T * H can pass 2^31), and with
    `live_rows` the bytes each copies: 16, or 0 (cp.async fills zeros) for a row at or past it (zero_padding)."""
    chunks = cute.size(tAcA, mode=[1])
    a_src = cute.make_rmem_tensor((chunks,), Int64)
    a_bytes = None if live_rows is None else cute.make_rmem_tensor((chunks,), Int32)
    for i in range(chunks):
        m, k = tAcA[(0, i, 0)]
        a_src[i] = a_base + a_row_offset(m) + Int64(k) * Int64(2)
        if live_rows is not None:
            a_bytes[i] = Int32(cutlass.select_(m < live_rows, Int32(16), Int32(0)))
    return a_src, a_bytes


def issue_token_stage(cfg: WgmmaConfig, cp_atom, tAsA, sources, kt, stage):
    """cp.async 16 bytes of each of this thread's token chunks of K stage kt into the token tile's `stage`
    (token_sources: with zero_padding, zeros for padding rows)."""
    a_src, a_bytes = sources
    k_bytes = Int64(kt) * Int64(cfg.bk * 2)
    for i in range(cute.size(tAsA, mode=[1])):
        if cutlass.const_expr(cfg.zero_padding):
            # cute.copy has no zero fill. toint() of a pointer with the token layout's 128-byte swizzle (S<3,4,3>
            # on byte addresses) is the unswizzled address; its loads and stores xor bits 7-9 into bits 4-6.
            addr = tAsA[(None, i, 0, stage)].iterator.toint()
            ptx.cp_async_16(addr ^ ((addr >> 3) & 0x70), a_src[i] + k_bytes, a_bytes[i])
        else:
            src = cute.make_tensor(cute.make_ptr(BFloat16, a_src[i] + k_bytes, cute.AddressSpace.gmem,
                                                 assumed_align=16), cute.make_layout(((8, 1),)))
            cute.copy(cp_atom, src, tAsA[(None, i, 0, stage)])


class RawRing:
    """Row `row` of weight half `half`, as lane `quad` (lane % 4) of its quad reads it: its 8 code bytes of a stage
    (K 16 quad .. 16 quad + 15 of the stage, one NVFP4 block or half an MXFP4 one) and its scale byte in the half's
    512-byte atom of the 128x4 layout (row r's 4-byte group at (r % 32) * 16 + (r // 32) * 4)."""

    def __init__(self, cfg: WgmmaConfig, codes_base: Int32, scales_base: Int32, row, quad, half: int = 0):
        self.slot_bytes = cfg.bn * cfg.bk // 2
        self.scale_slot_bytes = cfg.halves * 512
        self.sf_block = cfg.sf_block
        if half:  # a Python int: half 0 keeps the 128-row kernels' address arithmetic as it was
            codes_base = codes_base + half * WEIGHT_HALF * (cfg.bk // 2)
            scales_base = scales_base + half * 512
        self.codes = codes_base + row * (cfg.bk // 2) + quad * 8
        # NVFP4: the stage's 4 blocks are the group's 4 bytes; MXFP4: two stages share a group, 2 blocks each
        block = quad if cfg.sf_block == 16 else quad // 2
        self.scales = scales_base + (row % 32) * 16 + (row // 32) * 4 + block

    def codes_at(self, stage) -> Int32:
        return self.codes + stage * self.slot_bytes

    def scale_at(self, stage, kt) -> Int32:
        if cutlass.const_expr(self.sf_block == 32):
            return self.scales + stage * self.scale_slot_bytes + (kt % 2) * 2
        return self.scales + stage * self.scale_slot_bytes


def raw_weight_tma(cfg: WgmmaConfig, w: cute.Tensor, experts, rows_per_expert, k_extent):
    """The launch function's TMA atom and coordinate tensor for the raw weight boxes: one stage of a CTA's weight
    rows, (1 expert, bn rows, bk / 2 bytes), into a slot with bk / 2 bytes between rows."""
    box = (1, cfg.bn, cfg.bk // 2)
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                       expert_weight_view(w, experts, rows_per_expert, k_extent),
                                       cute.make_layout(box, stride=(cfg.bn * cfg.bk // 2, cfg.bk // 2, 1)), box)


def token_box_tma(cfg: WgmmaConfig, a: cute.Tensor, k_extent, tok_layout):
    """The launch function's TMA atom and coordinate tensor for token stages read as boxes (cfg.tma_tokens): `a` is
    flat bf16 [rows, k_extent], a box is (token_block rows, bk) in the token stage's 128B-swizzled layout. Rows
    past the end of `a` arrive as zeros; rows past a tile's valid ones are never stored."""
    view = cute.make_tensor(a.iterator, cute.make_layout((cute.size(a) // k_extent, k_extent), stride=(k_extent, 1)))
    # select, not slice_: CuTe-DSL 4.8.1 aborts slicing the stage mode off a 152-row block ((8, 19) row groups);
    # the objects of the shipped tiles build byte for byte the same either way.
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), view,
                                       cute.select(tok_layout, mode=[0, 1]), (cfg.token_block, cfg.bk))


@cute.jit
def issue_b_stage(cfg: cutlass.Constexpr, copied, fill, tma_atom, boxes, slots, sf_tiles: list, token_boxes: list,
                  kt, lane):
    """Warp 0 of the copier starts stage kt's weight copies into slot fill.index: lane 0 announces their bytes on
    the stage's `copied` barrier (its one extra arrival) and bulk-copies, for each weight half (`sf_tiles`: the
    half's first scale atom), the 512-byte scale atom that holds the stage's blocks (NVFP4: the 4 blocks of the
    stage; MXFP4: 2 stages share an atom, decode_a_stage picks the half); the box copies (weights, and with
    cfg.tma_tokens each token block's, `token_boxes`: (atom, smem partition, box partition, row tile)) elect their
    own lane, so the whole warp calls them."""
    bar = copied.producer_get_barrier(fill)
    stages_per_group = 4 * cfg.sf_block // cfg.bk
    token_bytes = cfg.blocks * cfg.token_block * cfg.bk * 2 if cfg.tma_tokens else 0
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(bar, cfg.bn * cfg.bk // 2 + cfg.halves * 512 + token_bytes)
        for h in cutlass.range_constexpr(cfg.halves):
            ptx.cp_async_bulk(slots.scales + (fill.index * cfg.halves + h) * 512,
                              sf_tiles[h] + Int64(kt // stages_per_group) * Int64(512), 512, bar.toint())
    cute.arch.sync_warp()
    cute.copy(tma_atom, boxes[None, kt], slots.codes[None, fill.index], tma_bar_ptr=bar)
    for atom, tAsA, tAgA, row_tile in token_boxes:
        cute.copy(atom, tAgA[(None, row_tile, kt)], tAsA[(None, fill.index)], tma_bar_ptr=bar)


class RawSlots(NamedTuple):
    """The shared side of the raw copies: the box slots as the TMA partition's destination, and the scale slots."""

    codes: cute.Tensor
    scales: Int32


def decode_a_stage(cfg: WgmmaConfig, ring: RawRing, ring8: RawRing, lut: Int32, a_words: cute.Tensor, first: int,
                   stage, kt):
    """Raw slot of K stage kt -> this thread's register A fragments of the stage's k16 blocks, in the permuted K
    order (token_k_order): a_words[first + 4 q + 2 p + r] is the bf16x2 of codes (q, q + 4) of word p of row
    (row, row + 8)[r]'s 8 code bytes (K 16 quad + 8 p + q and + 4 of the stage), each times its block scale and
    2^-63 (ACCUMULATOR_SCALE); one scale a row and stage, a table entry at `lut`."""
    for r, ring_row in enumerate((ring, ring8)):
        words = ptx.ld_shared_v2(ring_row.codes_at(stage))
        scale = ptx.ld_shared_b32(lut + ptx.ld_shared_u8(ring_row.scale_at(stage, kt)) * 4)
        for p, word in enumerate(words):
            for q, pair in enumerate(ptx.e2m1x8_to_bf16x2(word, scale)):
                a_words[first + 4 * q + 2 * p + r] = pair


@cute.jit
def copy_stages(cfg: cutlass.Constexpr, copied, tokens, raw_codes: Int32, raw_scales: Int32, tid, a_base: Int64,
                a_row_offset: cutlass.Constexpr, token_tma, first_token_row, token_limit, tma_atom, tma_w, w_sf,
                expert, first_row, rows_per_expert, k_extent, fill):
    """The copier over all K stages of one work item, from ring state `fill` (returned advanced). A row m of the
    token tile starts `a_row_offset(m)` bytes past `a_base` (bf16, 16-byte aligned rows; with cfg.zero_padding
    rows from token_limit - first_token_row on are zeros), or with cfg.tma_tokens is row first_token_row + m of
    `token_tma` (token_box_tma's atom and tensor); the weight rows are [first_row, first_row + bn) of `expert` in
    the 4-bit `w` of `rows_per_expert` rows and K = k_extent, block scales `w_sf` (cfg.sf_block). The copier waits
    for its last copies once, after its last item."""
    blocks = []  # (cp.async atom, block partition, token_sources) of each token block the copier gathers
    token_boxes = []  # (TMA atom, smem partition, box partition, row tile) of each token block warp 0 loads
    for b in cutlass.range_constexpr(cfg.blocks):
        if cutlass.const_expr(cfg.tma_tokens):
            atom, tensor = token_tma
            tAsA, tAgA = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(tokens[b], 0, 2),
                cute.group_modes(cute.local_tile(tensor, (cfg.token_block, cfg.bk), (None, None)), 0, 2))
            token_boxes.append((atom, tAsA, tAgA, first_token_row // cfg.token_block + b))
        else:
            cp_atom, tAsA, tAcA = token_copy_partition(cfg, tokens[b], tid)
            live_rows = token_limit - first_token_row - b * cfg.token_block if cfg.zero_padding else None
            blocks.append((cp_atom, tAsA, token_sources(tAcA, a_base, lambda m: a_row_offset(m + b * cfg.token_block),
                                                        live_rows)))
    ring = cute.make_tensor(cute.make_ptr(cutlass.Uint8, raw_codes, cute.AddressSpace.smem, assumed_align=1024),
                            cute.make_layout((1, cfg.bn, cfg.bk // 2, cfg.stages),
                                             stride=(0, cfg.bk // 2, 1, cfg.bn * cfg.bk // 2)))
    boxes = cute.local_tile(tma_w, (1, cfg.bn, cfg.bk // 2), (expert, first_row // cfg.bn, None))
    slot_part, boxes = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(ring, 0, 3),
                                             cute.group_modes(boxes, 0, 3))
    slots = RawSlots(slot_part, raw_scales)
    sf_tile = w_sf.iterator.toint() + Int64(swizzled_sf_offset(expert, first_row, 0, rows_per_expert,
                                                               k_extent // cfg.sf_block))
    # the next half's atoms start one 128-row tile (k_tiles atoms) further
    sf_tiles = [sf_tile] + [sf_tile + Int64(h * 512) * Int64((k_extent // cfg.sf_block + 3) // 4)
                            for h in range(1, cfg.halves)]
    warp = cute.arch.make_warp_uniform(tid // 32)
    for kt in cutlass.range(k_extent // cfg.bk, unroll=1):
        copied.producer_acquire(fill)  # the consumers are done with the stage's tokens and raw weights
        if warp == 0:
            issue_b_stage(cfg, copied, fill, tma_atom, boxes, slots, sf_tiles, token_boxes, kt, tid % 32)
        for cp_atom, tAsA, sources in blocks:
            issue_token_stage(cfg, cp_atom, tAsA, sources, kt, fill.index)
        copied.producer_commit(fill)  # cp.async.mbarrier.arrive.noinc: lands with this thread's copies
        fill.advance()
    return fill


def ring_states(cfg: WgmmaConfig):
    """Fresh (producer, consumer) states of a ring, for a role's first work item."""
    return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages))


def drain_copies():
    """The copier's last act: don't exit with copies in flight."""
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)


@cute.jit
def mma_stage(cfg: cutlass.Constexpr, copied, tiled_mma: cute.TiledMma, accs, tCrAs, tCrBs, a_words, rings,
              lut: Int32, kt, buf: cutlass.Constexpr, read, release):
    """One K stage: wait for its copies; for each weight half h, decode its weights into register buffer `buf` of
    tCrAs[h] (k-blocks 4 buf .. 4 buf + 3) and issue its wgmmas (accs[h][b] += A_h . tCrBs[b] for each token block
    b), so half 1's decode overlaps half 0's wgmmas; then retire the previous stage's wgmmas (so its tokens are
    released and its register buffers, the other ones, may be written again by the next stage). Decoding both
    halves before one fence makes ptxas serialise every wgmma (a wait after each): keep a fence per half.
    Returns the ring states advanced."""
    k_blocks = cfg.bk // 16
    copied.consumer_wait(read)
    for h in cutlass.range_constexpr(cfg.halves):
        ring, ring8 = rings[h]
        decode_a_stage(cfg, ring, ring8, lut, a_words[h], 4 * k_blocks * buf, read.index, kt)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            for acc, tCrB in zip(accs[h], tCrBs):
                cute.gemm(tiled_mma, acc, tCrAs[h][(None, None, k_blocks * buf + kb)],
                          tCrB[(None, None, kb, read.index)], acc)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(1)
    if kt > 0:
        copied.consumer_release(release)
        release.advance()
    read.advance()
    return read, release


@cute.jit
def consume(cfg: cutlass.Constexpr, copied, tokens, s_c, raw_codes: Int32, raw_scales: Int32, lut: Int32,
            tiled_mma: cute.TiledMma, wg, ctid, k_extent, read, release, finish: cutlass.Constexpr):
    """acc (64 weight rows per warpgroup x token_block tokens, one per weight half and token block) = A . tokens^T
    over all K stages of one work item, A decoded from each stage's raw slot straight into the wgmma's register
    operand. Two register buffers a half alternate by stage: a stage decodes into one while the previous stage's
    wgmmas, reading the other, are still in flight (an in-flight wgmma's A registers must not be written). Then,
    half by half and block by block, the accumulator is staged transposed into s_c [token][weight row],
    synchronised across both consumer warpgroups, and `finish(h, b)` runs the epilogue of weight half h and token
    block b. Returns the ring states advanced."""
    thr_wg = tiled_mma.get_slice((wg - FIRST_CONSUMER) * WARPGROUP)
    tCrBs = [tiled_mma.make_fragment_B(thr_wg.partition_B(t)) for t in tokens]  # smem descriptors (MMA, N, K, stages)
    # registers, 2 buffers a half
    tCrAs = [tiled_mma.make_fragment_A(thr_wg.partition_shape_A((WEIGHT_HALF, 2 * cfg.bk))) for _ in
             range(cfg.halves)]
    a_words = [cute.recast_tensor(t, Int32) for t in tCrAs]
    tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((WEIGHT_HALF, cfg.token_block)))
    accs = [[cute.make_rmem_tensor(tCcC.shape, Float32) for _ in range(cfg.blocks)] for _ in range(cfg.halves)]
    for half_accs in accs:
        for acc in half_accs:
            acc.fill(0.0)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    lane = ctid % 32
    row = (ctid // 32) * 16 + lane // 4  # warp w of the two warpgroups: weight rows 16 w .. 16 w + 15 of a half
    rings = [(RawRing(cfg, raw_codes, raw_scales, row, lane % 4, h),
              RawRing(cfg, raw_codes, raw_scales, row + 8, lane % 4, h)) for h in range(cfg.halves)]

    stages = k_extent // cfg.bk
    for pair in cutlass.range(stages // 2, unroll=1):
        for buf in cutlass.range_constexpr(2):
            read, release = mma_stage(cfg, copied, tiled_mma, accs, tCrAs, tCrBs, a_words, rings, lut,
                                      2 * pair + buf, buf, read, release)
    for kt in cutlass.range(stages - stages % 2, stages, unroll=1):  # an odd last stage: buffer 0 is free
        read, release = mma_stage(cfg, copied, tiled_mma, accs, tCrAs, tCrBs, a_words, rings, lut, kt,
                                  0, read, release)
    cute.nvgpu.warpgroup.wait_group(0)
    copied.consumer_release(release)
    release.advance()

    consumers = pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMERS)
    for h in cutlass.range_constexpr(cfg.halves):
        for b in cutlass.range_constexpr(cfg.blocks):
            consumers.arrive_and_wait()  # every consumer thread is done reading s_c (the previous pass or item)
            for i in cutlass.range_constexpr(cute.size(accs[h][b])):
                m, n = tCcC[i]
                s_c[(n, m)] = accs[h][b][i]
            consumers.arrive_and_wait()
            finish(h, b)
    return read, release


EPILOGUE_ROWS = CONSUMERS // 2  # s_c rows the consumer threads cover at once (epilogue_thread)


def epilogue_thread(ctid):
    """(tile row, half) of a consumer thread in the epilogue: lanes 0-15 of a warp take 16 consecutive rows'
    first halves, lanes 16-31 their second halves, so 8 lanes of one 16-byte shared load read 8 different rows."""
    lane = ctid % 32
    return (ctid // 32) * 16 + lane % 16, lane // 16


# ----------------------------------------------------------------------------------------------------------------
# The persistent kernel body
# ----------------------------------------------------------------------------------------------------------------
@cute.jit
def run_roles(cfg: cutlass.Constexpr, tidx, cta, live, tok_layout, tiled_mma: cute.TiledMma,
              tile_to_expert: cute.Tensor, tile_to_mn_limit: cute.Tensor, a_base: Int64,
              a_row_offset: cutlass.Constexpr, tma_atom, tma_w, w_sf, rows_per_expert, k_extent,
              epilogue: cutlass.Constexpr, token_tma=None, pad_epilogue: cutlass.Constexpr = None):
    """Every role of a wgmma GEMM over its work items (`live` routing tiles x rows_per_expert / bn column tiles):
    the copier gathers token row m of an item from `a_row_offset(item, m)` bytes past `a_base` (with
    cfg.tma_tokens: loads rows item.row0 + m of `token_tma` as boxes), the weights are
    `tma_w` / `w_sf` (K = k_extent), and after each item, for each weight half and token block with its fp32 tile
    in s_c, each consumer thread calls `epilogue(item, n_tile, s_c, r, half, row)` for the half's WEIGHT_HALF-row
    column tile n_tile, its s_c row r (routed row `row`, valid) and column half (epilogue_thread); the tile holds
    the products times 2^-63 (ACCUMULATOR_SCALE). With cfg.zero_padding and `pad_epilogue`, each thread whose row
    is the tile's padding (at or past its limit) calls `pad_epilogue(item, n_tile, half, row)` instead."""
    wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
    raster = make_raster(cfg, live, rows_per_expert, k_extent)
    items = live * raster.columns
    tokens, s_c, raw_codes, raw_scales, lut, copied = allocate(cfg, tok_layout)
    if wg == COPIER:
        cute.arch.setmaxregister_decrease(cfg.copier_regs)
        fill, _ = ring_states(cfg)
        for w in cutlass.range(cta, items, cfg.ctas, unroll=1):
            item = WorkItem(cfg, w, raster, tile_to_expert, tile_to_mn_limit)
            fill = copy_stages(cfg, copied, tokens, raw_codes, raw_scales, tidx, a_base,
                               lambda m: a_row_offset(item, m), token_tma, item.row0, item.limit, tma_atom, tma_w,
                               w_sf, item.expert, item.n_tile * cfg.bn, rows_per_expert, k_extent, fill)
        drain_copies()
    else:
        cute.arch.setmaxregister_increase(cfg.consumer_regs)
        ctid = tidx - FIRST_CONSUMER * WARPGROUP
        ptx.st_shared_b32(lut + ctid * 4, scale_table_entry(ctid, cfg.sf_block))  # 256 consumers, 256 entries
        pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMERS).arrive_and_wait()
        _, read = ring_states(cfg)
        _, release = ring_states(cfg)
        for w in cutlass.range(cta, items, cfg.ctas, unroll=1):
            item = WorkItem(cfg, w, raster, tile_to_expert, tile_to_mn_limit)
            r, half = epilogue_thread(ctid)

            # The epilogue of weight half h and token block b of this item, out of s_c, in passes of the 128 rows
            # the consumer threads cover (a PADDED_TILE block takes two, the second of its last 16 rows). A 32- or
            # 64-row block leaves threads with r >= bm out: their rows are at or past the tile's limit
            # (<= row0 + bm).
            def finish(h, b):
                n_tile = item.n_tile if cutlass.const_expr(cfg.halves == 1) else item.n_tile * cfg.halves + h
                for p in cutlass.range_constexpr(-(-cfg.token_block // EPILOGUE_ROWS)):
                    rp = r + p * EPILOGUE_ROWS
                    row = item.row0 + b * cfg.token_block + rp
                    if cutlass.const_expr(p == 0):  # rp past a 32- or 64-row block is past the limit too
                        if row < item.limit:
                            epilogue(item, n_tile, s_c, rp, half, row)
                    else:
                        if rp < cfg.token_block and row < item.limit:
                            epilogue(item, n_tile, s_c, rp, half, row)
                    if cutlass.const_expr(cfg.zero_padding and pad_epilogue is not None):
                        if row >= item.limit and rp < cfg.token_block:
                            pad_epilogue(item, n_tile, half, row)

            read, release = consume(cfg, copied, tokens, s_c, raw_codes, raw_scales, lut, tiled_mma, wg, ctid,
                                    k_extent, read, release, finish)
