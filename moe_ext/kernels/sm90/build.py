"""Ahead-of-time build of the sm_90a kernels: compile each shipped specialisation with CuTe-DSL (no GPU needed),
export it with `export_to_c`, and copy the DSL's static runtime next to the objects for the launcher to link.

    python -m moe_ext.kernels.sm90.build OUT_DIR [--only SUBSTRING]

writes OUT_DIR/<name>.{h,o}, OUT_DIR/libcuda_dialect_runtime_static.a, OUT_DIR/kernels.txt (one name a line) and
OUT_DIR/kernel_table.inc: for every kernel, C++ that fills the exported argument structs from a flat list of
buffers and scalars, so the launcher dispatches any kernel by name without hand-written glue. `--only` recompiles
just the kernels whose name contains SUBSTRING inside a copy of a complete build (an A/B variant of one kernel
family in a second directory, in a minute instead of the whole build's five; new kernels it selects are added).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import sys
import time

ARCH = "sm_90a"


def _load_dsl_runtime() -> None:
    # Without a GPU nothing loads the DSL runtime before the JIT linker needs its symbols (export_to_c fails).
    from cutlass.base_dsl.env_manager import get_prefix_dsl_libs

    ctypes.CDLL(get_prefix_dsl_libs("CUTE_DSL").split(os.pathsep)[0], mode=ctypes.RTLD_GLOBAL)


def specialisations():
    """(export name, compile function) of every kernel the launcher links."""
    import functools

    from . import (activations, decode_fused, fc2_quant_per_token, finalize, gemm1, gemm1_wgmma, gemm2, gemm2_wgmma,
                   routing, stream, token_slabs, wgmma_mainloop)
    from ...launcher import FC2_SLABS, decode_kernel

    def gemm2_name(mode: str, tokens: int) -> str:  # launcher.gemm2_kernel's names
        return f"moe_gemm2_{mode}_t{tokens}" + (FC2_SLABS if gemm2.reads_slabs(mode, tokens) else "")

    specs = [("moe_routing", routing.compile_routing)]
    for tokens in stream.TOKEN_TILES:
        for mode in gemm1.MODES:
            for kind in activations.KINDS:
                if not (mode == "w4a8" and kind == "situ"):  # SiTU is rejected for w4a8 (semantics §1.1)
                    specs.append((f"moe_gemm1_{mode}_{kind}_t{tokens}",
                                  functools.partial(gemm1.compile_gemm1, mode, kind, tokens)))
        specs += [(gemm2_name(mode, tokens), functools.partial(gemm2.compile_gemm2, mode, tokens))
                  for mode in gemm2.MODES]
    # The three-CTAs-an-SM form of the 8- and 32-token streaming GEMMs (stream.config_for; launcher.THREE_CTAS).
    for tokens in stream.THREE_CTA_TILES:
        specs += [(f"moe_gemm1_{mode}_{kind}_t{tokens}_3cta",
                   functools.partial(gemm1.compile_gemm1, mode, kind, tokens, three_ctas=True))
                  for mode in gemm1.MODES for kind in activations.KINDS if not (mode == "w4a8" and kind == "situ")]
        specs += [(gemm2_name(mode, tokens) + "_3cta", functools.partial(gemm2.compile_gemm2, mode, tokens,
                                                                         three_ctas=True))
                  for mode in gemm2.MODES]
    # The persistent form of the 16-token streaming GEMM2 (persistent.py), GEMM2's tactic launcher.PERSISTENT, where
    # its FC2 input is row-major: w4a4_pt (the other modes' 16-token GEMM1s write token slabs).
    specs.append(("moe_gemm2_w4a4_pt_t16_persistent",
                  functools.partial(gemm2.compile_gemm2, "w4a4_pt", 16, persistent=True)))
    # The warp-specialised wgmma GEMMs for large T (32- to 256-token routing tiles, 128- and 256-row weight tiles,
    # bf16 operands; some shapes GEMM2 only: wgmma_mainloop.GEMM2_SHAPES); the routing launches that also decode
    # quantized activations, and the per-token quantizer that writes its quantization decoded, for both GEMM
    # families.
    for tokens, rows in wgmma_mainloop.GEMM2_SHAPES:
        suffix = f"_t{tokens}_wgmma" + ("" if rows == 128 else f"_n{rows}")
        if (tokens, rows) in wgmma_mainloop.SHAPES:
            specs += [(f"moe_gemm1_{mode}_{kind}{suffix}",
                       functools.partial(gemm1_wgmma.compile_gemm1_wgmma, mode, kind, tile=tokens, weight_rows=rows))
                      for mode in gemm1_wgmma.MODES for kind in activations.KINDS
                      if not (mode == "w4a8" and kind == "situ")]
        specs += [(f"moe_gemm2_{mode}{suffix}", functools.partial(gemm2_wgmma.compile_gemm2_wgmma, mode,
                                                                  tile=tokens, weight_rows=rows))
                  for mode in gemm2_wgmma.MODES]
    specs += [(f"moe_routing_decode_{fmt}", functools.partial(routing.compile_routing_decode, fmt))
              for fmt in routing.DECODE_FORMATS]
    # The gather of the routed rows' token slabs the slab GEMM1s read (gemm1.SLAB_TILES).
    specs.append(("moe_token_slabs", token_slabs.compile_token_slabs))
    specs += [("moe_fc2_quant_per_token", fc2_quant_per_token.compile_fc2_quant),
              ("moe_finalize", finalize.compile_finalize)]
    # The one-launch small-T forward (w4a16, fused finalize; launcher.FUSED_DECODE), its form whose GEMM2 splits K
    # too and the forms whose GEMM1 builds the FC2 input (decode_fused.make_kernel's split_gemm2, fc2_by_gemm1).

    specs += [(decode_kernel(kind, split, fc2),
               functools.partial(decode_fused.compile_decode, kind, split_gemm2=split, fc2_by_gemm1=fc2))
              for kind in activations.KINDS for split in (False, True) for fc2 in (False, True)]
    # The unsplit fc2 form's deep-ring variant, for SwiGLU alone: the kind it was measured and tested on
    # (launcher.DECODE_DEEP_RING).
    specs.append((decode_kernel("swiglu", fc2_by_gemm1=True, deep_ring=True),
                  functools.partial(decode_fused.compile_decode, "swiglu", fc2_by_gemm1=True, deep_ring=True)))
    # The quantized modes' one-launch forwards: the fc2_by_gemm1 forms (their GEMM1 epilogue quantizes the FC2 input
    # once a tile) and SwiGLU's deep-ring variant.
    for mode in decode_fused.MODES[1:]:
        kinds = [kind for kind in activations.KINDS if not (mode == "w4a8" and kind == "situ")]
        specs += [(decode_kernel(kind, split, True, mode=mode),
                   functools.partial(decode_fused.compile_decode, kind, split_gemm2=split, fc2_by_gemm1=True,
                                     mode=mode))
                  for kind in kinds for split in (False, True)]
        specs.append((decode_kernel("swiglu", fc2_by_gemm1=True, deep_ring=True, mode=mode),
                      functools.partial(decode_fused.compile_decode, "swiglu", fc2_by_gemm1=True, deep_ring=True,
                                        mode=mode)))
    return specs


def static_runtime() -> str:
    import nvidia_cutlass_dsl

    path = os.path.join(nvidia_cutlass_dsl.__path__[0], "cu13", "lib", "libcuda_dialect_runtime_static.a")
    if not os.path.exists(path):
        raise FileNotFoundError(f"CuTe-DSL static runtime not found at {path}")
    return path


def selected(names: list[str], only: str) -> list[str]:
    """The kernels --only rebuilds: names the regular expression `only` matches anywhere (a plain substring, such as
    "_t16", works as one; the streaming GEMMs are r"^moe_gemm[12]_(?!.*wgmma)")."""
    pattern = re.compile(only)
    return [name for name in names if pattern.search(name)]


def build(out_dir: str, only: str | None = None) -> list[str]:
    specs = specialisations()
    names = [name for name, _ in specs]
    if only is not None:
        listing = os.path.join(out_dir, "kernels.txt")
        built = set(open(listing).read().split()) if os.path.exists(listing) else set()
        rebuilt = set(selected(names, only))
        if not rebuilt:
            raise ValueError(f"--only {only!r} matches no kernel")
        missing = [name for name in names if name not in built and name not in rebuilt]
        if missing:  # kernels new to this tree build here when --only selects them
            raise ValueError(f"--only recompiles part of a complete build, but {out_dir} lacks {len(missing)} of this "
                             f"tree's {len(names)} kernels (such as {missing[0]}) that {only!r} does not select: "
                             "build it whole first")
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    _load_dsl_runtime()
    os.makedirs(out_dir, exist_ok=True)
    for name, compile_fn in specs:
        if only is not None and name not in rebuilt:
            continue
        start = time.perf_counter()
        compiled = compile_fn(f"--gpu-arch {ARCH}")
        compiled.export_to_c(file_path=out_dir, file_name=name, function_prefix=name)
        print(f"moe_ext: compiled {name} for {ARCH} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    shutil.copy(static_runtime(), out_dir)
    with open(os.path.join(out_dir, "kernels.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    with open(os.path.join(out_dir, "kernel_table.inc"), "w") as f:
        f.write(kernel_table(out_dir, names))
    return names


_WRAPPER = re.compile(r"static inline int32_t cute_dsl_(\w+)_wrapper\(\w+_Kernel_Module_t \*module, ([^)]*)\)")
_SCALARS = {"int32_t": "static_cast<int32_t>(s[{i}])", "float": "static_cast<float>(s[{i}])",
            "uint8_t": "static_cast<uint8_t>(s[{i}] != 0.0)"}


def parse_signature(header: str, name: str) -> list[tuple[str, str]]:
    """[(kind, arg name)] of an exported wrapper: kind is 'tensor', a C scalar type, 'pdl' or 'stream'."""
    match = _WRAPPER.search(header)
    if match is None or match.group(1) != name:
        raise ValueError(f"{name}: exported header has no wrapper")
    args = []
    for decl in (a.strip() for a in match.group(2).split(",")):
        ctype, arg = decl.rsplit(" ", 1)
        if arg.startswith("*"):
            if not re.fullmatch(rf"{name}_Tensor_\w+_t", ctype) or "dynamic_strides" in header:
                raise ValueError(f"{name}: only flat tensors are supported, got {decl}")
            args.append(("tensor", arg[1:]))
        elif arg == "pdl" or arg == "stream":
            args.append((arg, arg))
        elif ctype in _SCALARS:
            args.append((ctype, arg))
        else:
            raise ValueError(f"{name}: unsupported argument {decl}")
    if [k for k, _ in args[-2:]] != ["pdl", "stream"]:
        raise ValueError(f"{name}: the last two arguments must be pdl and stream")
    return args


def kernel_table(out_dir: str, names: list[str]) -> str:
    """C++ for launcher.cpp: includes, one module and launch function per kernel, and the name table."""
    lines = ["// Generated by moe_ext/kernels/sm90/build.py; do not edit."]
    entries = []
    for name in names:
        with open(os.path.join(out_dir, f"{name}.h")) as f:
            args = parse_signature(f.read(), name)
        lines.append(f'#include "{name}.h"')
        lines.append(f"static {name}_Kernel_Module_t g_{name};")
        lines.append(f"static void load_{name}() {{ {name}_Kernel_Module_Load(&g_{name}); "
                     f"if (g_{name}.module == nullptr) throw std::runtime_error(\"loading {name} failed\"); }}")
        body, call = [], []
        tensors = scalars = 0
        for kind, arg in args:
            if kind == "tensor":
                body.append(f"  {name}_Tensor_{arg}_t a_{arg}; a_{arg}.data = reinterpret_cast<void*>(t[{tensors}].ptr);"
                            f" a_{arg}.dynamic_shapes[0] = static_cast<int32_t>(t[{tensors}].size);")
                call.append(f"&a_{arg}")
                tensors += 1
            elif kind == "pdl":
                call.append("static_cast<uint8_t>(pdl)")
            elif kind == "stream":
                call.append("stream")
            else:
                call.append(_SCALARS[kind].format(i=scalars))
                scalars += 1
        lines.append(f"static int32_t launch_{name}(const moe_ext::Buf* t, const double* s, bool pdl, "
                     "cudaStream_t stream) {")
        lines.append("  (void)s;")
        lines.extend(body)
        lines.append(f"  return cute_dsl_{name}_wrapper(&g_{name}, {', '.join(call)});")
        lines.append("}")
        entries.append(f'  {{"{name}", {tensors}, {scalars}, launch_{name}, load_{name}}},')
    lines.append("static const moe_ext::KernelEntry moe_ext_kernel_table[] = {")
    lines.extend(entries)
    lines.append("};")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--only", metavar="REGEX", default=None,
                        help="recompile only the kernels whose name this regular expression matches (a substring "
                             "works), in a complete build's directory")
    args = parser.parse_args()
    build(args.out_dir, args.only)


if __name__ == "__main__":
    main()
