#!/usr/bin/env bash
# One H200 run: build the launcher, run the whole test suite (GPU tests included) and the quickstart on the GPU.
# Logs and a summary go to $OUT (the device tool brings them back). Usage on the device machine:
#   OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_ext_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$OUT/install.log" 2>&1
echo "install rc=$?" | tee "$OUT/summary.txt"
python3 -m pytest -q -p no:cacheprovider tests -rs > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? :: $(tail -n 1 "$OUT/pytest.log")" | tee -a "$OUT/summary.txt"
python3 examples/quickstart.py > "$OUT/quickstart.log" 2>&1
echo "quickstart rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/quickstart.log" | tee -a "$OUT/summary.txt"
