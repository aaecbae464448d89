#!/usr/bin/env bash
# One H200 run: build the launcher (linking kernels exported beforehand on a machine with CuTe-DSL), run the whole
# test suite (GPU tests included), memcheck the kernels, time them, and run the quickstart on the GPU.
# Logs and a summary go to $OUT. Prepare here, then run there (the device tool):
#   python3 -m moe_ext.kernels.sm90.build .kernels          # here; carry .kernels
#   OUT=$OUT bash scripts/gpu_check.sh                      # there
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_ext_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MOE_EXT_KERNEL_DIR=${MOE_EXT_KERNEL_DIR:-$PWD/.kernels}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  cat "$MOE_EXT_KERNEL_DIR/kernels.txt"
} > "$OUT/env.txt" 2>&1
MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$OUT/install.log" 2>&1
echo "install rc=$? kernels=$(python3 -c 'import moe_ext._C as C; print(C.kernels())' 2>&1)" | tee "$OUT/summary.txt"
python3 -m pytest -q -p no:cacheprovider tests -rs > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? :: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$OUT/summary.txt"
{ compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider \
    tests/test_routing_kernel.py -k "matches_spec" &&
  compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_smoke.py; } > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$? :: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/memcheck.log" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
python3 benchmarks/bench_routing.py --out "$OUT/routing.json" > "$OUT/bench_routing.log" 2>&1
echo "bench_routing rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/bench_routing.log" | tee -a "$OUT/summary.txt"
timeout 400 python3 benchmarks/bench_kernels_v1.py --modes w4a16,w4a4,w4a8 --out "$OUT/kernels_v1.json" > "$OUT/bench_kernels_v1.log" 2>&1
echo "bench_kernels_v1 rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/bench_kernels_v1.log" | tee -a "$OUT/summary.txt"
python3 examples/quickstart.py > "$OUT/quickstart.log" 2>&1
echo "quickstart rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/quickstart.log" | tee -a "$OUT/summary.txt"
