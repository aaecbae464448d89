#!/usr/bin/env bash
# A short H200 iteration: install with the carried kernels, the kernel tests (optionally filtered) and a
# decode/prefill timing of the grouped GEMMs. Logs to $OUT. Usage (device tool, carry .kernels):
#   OUT=$OUT bash scripts/gpu_quick.sh [pytest -k expression] [bench tokens]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_ext_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MOE_EXT_KERNEL_DIR=${MOE_EXT_KERNEL_DIR:-$PWD/.kernels}
MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$OUT/install.log" 2>&1
echo "install rc=$?" | tee "$OUT/summary.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hopper_kernels.py --maxfail=8 -k "${1:-.}" \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? :: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -40 | tee -a "$OUT/summary.txt"
timeout 240 python3 benchmarks/bench_kernels_v1.py --modes w4a16,w4a4,w4a8 --tokens "${2:-1,64,1024}" \
  --out "$OUT/kernels.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/bench.log" | tee -a "$OUT/summary.txt"
