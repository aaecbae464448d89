#!/usr/bin/env bash
# Installs moe_ext and its test dependencies into the current Python environment.
# An existing torch (e.g. a CUDA build on a GPU machine) is kept; without one, the CPU build is installed.
# The C++ launcher is built when nvcc and cmake are found (see setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# Offline machines (the H200) already have these; only fetch what is missing.
if ! "$PY" -c "import setuptools, pybind11, pytest, hypothesis, numpy, safetensors, transformers" 2>/dev/null; then
  "$PY" -m pip install -q "setuptools>=64" "pybind11>=2.12" pytest hypothesis numpy safetensors "transformers>=5"
fi
# CuTe-DSL compiles the sm_90a kernels at install time (no GPU needed). Only the CUDA 13 libraries are taken
# (the top package would also pull the CUDA 12 ones). Skipped when MOE_EXT_KERNEL_DIR points at kernels exported
# elsewhere (the offline GPU machine) or when there is no CUDA toolkit to build the launcher with.
if [ -z "${MOE_EXT_KERNEL_DIR:-}" ] && command -v nvcc >/dev/null && ! "$PY" -c "import cutlass.cute" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
  "$PY" -m pip install -q "cuda-bindings>=12.8" protobuf typing-extensions
  # nvdisasm, for the SASS checks of the built kernels (scripts/kernel_sass.py)
  "$PY" -m pip install -q --no-deps "nvidia-cuda-nvdisasm>=13,<14"
fi
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import moe_ext, torch; print('moe_ext', moe_ext.__version__, 'torch', torch.__version__)"
