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
if ! "$PY" -c "import setuptools, pybind11, pytest, hypothesis, numpy" 2>/dev/null; then
  "$PY" -m pip install -q "setuptools>=64" "pybind11>=2.12" pytest hypothesis numpy
fi
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import moe_ext, torch; print('moe_ext', moe_ext.__version__, 'torch', torch.__version__)"
