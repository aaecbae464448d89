"""The sm_90a kernels compile ahead of time without a GPU (CI runs this on a machine without one)."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def built_kernels(tmp_path_factory):
    """Every shipped kernel, built once for this module's tests."""
    out = tmp_path_factory.mktemp("kernels")
    subprocess.run([sys.executable, "-m", "moe_ext.kernels.sm90.build", str(out)], check=True)
    return out


def test_every_shipped_kernel_compiles_for_sm90a(built_kernels):
    tmp_path = built_kernels
    names = (tmp_path / "kernels.txt").read_text().split()
    gemms = []
    for tokens in (8, 16, 32, 64, 128):
        gemms += [f"moe_gemm1_{mode}_{kind}_t{tokens}" for mode in ("w4a16", "w4a4", "w4a4_pt", "w4a8")
                  for kind in ("swiglu", "situ", "geglu_tanh", "relu2") if not (mode == "w4a8" and kind == "situ")]
        slabs = "_slabs" if tokens in (16, 32) else ""  # the FC2 input as token slabs, but in w4a4_pt
        gemms += [f"moe_gemm2_{mode}_t{tokens}" + ("" if mode == "w4a4_pt" else slabs)
                  for mode in ("w4a16", "w4a4_pt", "w4a8")]
    for tokens in (8, 32):
        gemms += [f"moe_gemm1_{mode}_{kind}_t{tokens}_3cta" for mode in ("w4a16", "w4a4", "w4a4_pt", "w4a8")
                  for kind in ("swiglu", "situ", "geglu_tanh", "relu2") if not (mode == "w4a8" and kind == "situ")]
        slabs = "_slabs" if tokens == 32 else ""
        gemms += [f"moe_gemm2_{mode}_t{tokens}" + ("" if mode == "w4a4_pt" else slabs) + "_3cta"
                  for mode in ("w4a16", "w4a4_pt", "w4a8")]
    gemms.append("moe_gemm2_w4a4_pt_t16_persistent")  # launcher.PERSISTENT
    for suffix in ("_t32_wgmma", "_t32_wgmma_n256", "_t64_wgmma", "_t64_wgmma_n256", "_t128_wgmma", "_t256_wgmma",
                   "_t128_wgmma_n256", "_t144_wgmma"):
        gemms += [f"moe_gemm1_{mode}_{kind}{suffix}" for mode in ("w4a16", "w4a4", "w4a4_pt", "w4a8")
                  for kind in ("swiglu", "situ", "geglu_tanh", "relu2") if not (mode == "w4a8" and kind == "situ")]
        gemms += [f"moe_gemm2_{mode}{suffix}" for mode in ("w4a16", "w4a4_pt", "w4a8")]
    gemms += [f"moe_gemm2_{mode}_t144_wgmma_n256" for mode in ("w4a16", "w4a4_pt", "w4a8")]  # GEMM2 only
    assert names == ["moe_routing", *gemms, "moe_routing_decode_nvfp4", "moe_routing_decode_mxfp8",
                     "moe_routing_decode_bf16", "moe_token_slabs", "moe_fc2_quant_per_token", "moe_finalize",
                     *(f"moe_decode_w4a16_{kind}{form}" for kind in ("swiglu", "situ", "geglu_tanh", "relu2")
                       for form in ("", "_fc2", "_split2", "_split2_fc2")), "moe_decode_w4a16_swiglu_fc2_ring6",
                     *(name for mode in ("w4a4", "w4a8") for name in [
                         *(f"moe_decode_{mode}_{kind}{form}" for kind in ("swiglu", "situ", "geglu_tanh", "relu2")
                           if not (mode == "w4a8" and kind == "situ") for form in ("_fc2", "_split2_fc2")),
                         f"moe_decode_{mode}_swiglu_fc2_ring6"])]
    table = (tmp_path / "kernel_table.inc").read_text()
    assert all(f'{{"{name}",' in table for name in names)
    for name in names:
        assert (tmp_path / f"{name}.o").stat().st_size > 0
        header = (tmp_path / f"{name}.h").read_text()
        assert f"cute_dsl_{name}_wrapper" in header
    assert (tmp_path / "libcuda_dialect_runtime_static.a").exists()

    # --only recompiles one family inside the complete build and leaves the rest (and the table) as they were.
    before = {name: (tmp_path / f"{name}.o").stat().st_mtime_ns for name in ("moe_finalize", "moe_routing")}
    subprocess.run([sys.executable, "-m", "moe_ext.kernels.sm90.build", str(tmp_path), "--only", "moe_finalize"],
                   check=True)
    assert (tmp_path / "moe_finalize.o").stat().st_mtime_ns > before["moe_finalize"]
    assert (tmp_path / "moe_routing.o").stat().st_mtime_ns == before["moe_routing"]
    assert (tmp_path / "kernels.txt").read_text().split() == names
    assert (tmp_path / "kernel_table.inc").read_text() == table


