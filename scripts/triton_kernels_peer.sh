#!/usr/bin/env bash
# The triton_kernels peer of the sweep (moe_ext.bench_peers.TritonKernelsMxfp4) for the H200's Triton 3.6: its
# Python package at commit 85400f80 (the release/3.6.x branch point), unpacked into the ignored
# .offline/triton_kernels_v3.6, which the sweep puts on PYTHONPATH (carry it to the device).
#   scripts/triton_kernels_peer.sh GIT_DIR
# GIT_DIR: any clone holding that commit: triton-lang/triton, or its mirror triton-lang/Triton-to-tile-IR (the
# library's `fetch github:triton-lang/Triton-to-tile-IR`; the triton repository itself is too large to fetch there).
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=85400f80bf859a34ad7a746ffda877faf80312ab
git_dir=${1:?usage: scripts/triton_kernels_peer.sh GIT_DIR}
rm -rf .offline/triton_kernels_v3.6
mkdir -p .offline/triton_kernels_v3.6
git --git-dir="$git_dir" archive "$COMMIT" python/triton_kernels/triton_kernels \
  | tar -x --strip-components=2 -C .offline/triton_kernels_v3.6
ls .offline/triton_kernels_v3.6/triton_kernels/matmul_ogs.py > /dev/null
echo "triton_kernels at $COMMIT in .offline/triton_kernels_v3.6"
