"""Installs the moe_ext package; builds the C++ launcher (moe_ext._C) with CMake when a CUDA toolkit is found.

The sm_90a kernels are compiled ahead of time with CuTe-DSL (no GPU needed) when nvidia-cutlass-dsl is
importable, and linked into the launcher; MOE_EXT_KERNEL_DIR=DIR links kernels exported earlier instead (how the
GPU machine, which has no CuTe-DSL, gets them). Without nvcc the package installs without the launcher and runs on
the reference path. MOE_EXT_NO_LAUNCHER=1 skips the build; MOE_EXT_REQUIRE_LAUNCHER=1 makes a missing toolkit,
and MOE_EXT_REQUIRE_KERNELS=1 a missing or failing kernel build, an error.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def _find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


class CMakeBuild(build_ext):
    def run(self):
        nvcc = _find_nvcc()
        if os.environ.get("MOE_EXT_NO_LAUNCHER") == "1" or nvcc is None or shutil.which("cmake") is None:
            if os.environ.get("MOE_EXT_REQUIRE_LAUNCHER") == "1":
                raise RuntimeError("MOE_EXT_REQUIRE_LAUNCHER=1 but nvcc or cmake was not found")
            print("moe_ext: no CUDA toolkit/cmake (or MOE_EXT_NO_LAUNCHER=1): skipping the C++ launcher")
            return
        super().run()

    def build_extension(self, ext):
        import pybind11

        extdir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(self.build_temp)
        os.makedirs(build_dir, exist_ok=True)
        cuda_root = os.path.dirname(os.path.dirname(os.path.realpath(_find_nvcc())))
        kernel_dir = self._kernel_dir(build_dir)
        subprocess.check_call([
            "cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}", f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DCUDAToolkit_ROOT={cuda_root}",
            f"-DMOE_EXT_KERNEL_DIR={kernel_dir or ''}",
        ])
        subprocess.check_call(["cmake", "--build", build_dir, "-j", str(os.cpu_count() or 2)])

    @staticmethod
    def _kernel_dir(build_dir):
        """Directory of exported kernels: MOE_EXT_KERNEL_DIR, else a fresh AOT build, else None."""
        given = os.environ.get("MOE_EXT_KERNEL_DIR")
        if given:
            return os.path.abspath(given)
        out = os.path.join(build_dir, "kernels")
        # A subprocess keeps the DSL's MLIR runtime out of the build process.
        result = subprocess.run([sys.executable, "-m", "moe_ext.kernels.sm90.build", out], cwd=ROOT)
        if result.returncode == 0:
            return out
        if os.environ.get("MOE_EXT_REQUIRE_KERNELS") == "1":
            raise RuntimeError("MOE_EXT_REQUIRE_KERNELS=1 but the sm_90a kernel build failed (see above)")
        print("moe_ext: CuTe-DSL kernel build unavailable; building the launcher without kernels")
        return None


setup(ext_modules=[CMakeExtension("moe_ext._C")], cmdclass={"build_ext": CMakeBuild})