def test_partial_rebuild_needs_a_complete_build_and_a_matching_name(tmp_path):
    from moe_ext.kernels.sm90 import build

    with pytest.raises(ValueError, match="build it whole first"):
        build.build(str(tmp_path), only="wgmma")
    (tmp_path / "kernels.txt").write_text("\n".join(name for name, _ in build.specialisations()) + "\n")
    with pytest.raises(ValueError, match="matches no kernel"):
        build.build(str(tmp_path), only="no_such_kernel")
    # a build that lacks kernels new to this tree rebuilds them only when --only selects them
    (tmp_path / "kernels.txt").write_text("\n".join(name for name, _ in build.specialisations()
                                                    if not name.endswith("_split2")) + "\n")
    with pytest.raises(ValueError, match="moe_decode_w4a16_swiglu_split2"):
        build.build(str(tmp_path), only="moe_finalize")


def test_partial_rebuild_selects_by_regular_expression():
    """--only is a regular expression searched in each name: substrings keep working, and one pattern selects
    every streaming GEMM (what a streaming-mainloop change rebuilds) and nothing else."""
    from moe_ext.kernels.sm90 import build, stream

    names = [name for name, _ in build.specialisations()]
    assert build.selected(names, "moe_finalize") == ["moe_finalize"]
    streaming = build.selected(names, r"^moe_gemm[12]_(?!.*wgmma)")
    assert streaming and all("wgmma" not in n and n.startswith(("moe_gemm1_", "moe_gemm2_")) for n in streaming)
    assert {n.split("_t")[-1].split("_")[0] for n in streaming} == {str(t) for t in stream.TOKEN_TILES}
    assert len(streaming) == len([n for n in names if n.startswith("moe_gemm") and "wgmma" not in n])


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("MOE_EXT_NO_LAUNCHER") == "1",
                    reason="no CUDA toolkit: the launcher is not built")
def test_installed_launcher_links_the_kernels():
    from moe_ext import _C

    linked = set(_C.kernels())
    assert {"moe_routing", "moe_gemm1_w4a4_swiglu_t8", "moe_gemm2_w4a8_t64", "moe_gemm2_w4a16_t8_3cta",
            "moe_gemm1_w4a16_relu2_t128_wgmma", "moe_gemm2_w4a16_t128_wgmma", "moe_gemm1_w4a8_swiglu_t128_wgmma",
            "moe_gemm2_w4a4_pt_t128_wgmma", "moe_routing_decode_mxfp8", "moe_routing_decode_bf16",
            "moe_token_slabs", "moe_fc2_quant_per_token", "moe_finalize"} <= linked


def test_launcher_knows_the_compiled_token_tiles(monkeypatch):
    from moe_ext import launcher
    from moe_ext.kernels.sm90 import stream

    from moe_ext.kernels.sm90 import wgmma_mainloop

    from moe_ext.kernels.sm90 import gemm1

    assert launcher.TOKEN_TILES == stream.TOKEN_TILES
    assert launcher.THREE_CTA_TILES == stream.THREE_CTA_TILES
    # the slab GEMM1s: which objects of a build with the gather read token slabs
    assert launcher.SLAB_TILES == gemm1.SLAB_TILES
    monkeypatch.setattr(launcher, "_linked_kernels", lambda: frozenset({launcher.SLAB_GATHER}))
    for mode in gemm1.MODES:
        for tile in stream.TOKEN_TILES:
            assert launcher.reads_slabs(mode, tile, 1) == gemm1.config_for(mode, tile).ring_tokens, (mode, tile)
            if tile in stream.THREE_CTA_TILES:
                three = gemm1.config_for(mode, tile, three_ctas=True).ring_tokens
                assert launcher.reads_slabs(mode, tile, launcher.THREE_CTAS) == three, (mode, tile)
    assert (*launcher.NARROW_WGMMA_TILES, launcher.WGMMA_TILE, launcher.PADDED_WGMMA_TILE,
            launcher.WIDE_WGMMA_TILE) == wgmma_mainloop.TILES


def test_a_build_pairs_the_fc2_slab_writers_with_their_readers(monkeypatch):
    """By the names a build links, the launcher knows which streaming forwards pass the FC2 input as token slabs:
    exactly where that build's GEMM1 stores them and its GEMM2 (every streaming form of it) reads them. The
    persistent GEMM2 stages row-major rows: it is linked only where nothing stores slabs (w4a4_pt)."""
    from moe_ext import launcher
    from moe_ext.kernels.sm90 import build, gemm1, gemm2, stream

    names = frozenset(name for name, _ in build.specialisations())
    monkeypatch.setattr(launcher, "_linked_kernels", lambda: names)
    for mode in gemm1.MODES:
        for tile in stream.TOKEN_TILES:
            slabs = gemm1.reads_slabs(mode, tile)
            assert launcher.fc2_slabs(mode, tile) == slabs == gemm2.reads_slabs(launcher._GEMM2_MODE.get(mode, mode),
                                                                                 tile), (mode, tile)
            forms = (1, launcher.THREE_CTAS) if tile in stream.THREE_CTA_TILES else (1,)
            for split in forms:
                name = launcher.gemm2_kernel(mode, tile, split)
                assert name in names and (launcher.FC2_SLABS in name) == slabs, (mode, tile, split)
                assert gemm2.config_for(launcher._GEMM2_MODE.get(mode, mode), tile, split != 1).ring_tokens == slabs
        persistent = launcher.gemm2_kernel(mode, launcher.PERSISTENT_TILE, launcher.PERSISTENT)
        assert (persistent in names) == (not gemm1.reads_slabs(mode, launcher.PERSISTENT_TILE)
                                         and mode == "w4a4_pt"), mode


