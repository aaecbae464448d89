"""Ahead-of-time build of the sm_90a kernels: compile each shipped specialisation with CuTe-DSL (no GPU needed),
export it with `export_to_c`, and copy the DSL's static runtime next to the objects for the launcher to link.

    python -m moe_ext.kernels.sm90.build OUT_DIR

writes OUT_DIR/<name>.{h,o}, OUT_DIR/libcuda_dialect_runtime_static.a and OUT_DIR/kernels.txt (one name a line).
"""
from __future__ import annotations

import argparse
import ctypes
import os
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

    from . import activations, finalize, gemm1, gemm2, routing

    specs = [("moe_routing", routing.compile_routing)]
    specs += [(f"moe_gemm1_{kind}", functools.partial(gemm1.compile_gemm1, kind)) for kind in activations.KINDS]
    specs += [("moe_gemm2_w4a16", gemm2.compile_gemm2), ("moe_finalize", finalize.compile_finalize)]
    return specs


def static_runtime() -> str:
    import nvidia_cutlass_dsl

    path = os.path.join(nvidia_cutlass_dsl.__path__[0], "cu13", "lib", "libcuda_dialect_runtime_static.a")
    if not os.path.exists(path):
        raise FileNotFoundError(f"CuTe-DSL static runtime not found at {path}")
    return path


def build(out_dir: str) -> list[str]:
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    _load_dsl_runtime()
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for name, compile_fn in specialisations():
        start = time.perf_counter()
        compiled = compile_fn(f"--gpu-arch {ARCH}")
        compiled.export_to_c(file_path=out_dir, file_name=name, function_prefix=name)
        print(f"moe_ext: compiled {name} for {ARCH} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        names.append(name)
    shutil.copy(static_runtime(), out_dir)
    with open(os.path.join(out_dir, "kernels.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    build(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
