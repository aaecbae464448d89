"""The few PTX instructions the GEMMs need that CuTe-DSL does not expose as plain calls on registers:
asynchronous copies into shared memory (16-byte cp.async for the wgmma mainloop, bulk copies for the streaming
ring's scales), 128-bit shared loads and stores, the bf16 tensor-core MMA on registers, the e2m1 -> bf16
decode and the e4m3 rounding. Each is a small inline-asm wrapper on 32-bit registers (bf16x2 pairs travel as Int32).
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(results: int, args, text: str, constraints: str, side_effects=False, result_type=None):
    result_type = result_type or T.i32()
    out_type = None if results == 0 else (
        result_type if results == 1 else llvm.StructType.get_literal([result_type] * results))
    value = llvm.inline_asm(out_type, [a.ir_value() for a in args], text, constraints,
                            has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    if results <= 1:
        return value
    return [llvm.extractvalue(result_type, value, [i]) for i in range(results)]


@dsl_user_op
def cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, bypassing L1: the first `src_bytes` (0 or 16) read, the rest zeros."""
    _asm(0, [Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)], "cp.async.cg.shared.global [$0], [$1], 16, $2;",
         "r,l,r,~{memory}", side_effects=True)


@dsl_user_op
def cp_async_bulk(dst: Int32, src: Int64, nbytes: Int32, bar: Int32, *, loc=None, ip=None) -> None:
    """`nbytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared through the copy engine; the
    bytes are counted on mbarrier `bar` (complete_tx) when they land."""
    _asm(0, [Int32(dst), Int64(src), Int32(nbytes), Int32(bar)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
         "r,l,r,r,~{memory}", side_effects=True)


@dsl_user_op
def tma_load_3d(dst: Int32, tensor_map: Int64, c0, c1, c2, bar: Int32, *, loc=None, ip=None) -> None:
    """One TMA box of the 3-d `tensor_map` (the generic address of a grid-constant descriptor) at coordinates
    (c0, c1, c2), innermost first, into shared `dst`; the bytes are counted on mbarrier `bar` as they land."""
    _asm(0, [Int32(dst), Int64(tensor_map), Int32(c0), Int32(c1), Int32(c2), Int32(bar)],
         "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [$0], [$1, {$2, $3, $4}], "
         "[$5];", "r,l,r,r,r,r,~{memory}", side_effects=True)


@dsl_user_op
def prefetch_tensormap(tensor_map: Int64, *, loc=None, ip=None) -> None:
    """Bring a TMA descriptor (generic address) into the descriptor cache ahead of its first copy."""
    _asm(0, [Int64(tensor_map)], "prefetch.tensormap [$0];", "l,~{memory}", side_effects=True)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Order this thread's generic-proxy shared accesses before later async-proxy ones (bulk and TMA copies)."""
    _asm(0, [], "fence.proxy.async.shared::cta;", "~{memory}", side_effects=True)


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None) -> list:
    values = _asm(4, [Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                  side_effects=True)
    return [Int32(v) for v in values]


@dsl_user_op
def ld_shared_v2(addr: Int32, *, loc=None, ip=None) -> list:
    values = _asm(2, [Int32(addr)], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r,~{memory}", side_effects=True)
    return [Int32(v) for v in values]


@dsl_user_op
def ld_shared_u8(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(1, [Int32(addr)], "ld.shared.u8 $0, [$1];", "=r,r,~{memory}", side_effects=True))


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(1, [Int32(addr)], "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", side_effects=True))


@dsl_user_op
def ld_shared_cluster_f32(addr: Int32, rank, *, loc=None, ip=None) -> Float32:
    """fp32 at this CTA's shared address `addr`, read from the same offset in cluster CTA `rank` (DSMEM)."""
    return Float32(_asm(1, [Int32(addr), Int32(rank)],
                        "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $1, $2; "
                        "ld.shared::cluster.f32 $0, [remote]; }", "=f,r,r,~{memory}", side_effects=True,
                        result_type=T.f32()))


@dsl_user_op
def st_shared_b32(addr: Int32, value: Int32, *, loc=None, ip=None) -> None:
    _asm(0, [Int32(addr), Int32(value)], "st.shared.b32 [$0], $1;", "r,r,~{memory}", side_effects=True)


@dsl_user_op
def st_shared_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    _asm(0, [Int32(addr), Int32(a), Int32(b), Int32(c), Int32(d)], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
         "r,r,r,r,r,~{memory}", side_effects=True)


@dsl_user_op
def ld_global_v4(addr: Int64, *, loc=None, ip=None) -> list:
    values = _asm(4, [Int64(addr)], "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return [Int32(v) for v in values]


@dsl_user_op
def st_global_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    _asm(0, [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d)], "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
         "l,r,r,r,r,~{memory}", side_effects=True)


@dsl_user_op
def st_global_v2(addr: Int64, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    _asm(0, [Int64(addr), Int32(a), Int32(b)], "st.global.v2.b32 [$0], {$1, $2};", "l,r,r,~{memory}",
         side_effects=True)


@dsl_user_op
def red_add_bf16x2(addr: Int64, a: Int32, *, loc=None, ip=None) -> None:
    """Atomic bf16x2 add into global memory (bf16 sum, no flush to zero), the fused finalize's reduce-add."""
    _asm(0, [Int64(addr), Int32(a)], "red.global.add.noftz.bf16x2 [$0], $1;", "l,r,~{memory}", side_effects=True)


@dsl_user_op
def red_add_bf16x2_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """Four bf16x2 atomic adds at a 16-byte aligned address in one instruction (sm_90)."""
    _asm(0, [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d)],
         "red.global.add.noftz.v4.bf16x2 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", side_effects=True)


@dsl_user_op
def st_global_b32(addr: Int64, value: Int32, *, loc=None, ip=None) -> None:
    _asm(0, [Int64(addr), Int32(value)], "st.global.b32 [$0], $1;", "l,r,~{memory}", side_effects=True)


@dsl_user_op
def ld_global_v2(addr: Int64, *, loc=None, ip=None) -> list:
    values = _asm(2, [Int64(addr)], "ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l")
    return [Int32(v) for v in values]


@dsl_user_op
def ld_tokens_or_codes(bf16: Int32, element: Int32, words_base: Int64, codes_base: Int64, scale_base: Int64,
                       code_bits: int, block: int, *, loc=None, ip=None) -> list:
    """Where `bf16` is nonzero, the 16 bytes of bf16 element `element` from L2 (ld_global_cg_v4 at words_base);
    else the codes of that element on (8 of code_bits bits: 1 or 2 words, at codes_base) in the first results and
    its scale byte (one a `block` elements, at scale_base) in the last, the others 0. Predicated loads in one
    sequence, the addresses made inside it from one register a load: no branch for ptxas to schedule around. The
    results are zeroed first: a predicated load's destination otherwise counts as live from the kernel's entry
    (its old value survives where the predicate is off), and the decode kernel's staging, which keeps 8 tasks' loads
    in flight, spilled 400 words."""
    words = code_bits // 4  # words of 8 codes
    codes = "$0" if words == 1 else "{$0, $1}"
    vector = "" if words == 1 else ".v2"
    text = ("{ .reg .pred p; .reg .b64 a; .reg .b32 e; setp.ne.b32 p, $4, 0; "
            "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
            "mul.wide.u32 a, $5, 2; add.s64 a, a, $6; @p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [a]; "
            f"shr.u32 e, $5, {(8 // code_bits).bit_length() - 1}; cvt.u64.u32 a, e; add.s64 a, a, $7; "
            f"@!p ld.global.nc{vector}.b32 {codes}, [a]; "
            f"shr.u32 e, $5, {block.bit_length() - 1}; cvt.u64.u32 a, e; add.s64 a, a, $8; "
            "@!p ld.global.nc.u8 $3, [a]; }")
    values = _asm(4, [Int32(bf16), Int32(element), Int64(words_base), Int64(codes_base), Int64(scale_base)], text,
                  "=r,=r,=r,=r,r,r,l,l,l", side_effects=True)
    return [Int32(v) for v in values]


@dsl_user_op
def ld_global_cg_v4(addr: Int64, *, loc=None, ip=None) -> list:
    """16 bytes from L2, past the SM's L1: data another CTA of the same grid wrote (the non-coherent path of
    ld_global_v4 may serve a stale copy)."""
    values = _asm(4, [Int64(addr)], "ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side_effects=True)
    return [Int32(v) for v in values]


@dsl_user_op
def flip_count(counter: Int64, leader, arrivals: Int32, *, loc=None, ip=None) -> None:
    """One thread a CTA (after a CTA barrier) counts an arrival on the u32 at `counter`. The leader adds
    2^31 - (arrivals - 1), every other arrival 1: the word's top bit flips once all `arrivals` have come (its low 31
    bits stay 0 between launches, so no partial count reaches the top bit) and the word never needs resetting
    (CUDA's cooperative-groups grid sync counts the same way). A waiter compares the top bit with the one the word
    had before (flip_wait). The gpu-scope fence publishes the CTA's earlier global writes to every thread that
    sees the flip (a release: fence, then a relaxed add); a reduction, not an atomic, so the thread has no round
    trip to wait for."""
    lead = Int32(int(leader)) if isinstance(leader, bool) else Int32(cutlass.select_(leader, Int32(1), Int32(0)))
    _asm(0, [Int64(counter), lead, Int32(arrivals)],
         "{ .reg .u32 add; .reg .pred lead; setp.ne.u32 lead, $1, 0; sub.u32 add, 0x80000001, $2; "
         "selp.u32 add, add, 1, lead; fence.acq_rel.gpu; red.relaxed.gpu.global.add.u32 [$0], add; }",
         "l,r,r,~{memory}", side_effects=True)


@dsl_user_op
def ld_relaxed_gpu(addr: Int64, *, loc=None, ip=None) -> Int32:
    """A u32 as the GPU's L2 has it now (another CTA's counts, not a copy in this SM's L1)."""
    return Int32(_asm(1, [Int64(addr)], "ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l,~{memory}", side_effects=True))


@dsl_user_op
def flip_wait(first: Int64, second: Int64, before: Int32, *, loc=None, ip=None) -> None:
    """One thread a CTA waits until the top bits of the u32 words at `first` and `second` both differ from that of
    `before` (a word's value ahead of this launch's flips: flip_count). Relaxed polls, then one fence (an acquire);
    a CTA barrier after it passes the acquired writes on to the CTA's other threads."""
    _asm(0, [Int64(first), Int64(second), Int32(before)],
         "{ .reg .u32 a, b; .reg .pred done; FLIP_SPIN_${:uid}: ld.relaxed.gpu.u32 a, [$0]; "
         "ld.relaxed.gpu.u32 b, [$1]; xor.b32 a, a, $2; xor.b32 b, b, $2; and.b32 a, a, b; setp.lt.s32 done, a, 0; "
         "@!done bra.uni FLIP_SPIN_${:uid}; fence.acq_rel.gpu; }",
         "l,l,r,~{memory}", side_effects=True)


@dsl_user_op
def arrive_last(counter: Int64, arrivals: Int32, *, loc=None, ip=None) -> Int32:
    """One thread a CTA (after a CTA barrier) counts an arrival on the u32 at `counter`: 1 for the last of
    `arrivals`, which also resets the word to 0 for the next launch, else 0. The gpu-scope fences publish each
    arriving CTA's earlier global writes and give the last one everything the others wrote before arriving."""
    return Int32(_asm(1, [Int64(counter), Int32(arrivals)],
                      "{ .reg .u32 old; .reg .pred last; fence.acq_rel.gpu; "
                      "atom.add.acq_rel.gpu.u32 old, [$1], 1; add.u32 old, old, 1; setp.eq.u32 last, old, $2; "
                      "@last st.relaxed.gpu.u32 [$1], 0; @last fence.acq_rel.gpu; selp.u32 $0, 1, 0, last; }",
                      "=r,l,r,~{memory}", side_effects=True))


@dsl_user_op
def sm_clock(*, loc=None, ip=None) -> Int32:
    """The SM's cycle counter (low 32 bits): durations inside one CTA (decode_fused's timeline)."""
    return Int32(_asm(1, [], "mov.u32 $0, %clock;", "=r", side_effects=True))


@dsl_user_op
def global_timer(*, loc=None, ip=None) -> list:
    """The GPU-wide nanosecond timer as (low, high) words: lines up the CTAs of a launch (decode_fused's timeline)."""
    values = _asm(2, [], "{ .reg .u64 t; mov.u64 t, %globaltimer; mov.b64 {$0, $1}, t; }", "=r,=r",
                  side_effects=True)
    return [Int32(v) for v in values]


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    """The SM this CTA runs on (decode_fused's timeline: which CTAs share an SM)."""
    return Int32(_asm(1, [], "mov.u32 $0, %smid;", "=r", side_effects=True))


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Bytes of (b:a) picked by the four nibbles of `selector`."""
    return Int32(_asm(1, [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r"))


@dsl_user_op
def pinned(a: Int32, *, loc=None, ip=None) -> Int32:
    """`a` through a side-effecting move: the compiler can neither fold it into its uses nor recompute it inside a
    loop, so a value made once before a loop stays one value."""
    return Int32(_asm(1, [Int32(a)], "mov.b32 $0, $1;", "=r,r", side_effects=True))


@dsl_user_op
def byte_of(a: Int32, index: Int32, *, loc=None, ip=None) -> Int32:
    """Byte `index` (0-3, a runtime value) of `a` in the low byte, zeros above: one prmt whose selector picks it
    and three bytes of a zero register."""
    return Int32(_asm(1, [Int32(a), Int32(0x4440) + Int32(index)], "prmt.b32 $0, $1, 0, $2;", "=r,r,r"))


@dsl_user_op
def division_magic(divisor: Int32, *, loc=None, ip=None) -> Int32:
    """ceil(2^32 / divisor) as a u32 for divide_by_magic, divisor >= 1 (it wraps to 0 for divisor 1)."""
    return Int32(_asm(1, [Int32(divisor)], "{ .reg .u32 t; div.u32 t, 0xFFFFFFFF, $1; add.u32 $0, t, 1; }",
                      "=r,r"))


@dsl_user_op
def divide_by_magic(n: Int32, magic: Int32, *, loc=None, ip=None) -> Int32:
    """floor(n / divisor) for 0 <= n < 2^32 / divisor, `magic` = division_magic(divisor): the high word of n * magic
    (exact there: n * (magic * divisor - 2^32) < 2^32), or n itself where magic is 0 (divisor 1). Two instructions
    where a division by a runtime value takes about twenty."""
    return Int32(_asm(1, [Int32(n), Int32(magic)],
                      "{ .reg .u32 q; .reg .pred one; mul.hi.u32 q, $1, $2; setp.eq.u32 one, $2, 0; "
                      "selp.u32 $0, $1, q, one; }", "=r,r,r"))


@dsl_user_op
def mul_bf16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(1, [Int32(a), Int32(b)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r"))


@dsl_user_op
def pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """(lo, hi) fp32 -> one bf16x2 register, round to nearest even (exact for values bf16 can hold)."""
    return Int32(_asm(1, [Float32(hi), Float32(lo)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))


@dsl_user_op
def e4m3_rounded_pair(a: Float32, b: Float32, *, loc=None, ip=None) -> list:
    """(a, b) rounded to the e4m3fn grid, RN-even, saturating to 448, as fp32: the hardware's encode to an e4m3x2
    pair and its exact decode through f16x2 (every e4m3 value is an f16 normal or subnormal)."""
    text = ("{ .reg .b16 q, lo, hi; .reg .b32 h; cvt.rn.satfinite.e4m3x2.f32 q, $3, $2; "
            "cvt.rn.f16x2.e4m3x2 h, q; mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")
    return [Float32(v) for v in _asm(2, [Float32(a), Float32(b)], text, "=f,=f,f,f", result_type=T.f32())]


@dsl_user_op
def cvt_e4m3x4_to_f32(word: Int32, *, loc=None, ip=None) -> list:
    """The four e4m3fn codes of `word` (code j in byte j) as fp32, exact: the hardware's decode to f16x2 pairs
    (every e4m3 value is an f16 normal or subnormal), then f16 -> f32."""
    text = ("{ .reg .b16 lo, hi, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; "
            "cvt.f32.f16 $0, a0; cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }")
    return [Float32(v) for v in _asm(4, [Int32(word)], text, "=f,=f,=f,=f,r", result_type=T.f32())]


@dsl_user_op
def cvt_e4m3_to_f32(byte: Int32, *, loc=None, ip=None) -> Float32:
    """The e4m3fn code in the low byte of `byte` as fp32 (cvt_e4m3x4_to_f32's decode of one code)."""
    text = ("{ .reg .b16 lo, hi, a0, a1; .reg .b32 a; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 a, lo; "
            "mov.b32 {a0, a1}, a; cvt.f32.f16 $0, a0; }")
    return Float32(_asm(1, [Int32(byte)], text, "=f,r", result_type=T.f32()))


# bf16 2^126, in both halves: the decoded e2m1 bit pattern below is the value times 2^-126.
BF16X2_2P126 = 0x7E807E80


# An e2m1 pair's bf16x2 bits: magnitudes at bits 6..8 and 22..24, signs at bits 15 and 31.
E2M1_PAIR_BITS = -2118090304  # 0x81C081C0


def e2m1_pair_constants(nibble: int) -> tuple[int, int]:
    """(mask, multiplier) of e2m1_pair_bits for codes at bits nibble.. and nibble+16.. (nibble 0 or 4)."""
    return 0x000F000F << nibble, (1 << (6 - nibble)) + (1 << (12 - nibble))


@dsl_user_op
def e2m1_pair_bits(word: Int32, nibble: int, *, loc=None, ip=None) -> Int32:
    """The bf16x2 bit patterns (value * 2^-126) of the e2m1 codes at bits nibble..nibble+3 (low half) and
    nibble+16..nibble+19 (high half) of `word`, `nibble` 0 or 4.

    The 3 magnitude bits go to bf16 bits 6..8 (exponent field = e2m1 exponent, top mantissa bit = e2m1 mantissa)
    and the sign to bit 15: that bit pattern is exactly value * 2^-126 for every code, the subnormal 0.5 included.
    One multiply places both: with the two codes isolated, x * (2^(6-n) + 2^(12-n)) writes a copy of each code at
    bits 6..9 and 12..15 of its half (no two copies overlap, so no carries) and the mask keeps the magnitude of
    the first copy and the sign of the second. Mask, multiply, mask: 3 instructions, one on the FMA pipe, where
    shifting magnitude and sign apart took 4.
    """
    isolate, spread = e2m1_pair_constants(nibble)
    text = (f"{{ .reg .b32 t; and.b32 t, $1, {isolate:#x}; mul.lo.u32 t, t, {spread:#x}; "
            f"and.b32 $0, t, {E2M1_PAIR_BITS & 0xFFFFFFFF:#x}; }}")
    return Int32(_asm(1, [Int32(word)], text, "=r,r"))


def e2m1x8_to_bf16x2(word: Int32, scale2: Int32) -> list:
    """Eight packed e2m1 codes (code j in bits 4j..4j+3) -> four bf16x2 registers, pair i = (code i, code i+4)
    times the bf16x2 `scale2` (exact: one bf16 multiply by scale * 2^126, or by a table entry with the
    accumulator's power of two folded in). The pairing (i, i+4) keeps both halves of a register 16 bits apart."""
    high = Int32(word) >> 8  # codes 2, 3, 6, 7 at nibbles 0, 1, 4, 5 (the masks drop the sign-filled bits)
    return [mul_bf16x2(e2m1_pair_bits(w, nibble), scale2) for w, nibble in ((word, 0), (word, 4), (high, 0),
                                                                           (high, 4))]


def write_words(address: Int64, words: list, vector_op=st_global_v4, scalar_op=st_global_b32) -> None:
    """32-bit words to consecutive global addresses (stores, or e.g. reduce-adds): 16-byte instructions, then single
    words for the rest."""
    full = len(words) - len(words) % 4
    for i in range(0, full, 4):
        vector_op(address + 4 * i, *words[i:i + 4])
    for i in range(full, len(words)):
        scalar_op(address + 4 * i, words[i])


def e2m1x8_to_bf16x8(word: Int32, scale2: Int32) -> list:
    """8 e2m1 codes (element j in bits 4j..4j+3) -> 4 bf16x2 registers in natural order, each value * scale."""
    p = e2m1x8_to_bf16x2(word, Int32(BF16X2_2P126))  # (x0 x4)(x1 x5)(x2 x6)(x3 x7), exact values
    natural = [prmt(p[0], p[1], 0x5410), prmt(p[2], p[3], 0x5410), prmt(p[0], p[1], 0x7632), prmt(p[2], p[3], 0x7632)]
    return [mul_bf16x2(v, scale2) for v in natural]


@dsl_user_op
def mma_bf16_16816(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """c += A (16x16 bf16, row) x B (16x8 bf16, col) with fp32 accumulation; operands in the PTX fragment order."""
    args = [Int32(v) for v in a] + [Int32(v) for v in b] + [Float32(v) for v in c]
    values = _asm(4, args,
                  "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                  "{$8, $9}, {$10, $11, $12, $13};",
                  "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", result_type=T.f32())
    return [Float32(v) for v in values]


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """Registers written since the last wgmma (its A operand, the accumulators) are ready for the next ones."""
    _asm(0, [], "wgmma.fence.sync.aligned;", "~{memory}", side_effects=True)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    _asm(0, [], "wgmma.commit_group.sync.aligned;", "~{memory}", side_effects=True)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most `pending` committed wgmma groups of this warpgroup are in flight."""
    _asm(0, [], f"wgmma.wait_group.sync.aligned {pending};", "~{memory}", side_effects=True)


def smem_descriptor_k_major(addr: Int32, k_half_bytes: int, group_bytes: int) -> Int64:
    """wgmma descriptor of an unswizzled K-major operand at shared address `addr`: 8-row x 16-byte core matrices,
    the second K half of a k16 step `k_half_bytes` on (LBO), the next 8 rows `group_bytes` on (SBO)."""
    return ((Int64(addr) >> 4) & Int64(0x3FFF)) | (Int64(k_half_bytes >> 4) << 16) | (Int64(group_bytes >> 4) << 32)


@dsl_user_op
def wgmma_bf16_rs(acc: list, a: list, b_desc: Int64, *, loc=None, ip=None) -> list:
    """acc (m64 x n, n = 2 * len(acc), fp32, the mma.sync C fragment order per 8 columns) += A (m64 x k16 bf16, this
    thread's mma.sync m16n8k16 A fragment of its warp's 16 rows, in registers) x B (k16 x n bf16, K-major in
    shared memory, `b_desc`). Asynchronous: fence before, commit and wait after."""
    n = len(acc)
    d = ", ".join(f"${i}" for i in range(n))
    text = (f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.bf16.bf16 {{{d}}}, "
            f"{{${n}, ${n + 1}, ${n + 2}, ${n + 3}}}, ${n + 4}, 1, 1, 1, 0;")
    constraints = ",".join(["=f"] * n + ["r"] * 4 + ["l"] + [str(i) for i in range(n)])
    args = [Int32(v) for v in a] + [Int64(b_desc)] + [Float32(v) for v in acc]
    values = _asm(n, args, text, constraints, side_effects=True, result_type=T.f32())
    return [Float32(v) for v in (values if n > 1 else [values])]