def test_launcher_table_generation_from_a_header(tmp_path):
    from moe_ext.kernels.sm90.build import kernel_table, parse_signature

    header = (
        "typedef struct { void *data; int32_t dynamic_shapes[1]; } k_Tensor_a_t;\n"
        "static inline int32_t cute_dsl_k_wrapper(k_Kernel_Module_t *module, k_Tensor_a_t *a, int32_t n, "
        "float scale, uint8_t flag, k_Tensor_b_t *b, uint8_t pdl, cudaStream_t stream) {\n"
    )
    assert parse_signature(header, "k") == [("tensor", "a"), ("int32_t", "n"), ("float", "scale"),
                                            ("uint8_t", "flag"), ("tensor", "b"), ("pdl", "pdl"),
                                            ("stream", "stream")]
    (tmp_path / "k.h").write_text(header)
    table = kernel_table(str(tmp_path), ["k"])
    assert '{"k", 2, 3, launch_k, load_k},' in table
    assert ("cute_dsl_k_wrapper(&g_k, &a_a, static_cast<int32_t>(s[0]), static_cast<float>(s[1]), "
            "static_cast<uint8_t>(s[2] != 0.0), &a_b, static_cast<uint8_t>(pdl), stream)") in table
    with pytest.raises(ValueError, match="pdl and stream"):
        parse_signature(header.replace(", uint8_t pdl, cudaStream_t stream", ""), "k")
    strided = header.replace("int32_t dynamic_shapes[1];", "int32_t dynamic_shapes[2]; int64_t dynamic_strides[1];")
    with pytest.raises(ValueError, match="only flat tensors"):
        parse_signature(strided, "k")


@pytest.mark.parametrize("gemm", [1, 2])
@pytest.mark.parametrize("tokens", [8, 16, 32, 64, 128])
def test_streaming_configs_fit_the_ctas_per_sm_they_ask_for(tokens, gemm):
    """min_blocks_per_mp=n caps registers at 64K / (n x threads) a thread: 128 for one or two CTAs, and for three
    (16-token tiles) the 80 their mainloop compiles in without spills; shared memory (plus the 1 KB the driver
    reserves per CTA) must let n CTAs share the SM's 227 KB, or the request is a lie."""
    from moe_ext.kernels.sm90 import stream

    c = stream.config_for(tokens, gemm)
    assert c.ctas_per_sm * (stream.shared_bytes(tokens, c) + 1024) <= 232448
    assert 65536 // (c.ctas_per_sm * c.threads) >= (80 if c.ctas_per_sm == 3 else 128)


@pytest.mark.parametrize("gemm", [1, 2])
def test_streaming_mainloop_with_two_stages_per_wait_compiles(gemm):
    """stages_per_wait=2 (a benchmarks/stream_variants.py variant, not shipped) keeps compiling for sm_90a, on the
    one-slice GEMM1 and the two-slice GEMM2 configurations of 8-token tiles."""
    import dataclasses

    from moe_ext.kernels.sm90 import gemm1, gemm2, stream

    cfg = dataclasses.replace(stream.config_for(8, gemm), stages_per_wait=2)
    if gemm == 1:
        assert gemm1.compile_launch(gemm1.make_kernel("w4a16", "swiglu", 8, cfg), "--gpu-arch sm_90a") is not None
    else:
        assert gemm2.compile_launch(gemm2.make_kernel("w4a8", 8, cfg), "--gpu-arch sm_90a") is not None


@pytest.mark.parametrize("gemm,tokens,mma", [(1, 8, "wgmma"), (2, 8, "wgmma"), (1, 64, "wgmma"), (2, 32, "wgmma"),
                                            (1, 8, "wgmma_async"), (2, 64, "wgmma_async")])
def test_streaming_mainloop_on_register_a_wgmma_compiles(gemm, tokens, mma):
    """The register-A wgmma mainloops (benchmarks/stream_variants.py variants, not shipped) keep compiling for
    sm_90a, on one- and two-slice configurations and several token tiles (the wgmma N)."""
    import dataclasses

    from moe_ext.kernels.sm90 import gemm1, gemm2, stream

    cfg = dataclasses.replace(stream.config_for(tokens, gemm), mma=mma)
    if gemm == 1:
        assert gemm1.compile_launch(gemm1.make_kernel("w4a4", "swiglu", tokens, cfg), "--gpu-arch sm_90a") is not None
    else:
        assert gemm2.compile_launch(gemm2.make_kernel("w4a8", tokens, cfg), "--gpu-arch sm_90a") is not None


@pytest.mark.parametrize("gemm,tokens", [(1, 8), (2, 16)])
def test_three_ctas_per_sm_variant_fits_and_compiles(gemm, tokens):
    """benchmarks/stream_variants.py's `three_ctas`: three CTAs' shared memory fit one SM (228 KB, 1 KB reserved per
    CTA) at every decode tile, and the 80-register configuration compiles for sm_90a."""
    import dataclasses

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from stream_variants import VARIANTS

    from moe_ext.kernels.sm90 import gemm1, gemm2, stream

    for tile in (8, 16, 32):
        for g in (1, 2):
            c = dataclasses.replace(stream.config_for(tile, g), **VARIANTS["three_ctas"])
            assert 3 * (stream.shared_bytes(tile, c) + 1024) <= 228 * 1024, (tile, g)
    cfg = dataclasses.replace(stream.config_for(tokens, gemm), **VARIANTS["three_ctas"])
    if gemm == 1:
        assert gemm1.compile_launch(gemm1.make_kernel("w4a16", "swiglu", tokens, cfg), "--gpu-arch sm_90a") is not None
    else:
        assert gemm2.compile_launch(gemm2.make_kernel("w4a16", tokens, cfg), "--gpu-arch sm_90a") is not None


def test_register_a_fragment_is_in_ptx_order():
    """decode_a_stage writes each k16 block's A fragment as 4 words in PTX order, thread t owning weight rows
    16 (t // 32) + (t % 32) // 4 (+ 8) and K 2 (t % 4) (+ 8): CuTe's tiled MMA and its fragment must agree."""
    import cutlass.cute as cute
    from cutlass import Int32

    from moe_ext.kernels.sm90 import wgmma_mainloop as mainloop

    cfg = mainloop.WgmmaConfig()
    threads = (0, 1, 5, 37, 130, 255)
    seen = {}

    @cute.jit
    def probe():  # static layouts, read while tracing
        tiled_mma = mainloop.make_tiled_mma(cfg)
        tv = tiled_mma.tv_layout_A_tiled  # (thread, value) -> (weight row, k) of one k16 block, column-major
        seen["coords"] = [[(tv((t, v)) % cfg.bn, tv((t, v)) // cfg.bn) for v in range(8)] for t in threads]
        fragment = tiled_mma.make_fragment_A(tiled_mma.get_slice(0).partition_shape_A((cfg.bn, 2 * cfg.bk)))
        words = cute.recast_tensor(fragment, Int32).layout
        seen["words"] = [words(i) for i in range(32)]

    cute.compile(probe, options="--gpu-arch sm_90a")
    for t, got in zip(threads, seen["coords"]):
        row, k = 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)
        assert got == [(row, k), (row, k + 1), (row + 8, k), (row + 8, k + 1),
                       (row, k + 8), (row, k + 9), (row + 8, k + 8), (row + 8, k + 9)], t
    assert seen["words"] == list(range(32))  # word i is register i: k-block slice i // 4, PTX word i % 4


def test_token_k_order_puts_each_token_where_its_decoded_weight_pair_sits():
    """decode_a_stage gives lane q of a quad the code bytes of K [16 q, 16 q + 16) of a 64-K stage and writes codes
    (j, j + 4) of its word p, row r, as A word 4 j + 2 p + r, which in PTX order (above) holds stage K
    16 j + 8 p + 2 q + e for its half e: the token of stage offset 16 q + 8 p + j + 4 e must sit there. Every row
    group is a permutation of 64 positions, and the writer's runs (a k16 half's pairs of consecutive quarters)
    are contiguous."""
    from moe_ext.kernels.sm90.wgmma_mainloop import K_GROUP, stage_position

    assert sorted(stage_position(o) for o in range(K_GROUP)) == list(range(K_GROUP))
    for q in range(4):
        for p in range(2):
            for j in range(4):
                for e in range(2):
                    word = 2 * p  # row r only selects the weight row, not K
                    k_in_block = 2 * q + (8 if word >= 2 else 0) + e
                    assert stage_position(16 * q + 8 * p + j + 4 * e) == 16 * j + k_in_block
    for p in range(2):
        for j in range(4):  # pairs (o, o + 4) of quarters 0..3 land in consecutive 4-byte words
            starts = [stage_position(16 * q + 8 * p + j) for q in range(4)]
            assert starts == [starts[0] + 2 * q for q in range(4)] and starts[0] % 8 == 0
            assert [stage_position(16 * q + 8 * p + j + 4) for q in range(4)] == [s + 1 for s in starts]


@pytest.mark.parametrize("gemm,tokens", [(1, 8), (1, 16), (1, 32), (2, 16), (2, 32)])
def test_ring_token_gemms_fit_their_ctas_per_sm_and_compile(gemm, tokens):
    """The ring_tokens GEMMs (a token slab a stage instead of the staged K-chunks: the 16/32-token slab GEMM1s, and
    benchmarks/stream_variants.py variants elsewhere) hold a step's token rows a slot instead of the token tile: they
    fit the CTAs an SM their configuration asks for, in less shared memory, and compile for sm_90a."""
    import dataclasses

    from moe_ext.kernels.sm90 import gemm1, gemm2, stream

    base = stream.config_for(tokens, gemm)
    cfg = dataclasses.replace(base, ring_tokens=True)
    assert stream.shared_bytes(tokens, cfg) < stream.shared_bytes(tokens, base)
    assert cfg.ctas_per_sm * (stream.shared_bytes(tokens, cfg) + 1024) <= 232448
    if gemm == 1:
        assert gemm1.compile_launch(gemm1.make_kernel("w4a16", "swiglu", tokens, cfg), "--gpu-arch sm_90a") is not None
    else:
        assert gemm2.compile_launch(gemm2.make_kernel("w4a16", tokens, cfg), "--gpu-arch sm_90a") is not None


@pytest.mark.parametrize("sf_block", [16, 32])
@pytest.mark.parametrize("tile", [128, 256])
def test_wgmma_configs_fit_the_register_file_and_shared_memory(tile, sf_block):
    """Every shipped wgmma config's shared memory (the Storage struct) fits a Hopper CTA's 227 KB: a kernel that
    asks for more compiles but fails at launch."""
    from moe_ext.kernels.sm90 import wgmma_mainloop

    cfg = wgmma_mainloop.config_for_tile(tile, sf_block)
    cfg.check()
    assert 150 * 1024 < cfg.shared_bytes <= wgmma_mainloop.MAX_SHARED_BYTES


def test_wgmma_config_rejects_setmaxnreg_past_the_launch_allocation():
    """setmaxnreg only moves registers inside what the CTA got at launch (168 a thread of 384 at one CTA an SM):
    40 + 2 x 236 fits the 64K register file but not that, and its consumers' increase would wait forever."""
    from moe_ext.kernels.sm90 import wgmma_mainloop

    wgmma_mainloop.WgmmaConfig(copier_regs=40, consumer_regs=232).check()
    with pytest.raises(AssertionError, match="registers the CTA gets at launch"):
        wgmma_mainloop.WgmmaConfig(copier_regs=40, consumer_regs=236).check()


@pytest.mark.parametrize("live,columns,group", [(1, 1, 8), (7, 3, 8), (338, 32, 8), (68, 224, 16), (13, 16, 4),
                                                (290, 12, 32)])
def test_wgmma_raster_visits_every_work_item_once_a_group_at_a_time(live, columns, group):
    """The persistent wgmma GEMMs' item order is a bijection onto (routing tile, column tile) that finishes each
    group of `group` routing tiles (every column tile of them) before the next, routing tile fastest: the CTAs of
    a wave share a few tiles' token rows."""
    from moe_ext.kernels.sm90.wgmma_mainloop import raster_position

    order = [raster_position(w, live, columns, group, min) for w in range(live * columns)]
    assert sorted(order) == [(t, c) for t in range(live) for c in range(columns)]
    w = 0
    for first in range(0, live, group):
        size = min(group, live - first)
        block = order[w:w + size * columns]
        assert block == [(first + i % size, i // size) for i in range(size * columns)]
        w += size * columns


def load_script(name: str):
    """A scripts/ file as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernel_sass():
    """scripts/kernel_sass.py as a module, with an nvdisasm to run."""
    module = load_script("kernel_sass")
    try:
        module.nvdisasm()
    except SystemExit:
        pytest.skip("nvdisasm not available")
    return module


def test_wgmma_gemms_keep_everything_in_registers_and_shared_memory(built_kernels, kernel_sass):
    """The persistent wgmma GEMMs' SASS (read by scripts/kernel_sass.py from the exported objects) has register A
    wgmmas, no local-memory traffic in the mainloop (a spill there would sit in the decode of every stage) and no
    wgmma that waits for the one before it."""
    for name in ("moe_gemm1_w4a16_swiglu_t128_wgmma", "moe_gemm2_w4a16_t128_wgmma", "moe_gemm2_w4a8_t128_wgmma",
                 "moe_gemm1_w4a16_swiglu_t256_wgmma", "moe_gemm2_w4a16_t256_wgmma", "moe_gemm1_w4a8_relu2_t256_wgmma",
                 "moe_gemm1_w4a16_swiglu_t128_wgmma_n256", "moe_gemm2_w4a16_t128_wgmma_n256",
                 "moe_gemm1_w4a8_relu2_t128_wgmma_n256"):
        listing = kernel_sass.sass(str(built_kernels / f"{name}.o"))
        counts = kernel_sass.opcode_counts(listing)
        assert counts["HGMMA"] >= 4 and re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", listing), name  # A from registers
        assert kernel_sass.mainloop_local_ops(listing) == 0, name
        assert kernel_sass.serialized_wgmmas(listing) == 0, name
        assert kernel_sass.wgmma_widths(listing) == [128], name  # m64n128k16: one 128-token block per wgmma
    # the narrow tiles (one m64n32 / m64n64 block, also with 256 weight rows) and the padded one (one m64n144 block)
    for tokens, wide in ((32, "_n256"), (64, "_n256"), (144, "")):
        for name in (f"moe_gemm1_w4a16_swiglu_t{tokens}_wgmma", f"moe_gemm1_w4a8_relu2_t{tokens}_wgmma{wide}",
                     f"moe_gemm2_w4a16_t{tokens}_wgmma", f"moe_gemm2_w4a8_t{tokens}_wgmma_n256"):
            listing = kernel_sass.sass(str(built_kernels / f"{name}.o"))
            assert kernel_sass.mainloop_local_ops(listing) == 0, name
            assert kernel_sass.serialized_wgmmas(listing) == 0, name
            assert kernel_sass.wgmma_widths(listing) == [tokens], name


def test_wgmma_gemms_split_the_register_file_between_their_roles(built_kernels, kernel_sass):
    """Every wgmma GEMM's copier gives registers back and its consumers take them (setmaxnreg: USETMAXREG in SASS).
    ptxas drops both where it cannot tell the register count at kernel entry (it could not for the 32- and 64-token
    kernels before their launches set min_blocks_per_mp: session 26), and then every role runs on one budget."""
    names = [n for n in (built_kernels / "kernels.txt").read_text().split() if "_wgmma" in n]
    assert len(names) == 147
    for name in names:
        listing = kernel_sass.sass(str(built_kernels / f"{name}.o"))
        assert "USETMAXREG.DEALLOC" in listing and "USETMAXREG.TRY_ALLOC" in listing, name


def test_three_cta_streaming_gemms_do_not_spill_in_their_mainloop(built_kernels, kernel_sass):
    """The 16-token streaming GEMMs run three CTAs an SM (stream.config_for), and so do the 8- and 32-token ones'
    `_3cta` form and the persistent 16-token GEMM2, which caps them at 80 registers a thread: none of them may touch
    local memory in its mainloop (a spill there would sit in every K step's decode). A value parked across the whole
    mainloop (stored before it, loaded after it: the slab GEMM1 32-token 3-CTA geglu_tanh, session 50) costs a
    store and a load a CTA; at most two such pairs."""
    from moe_ext.kernels.sm90 import stream

    assert stream.config_for(16, 1).ctas_per_sm == stream.config_for(16, 2).ctas_per_sm == 3
    assert stream.config_for(8, 1, three_ctas=True).ctas_per_sm == stream.config_for(8, 2, True).ctas_per_sm == 3
    assert stream.config_for(8, 2, True).k_slices == 1 and stream.config_for(8, 2).k_slices == 2
    assert stream.config_for(32, 1, three_ctas=True).ctas_per_sm == stream.config_for(32, 2, True).ctas_per_sm == 3
    with pytest.raises(ValueError, match="three-CTA form"):
        stream.config_for(64, 1, three_ctas=True)
    listed = (built_kernels / "kernels.txt").read_text().split()
    names = [n for n in listed if re.search(r"_t16(_slabs)?$|_t8_3cta$|_t32(_slabs)?_3cta$", n)]
    assert len(names) == 3 * 18  # each: 15 GEMM1 (modes x activations) + 3 GEMM2 (w4a4 runs w4a16's)
    names.append("moe_gemm2_w4a4_pt_t16_persistent")  # the 16-token form's persistent GEMM2 (persistent.py)
    for name in names:
        listing = kernel_sass.sass(str(built_kernels / f"{name}.o"))
        counts = kernel_sass.opcode_counts(listing)
        assert kernel_sass.mainloop_local_ops(listing) == 0 and counts["LDL"] + counts["STL"] <= 4, name


@pytest.mark.parametrize("mode,form", [("w4a16", form) for form in ("", "_split2", "_fc2", "_split2_fc2", "_fc2_ring6")]
                         + [(mode, form) for mode in ("w4a4", "w4a8") for form in ("_fc2", "_split2_fc2", "_fc2_ring6")])
def test_fused_decode_kernels_fit_the_instruction_cache_and_do_not_spill(built_kernels, kernel_sass, mode, form):
    """The one-launch forward (decode_fused.py) runs both GEMMs through one mainloop: its first build, with two
    unrolled copies of everything, was 13,184 instructions and 41% of its stall samples waited for instruction
    fetch (ncu, Qwen3-30B-A3B T=1). It must stay small and in registers: no local memory in the mainloop, and
    outside it only in the split partials forms (GEMM2's ranges meet and its staging sums GEMM1's: a few values over
    the phase loop at the 128-register cap; ReLU2's 29 since those forms walk their ring in a loop). Every form
    issues a thread's token loads before its first store into the token tile (task by task each load waited for the
    previous store, 3.5 us at T=1), and issues GEMM1's first chunk's before its weight copies (the partials forms'
    GEMM2 items issue theirs before they wait for their tokens). The quantized modes load x's codes and scale with
    GEMM2's FC2 input in one predicated sequence (three loads; one 16-byte) and decode both in the mainloop's
    stagings (1.0-1.3k instructions more); w4a8's unsplit forms spill a word or two (1-2 STL, their LDL) outside the
    mainloop."""
    kinds = ("swiglu",) if form.endswith("_ring6") else ("swiglu", "situ", "geglu_tanh", "relu2")
    for kind in (k for k in kinds if not (mode == "w4a8" and k == "situ")):
        listing = kernel_sass.sass(str(built_kernels / f"moe_decode_{mode}_{kind}{form}.o"))
        counts = kernel_sass.opcode_counts(listing)
        spills = {"_split2": 30}.get(form, 4 if mode == "w4a8" else 0)
        assert counts["LDL"] + counts["STL"] <= spills, (kind, counts["LDL"] + counts["STL"])
        assert sum(counts.values()) < 6000, (kind, sum(counts.values()))
        lines = listing.splitlines()
        # the flip counts (the zeroing's, unmade tiles', GEMM1 items') and their gpu-scope fences; the K ranges'
        # arrival counts (atomics: the last to arrive sums)
        assert sum("REDG.E.ADD.STRONG.GPU" in line for line in lines) >= 3 and counts["MEMBAR"] >= 3, kind
        assert counts["ATOM"] >= ("split2" in form) + ("fc2" in form), kind
        first_load = next(i for i, line in enumerate(lines) if "LDG.E.128" in line)
        first_store = next(i for i in range(first_load, len(lines)) if "STS" in lines[i])
        assert sum("LDG.E.128" in line for line in lines[first_load:first_store]) >= 4, kind
        next_copy = next(i for i in range(first_load, len(lines)) if "UTMALDG" in lines[i])
        assert sum("LDG.E.128" in line for line in lines[first_load:next_copy]) >= 4, kind
        mainloop = [i for i, line in enumerate(lines) if "HMMA" in line]
        assert not any("LDL" in line or "STL" in line for line in lines[mainloop[0]:mainloop[-1]]), kind


def test_launcher_mirrors_the_fused_decode_kernels_constants():
    """The launcher sizes FUSED_DECODE's buffers and grid without importing CuTe-DSL, from copies of the kernel's
    constants: a stale copy would under-size the count or partials buffers the kernel indexes."""
    from moe_ext import launcher
    from moe_ext.kernels.sm90 import decode_fused

    assert launcher.DECODE_TILE == decode_fused.TOKENS
    assert launcher.DECODE_MAX_PAIRS == decode_fused.MAX_PAIRS
    assert launcher.DECODE_SPLITS == decode_fused.MAX_SPLITS
    assert launcher.DECODE_CTAS_PER_SM == decode_fused.CONFIG.ctas_per_sm
    assert launcher.DECODE_GEMM2_MIN_STEPS == decode_fused.GEMM2_MIN_STEPS
    assert launcher.DECODE_READINESS_WORD == decode_fused.READINESS_WORD
    assert launcher.DECODE_DEEP_RING_STAGES == decode_fused.DEEP_CONFIG.stages
    assert launcher.DECODE_CTAS_PER_SM == decode_fused.DEEP_CONFIG.ctas_per_sm


def test_fused_decode_timeline_build_marks_its_points_outside_the_mainloop(tmp_path, kernel_sass):
    """decode_fused's timeline build (benchmarks/decode_timeline.py) reads the SM clock and the global timer and
    stores its marks from thread 0; its mainloop (first to last HMMA) has no local-memory traffic, so the marks
    time the shipped schedule's pieces rather than spills of their own."""
    import re

    from moe_ext.kernels.sm90 import build, decode_fused

    build._load_dsl_runtime()
    for split in (False, True):
        name = f"timeline{int(split)}"
        compiled = decode_fused.compile_decode("swiglu", f"--gpu-arch {build.ARCH}", split_gemm2=split, timeline=True)
        compiled.export_to_c(file_path=str(tmp_path), file_name=name, function_prefix=name)
        listing = kernel_sass.sass(str(tmp_path / f"{name}.o"))
        assert all(register in listing for register in ("SR_CLOCKLO", "SR_GLOBALTIMERLO", "SMID")), split
        lines = listing.splitlines()
        hmma = [i for i, line in enumerate(lines) if "HMMA" in line]
        assert hmma and not [line for line in lines[hmma[0]:hmma[-1]] if re.search(r"\b(LDL|STL)\b", line)], split


def test_narrow_mainloop_widths_skip_whole_mma_columns():
    """The narrower copies of the mainloop (StreamConfig.narrow) exist for mma.sync tiles of 16+ tokens, each a
    whole number of m16n8k16 columns whose staging splits evenly over the threads; an 8-token tile is one column,
    and the wgmma variant's N is the whole tile."""
    import dataclasses

    from moe_ext.kernels.sm90 import stream

    widths = {t: stream.mainloop_widths(t, stream.config_for(t, 1)) for t in stream.TOKEN_TILES}
    assert widths == {8: (8,), 16: (8, 16), 32: (8, 16, 24, 32), 64: (16, 32, 48, 64), 128: (64, 128)}
    assert stream.mainloop_widths(8, stream.config_for(8, 2, three_ctas=True)) == (8,)
    assert stream.mainloop_widths(32, dataclasses.replace(stream.config_for(32, 1), mma="wgmma")) == (32,)
    assert stream.mainloop_widths(32, dataclasses.replace(stream.config_for(32, 1), narrow=False)) == (32,)
    for t, ws in widths.items():
        for gemm in (1, 2):
            c = stream.config_for(t, gemm)
            for w in ws:
                assert w % 8 == 0 and w % ws[0] == 0
                assert stream.chunk_tasks(t, c, w) * c.threads * 8 == w * stream.k_chunk(t, c)


@pytest.mark.parametrize("divisor", range(1, 17))
def test_division_by_magic_is_exact_over_its_range(divisor):
    """ptx.division_magic / divide_by_magic (GEMM1's token = expanded // top_k), replayed in u32 arithmetic: exact
    for every n < 2^32 / divisor, checked at both ends of the range, around every multiple of the divisor near them,
    and at random points."""
    import random

    magic = (0xFFFFFFFF // divisor + 1) & 0xFFFFFFFF
    top = (1 << 32) // divisor - 1 if divisor > 1 else (1 << 32) - 1
    rng = random.Random(divisor)
    ns = list(range(0, 4 * divisor)) + list(range(top - 4 * divisor, top + 1)) + [rng.randrange(top) for _ in
                                                                                  range(20000)]
    for n in ns:
        q = n if magic == 0 else (n * magic) >> 32
        assert q == n // divisor, (n, divisor)


@pytest.mark.parametrize("nibble", [0, 4])
def test_e2m1_pair_decode_bits_are_the_values_times_2_pow_minus_126(nibble):
    """The kernels' e2m1 decode (ptx.e2m1_pair_bits: mask, multiply, mask), replayed on the CPU with its own
    constants for every (low code, high code) pair and random bits in the other nibbles: each bf16 half is exactly
    the code's value times 2^-126 (the subnormal 0.5 included)."""
    import torch

    from moe_ext.kernels.sm90 import ptx
    from moe_ext.quant.formats import e2m1_decode

    isolate, spread = ptx.e2m1_pair_constants(nibble)
    low, high = (c.flatten() for c in torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij"))
    noise = torch.randint(0, 1 << 32, (256,), generator=torch.Generator().manual_seed(nibble))
    word = (noise & ~isolate) | (low << nibble) | (high << (nibble + 16))
    bits = ((word & isolate) * spread) % (1 << 32) & (ptx.E2M1_PAIR_BITS & 0xFFFFFFFF)
    halves = torch.stack([bits & 0xFFFF, bits >> 16], 1).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    expected = torch.stack([e2m1_decode(low), e2m1_decode(high)], 1)
    assert torch.equal(halves.float() * 2.0 ** 126, expected)


def test_step_sass_counts_a_stage_of_the_hottest_mainloop():
    """scripts/step_sass.py on a made-up listing: of the two loops, the one that waits on two full barriers (below
    the empty barriers that releases arrive on) is the mainloop; the refill block a forward branch skips is left
    out, the decode between the waits counted, and the count is per stage."""
    step_sass = load_script("step_sass")
    body = ["MOV R1, R2 ;", "@P0 BRA `(.L_x_2) ;", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x114a0], R7 ;",
            "UBLKCP ;", ".L_x_2:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16+0x11480], R5 ;", "LOP3.LUT R1 ;",
            "IMAD R2 ;", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16+0x11488], R5 ;", "HMMA.16816.F32.BF16 R4 ;",
            "@!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR16+0x114a0], RZ ;", "@P0 BRA `(.L_x_1) ;"]
    other = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+URZ+0x11480], R5 ;", "HMMA.16816.F32.BF16 R4 ;",
             "@P2 BRA `(.L_x_3) ;"]
    lines, address = [], 0
    for label, block in ((".L_x_1:", body), (".L_x_3:", other)):
        lines.append(label + "\n")
        for text in block:
            if text.startswith(".L_x"):
                lines.append(text + "\n")
                continue
            lines.append(f"        /*{address:04x}*/                   {text}\n")
            address += 16
    stages, loop = step_sass.mainloop(lines)
    assert stages == 2 and len(loop) == 9  # 11 instructions less the skipped refill wait and copy
    assert not any("UBLKCP" in line or "0x114a0], R7" in line for line in loop)


def test_step_sass_finds_a_ring_walked_as_a_loop():
    """A ring walked as a loop (StreamConfig.unroll_ring off, the one-launch decode's partials form): its back
    branch is unconditional and inside the body (the exit branches forward), and the item loop around it waits on
    more full barriers among many more instructions; the out-of-line retry path past EXIT is no loop. The ring's
    loop is the mainloop: one stage, its 10 instructions."""
    step_sass = load_script("step_sass")
    ring = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4+URZ+0x11480], R5 ;"] + ["LOP3.LUT R1 ;", "IMAD R2 ;",
                                                                            "HMMA.16816.F32.BF16 R4 ;"] * 2
    ring += ["SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R4+URZ+0x114a0], RZ ;", "@P1 BRA `(.L_x_2) ;", "BRA `(.L_x_1) ;"]
    blocks = [(".L_x_0:", ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x11480], R5 ;"]), (".L_x_1:", ring),
              (".L_x_2:", ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R5+URZ+0x11480], R5 ;"] + ["FADD R1 ;"] * 40
               + ["@P0 BRA `(.L_x_0) ;", "EXIT ;"]),
              (".L_x_3:", ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4+URZ+0x11480], R5 ;", "BRA `(.L_x_1) ;"])]
    lines, address = [], 0
    for label, block in blocks:
        lines.append(label + "\n")
        for text in block:
            lines.append(f"        /*{address:04x}*/                   {text}\n")
            address += 16
    stages, loop = step_sass.mainloop(lines)
    assert stages == 1 and len(loop) == 10 and "TRYWAIT" in loop[0] and "BRA `(.L_x_1)" in loop[-1]
