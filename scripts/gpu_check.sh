#!/usr/bin/env bash
# The H200 run, in parts; `gpu_check.sh PART [PART ...]` installs once, then runs each (one device call: 10 minutes):
#   tests:     install, every test (GPU ones included)
#   kernels:   the Hopper kernel tests only (tests/test_hopper_kernels.py); rest: every other test but EP
#   ep:        (2 GPUs) the expert-parallel tests on NCCL, the torchrun example; bench_ep: 1- vs 2-GPU benchmark
#   wgmma:     the w4a16 / localized / tactic tests (they add the wgmma tactics), memcheck, profile, benchmark
#   quant_wgmma: the w4a4 / w4a8 reference checks (they add the wgmma tactic), memcheck, their wgmma benchmark
#   grid:      the full issue-3 correctness grid (13,200 cases), shards $GRID_SHARD ("K/N ...", default 0/1),
#              500 s each; $GRID_ARGS (e.g. "--tokens 515") narrows every shard
#   ab_wgmma:  install, profile (each tactic of $AB_TACTICS at $AB_POINTS, default as prefill) and check
#              (wgmma-heavy kernel tests, or $AB_CHECK_FILE -k $AB_CHECK_K) each directory of $AB_DIRS, then
#              reinstall $MOE_EXT_KERNEL_DIR (unless alone);
#              an entry "BASE+OVERLAY" of $AB_DIRS (both parts) is BASE with the objects of folder OVERLAY over it
#   ab_routing: the routing tests, then the routing launches alone (benchmarks/bench_routing.py, $AB_ROUNDS runs), of
#              each build of $AB_DIRS
#   ab_bench:  whole forwards (graph replays, fused; $AB_MODES, default w4a16) of each directory of $AB_DIRS at
#              $AB_SHAPES x $AB_TOKENS (an entry "DIR@FORM" runs bench's --decode-form FORM, default rule)
#              with $AB_BENCH_TACTIC (default: the heuristic's, untuned), in interleaved rounds ($AB_ROUNDS), and
#              each point's energy per forward over $AB_ENERGY_SECONDS (default 0.5 s) of replays (NVML's counter);
#              each bench step is cut at $AB_STEP_SECONDS (default 200)
#   decode_boundary: whole forwards of FUSED_DECODE (8,-3,-3), the heuristic's tactic and the tuner's at
#              $DECODE_SHAPES x $DECODE_TOKENS (default T = 2, 3, 4, 6, 8), $AB_ROUNDS interleaved rounds: where
#              the one-launch decode should stop
#   tuner:     benchmarks/tuner_timings.py (the tuner's samples and sustained timings, then graph replays of its pick
#              and the peers) at $TUNER_SHAPES x $TUNER_TOKENS (default DeepSeek-V3 and EP8 at T=4096)
#   tactic_table: every valid tactic's cold whole forward at $TABLE_POINTS over $TABLE_DRAWS routing draws
#              (benchmarks/tactic_table.py), and where the heuristic's tactic ranks: the data for retuning it
#   fused_decode: tests/test_fused_decode.py, then whole forwards of the heuristic's tactic against FUSED_DECODE
#              (8,-3,-3) at $DECODE_SHAPES x $DECODE_TOKENS (default T = 1, 2, 4, 8), $AB_ROUNDS interleaved rounds
#   decode_forms: whole forwards (heuristic's tactic) with each FUSED_DECODE form of $DECODE_FORMS (bench's
#              --decode-form: rule, fc2, partials, shallow_ring, split_gemm2) at $DECODE_SHAPES x $DECODE_TOKENS,
#              $AB_ROUNDS interleaved rounds
#   ab_tactics: per-kernel profile of each tactic of $AB_TACTICS ("default" or "tile,split1,split2") at $AB_POINTS
#   sweep:     the issue-4 sweep (w4a16, fused, moe_ext + both peers) into $OUT/h200.json (carry triton_kernels);
#              $SWEEP_TOKENS and $SWEEP_SHAPES narrow it
#   prefill:   per-kernel profile of the default tactic at T=4096 on five shapes (the wgmma GEMMs)
#   prefill_ncu: ncu sections of the wgmma GEMMs at $PREFILL_POINTS (default mixtral-8x7b:4096)
#   timeline:  decode_fused's per-CTA timeline (its timeline build, benchmarks/decode_timeline.py) at decode points
#   ncu_source: ncu --set full of the first $NCU_KERNEL launch at each of $NCU_POINTS: details and per-SASS stalls
#              ($NCU_PROFILE_ARGS go to profile_kernels.py, e.g. "--min-local-pairs 1" for EP8 at T=1)
#   routing_cost: graph replays with and without the routing launch at small T ($ROUTING_POINTS), into $OUT
#   tma_stream: benchmarks/tma_box_stream.cu, the TMA copy path alone (box widths, bytes in flight, L2 promotion)
#   launch_cost: benchmarks/graph_launch_cost.cu, a one-node graph's replay against its kernel's span per launch
#              attribute set (cooperative, PDL: the one-launch decode's), into $OUT/graph_launch_cost.txt
#   tile_choice: per-kernel times of the default tactic vs (128, wgmma, wgmma) where experts get 16-64 rows; T=16384
#   examples:  install, memcheck of every kernel, the examples, host overhead, fused vs deterministic finalize
#   bench:     install, the whole-forward benchmark against the peers, host overhead, per-kernel profile
#   decode:    T <= 64 breakdown: graph replays (both finalize modes), per-kernel profile, ncu of each kernel alone
#   quant_modes: w4a16 / w4a4 / w4a8 whole forwards on every shape and $QUANT_TOKENS ($QUANT_TACTIC: default)
#   quant_profile: per-kernel times of w4a16 / w4a4 / w4a8 (default tactic) at $QUANT_POINTS
#   formats:   the in-kernel e4m3 / MXFP8 conversions against moe_ext.quant, JIT-compiled (carry .offline)
#   select:    the tests PYTEST_K selects; variants: stream_variants.py once per line of VARIANT_ARGS (carry .offline)
#   localized: install, the localized / fused-finalize / graph tests, memcheck, the localized benchmark
# A summary and logs.tgz go to $OUT. Prepare here, then run there (the device tool, carry .kernels):
#   python3 -m moe_ext.kernels.sm90.build .kernels          # here, with CuTe-DSL
#   OUT=$OUT bash scripts/gpu_check.sh tests                # there
#   OUT=$OUT bash scripts/gpu_check.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-tests}
OUT=${OUT:-/tmp/moe_ext_gpu}
mkdir -p "$OUT"
# The device returns only a few files: logs go to $LOG and travel packed in $OUT/logs.tgz (repacked after each
# step, so a run cut short still brings back what it finished); $OUT holds that, summary.txt and the JSON records.
LOG=$(mktemp -d)
MERGED=$(mktemp -d)  # kernel_dir's merged A/B directories
pack() {  # atomic, so a call cut short mid-pack still brings back the last whole archive
  cp "$OUT/summary.txt" "$LOG/" 2>/dev/null
  tar czf "$LOG.$BASHPID.tgz" -C "$LOG" . 2>/dev/null; mv -f "$LOG.$BASHPID.tgz" "$OUT/logs.tgz"
}
trap pack EXIT
export PYTHONUNBUFFERED=1
# The five shapes at T=4096, where the default tactic runs the wgmma GEMMs (parts prefill and ab_wgmma).
PREFILL_T4096=qwen3-30b-a3b:4096,deepseek-v3-ep8:4096,mixtral-8x7b:4096,deepseek-v3:4096,gpt-oss-120b:4096
# The issue-4 shapes (parts sweep and quant_modes).
SHAPES=qwen3-30b-a3b,deepseek-v3-ep8,gpt-oss-120b,mixtral-8x7b,deepseek-v3
export MOE_EXT_KERNEL_DIR=${MOE_EXT_KERNEL_DIR:-$PWD/.kernels}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$LOG/env.txt" 2>&1
: > "$OUT/summary.txt"
# ab_wgmma, ab_bench, ab_routing and timeline install their directories themselves, formats needs no launcher (it
# JIT-compiles its kernels) and tma_stream and launch_cost only nvcc: alone, none of them installs the default one first.
if [ "$PARTS" != ab_wgmma ] && [ "$PARTS" != ab_bench ] && [ "$PARTS" != ab_routing ] && [ "$PARTS" != formats ] \
   && [ "$PARTS" != tma_stream ] && [ "$PARTS" != timeline ] && [ "$PARTS" != launch_cost ]; then
  MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$LOG/install.log" 2>&1
  echo "install rc=$?" | tee -a "$OUT/summary.txt"
fi
step() {  # step NAME TIMEOUT COMMAND...: run, log to $LOG/NAME.log, note rc and the last line
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "$name rc=$? :: $(tail -n 1 "$LOG/$name.log")" | tee -a "$OUT/summary.txt"
  pack
}
profile_tactics() {  # profile_tactics PREFIX LABEL: each tactic of $AB_TACTICS at $AB_POINTS, sums into the summary
  local t name args
  for t in ${AB_TACTICS:-default}; do
    args=()
    [ "$t" = default ] || args=(--tactic "$t")
    name="$1${t//,/_}"
    step "$name" 200 python3 benchmarks/profile_kernels.py --points "${AB_POINTS:-$PREFILL_T4096}" "${args[@]}"
    grep "us of kernels" "$LOG/$name.log" | awk -v t="$2$t" '{s = s " " $1 " " $5} END {print t ":" s}' \
      >> "$OUT/summary.txt"
  done
}
tests_step() {  # tests_step NAME TIMEOUT PYTEST-ARGS...: a pytest step, its failures copied into the summary
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider "$@"
  grep -E "^(FAILED|ERROR)" "$LOG/$name.log" | head -20 | tee -a "$OUT/summary.txt"
}
dir_tag() {  # dir_tag D: an AB_DIRS entry as a file-name part (".kernels+.kernels_x/y" -> "kernels_kernels_x_y")
  local tag=${1//[+\/]/_}
  echo "${tag//./}"
}
kernel_dir() {  # kernel_dir D: the kernel directory D names; "BASE+OVERLAY" is a copy of BASE with OVERLAY's files
  # over it (an A/B variant that carries only the objects it changes)
  if [[ $1 == *+* ]]; then
    local merged="$MERGED/$(dir_tag "$1")"  # not under $LOG: pack() archives that
    [ -d "$merged" ] || { cp -r "$PWD/${1%%+*}" "$merged" && cp "$PWD/${1#*+}"/* "$merged/"; }
    echo "$merged"
  else
    echo "$PWD/$1"
  fi
}
bench_summary() {  # bench_summary JSON LABEL: one summary line of a bench record's points (and energy, if timed)
  python3 -c "import json, sys; print(sys.argv[2] + ':', ' '.join(f\"{r['shape']}:{r['T']}\"
    + ('' if r['quant_mode'] == 'w4a16' else ':' + r['quant_mode']) + f\" {r['us']:.1f}\"
    + (f\" ({r['energy_mj']:.1f} mJ)\" if 'energy_mj' in r else '')
    for r in json.load(open(sys.argv[1])) if 'us' in r))" "$1" "$2" >> "$OUT/summary.txt"
}
decode_rounds() {  # decode_rounds NAME OPTION VALUES TOKENS [ARG ...]: $AB_ROUNDS interleaved rounds of whole forwards
  # (w4a16, fused, graph replays; ARGs to bench) at $DECODE_SHAPES x ${DECODE_TOKENS:-TOKENS}, a run a value of OPTION
  local name=$1 option=$2 values=$3 tokens=$4 round value run; shift 4
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for value in $values; do
      run="${name}_${value//[,-]/_}_$round"
      step "$run" 200 python3 -m moe_ext.bench --shapes "${DECODE_SHAPES:-$SHAPES}" --tokens "${DECODE_TOKENS:-$tokens}" \
        --modes w4a16 --finalize fused --impls moe_ext "$@" "$option" "$value" --iters 50 \
        --max-seconds-per-point 1.0 --energy-seconds 0 --out "$OUT/$run.json"
      bench_summary "$OUT/$run.json" "$value round $round"
    done
  done
}
for PART in $PARTS; do
echo "== $PART" >> "$OUT/summary.txt"
if [ "$PART" = tests ]; then
  tests_step pytest 540 tests -rs --durations=15
elif [ "$PART" = kernels ]; then
  tests_step pytest_kernels 400 tests/test_hopper_kernels.py -rs --durations=10
elif [ "$PART" = rest ]; then
  tests_step pytest_rest 400 tests --ignore=tests/test_hopper_kernels.py \
    --ignore=tests/test_distributed.py -rs --durations=10
elif [ "$PART" = ep ]; then
  tests_step pytest_ep 300 tests/test_distributed.py -rs
  step example_ep 120 torchrun --nproc_per_node=2 examples/expert_parallel.py --tokens 64
elif [ "$PART" = bench_ep ]; then
  step bench_ep1 150 torchrun --nproc_per_node=1 benchmarks/bench_expert_parallel.py \
    --tokens 64,128,1024,2048,8192,16384 --out "$OUT/h200x2_expert_parallel.json"
  step bench_ep2 150 torchrun --nproc_per_node=2 benchmarks/bench_expert_parallel.py --tokens 64,1024,8192 \
    --out "$OUT/h200x2_expert_parallel.json"
elif [ "$PART" = wgmma ]; then
  tests_step pytest_wgmma 300 tests/test_hopper_kernels.py tests/test_localized.py \
    tests/test_tuning.py -k "w4a16 or wgmma or localized or tactic" -rs
  step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_smoke.py
  step profile_wgmma 60 python3 benchmarks/profile_kernels.py \
    --points qwen3-30b-a3b:4096,deepseek-v3-ep8:4096,mixtral-8x7b:4096,deepseek-v3:4096
  step profile_stream 60 python3 benchmarks/profile_kernels.py --tactic 128,1,1 \
    --points qwen3-30b-a3b:4096,deepseek-v3-ep8:4096,mixtral-8x7b:4096,deepseek-v3:4096
  step bench_wgmma 220 python3 -m moe_ext.bench --tokens 1024,4096 --modes w4a16 --finalize fused --iters 20 \
    --max-seconds-per-point 1.5 --out "$OUT/h200_wgmma.json"
elif [ "$PART" = quant_wgmma ]; then
  tests_step pytest_quant 330 tests/test_hopper_kernels.py -k "w4a4 or w4a8" -rs \
    --maxfail=10
  step bench_quant 200 python3 -m moe_ext.bench --tokens 4096 --modes w4a16,w4a4,w4a8 --finalize fused --iters 10 \
    --impls moe_ext --max-seconds-per-point 1.5 --out "$OUT/h200_quant_wgmma.json"
elif [ "$PART" = quant_modes ]; then  # issue 4's "w4a4 and w4a8 within 15% of w4a16", one tactic policy for all
  step bench_quant_modes "${QUANT_SECONDS:-400}" python3 -m moe_ext.bench \
    --shapes "$SHAPES" \
    --tokens "${QUANT_TOKENS:-1,8,64,256,1024,4096,16384}" --modes w4a16,w4a4,w4a8 --finalize fused \
    --impls moe_ext --tactic "${QUANT_TACTIC:-default}" --iters 20 --max-seconds-per-point 1.0 \
    --out "$OUT/h200_quant_modes.json"
elif [ "$PART" = quant_profile ]; then  # where the quantized modes' extra time goes: per-kernel, each mode
  for m in w4a16 w4a4 w4a8; do
    step "profile_$m" 120 python3 benchmarks/profile_kernels.py --mode "$m" --fused \
      --points "${QUANT_POINTS:-qwen3-30b-a3b:8,qwen3-30b-a3b:64,mixtral-8x7b:64}"
  done
elif [ "$PART" = select ]; then  # PYTEST_K: a -k expression over every test file but the 2-GPU one
  tests_step pytest_select 400 tests --ignore=tests/test_distributed.py \
    -k "$PYTEST_K" -rs
elif [ "$PART" = variants ]; then  # VARIANT_ARGS: one stream_variants.py argument list per line (needs .offline)
  tar xJf .offline/cutedsl-4.8.1-py312.tar.xz -C /tmp && . /tmp/cutedsl-4.8.1-py312/env.sh
  n=0
  while IFS= read -r args; do
    [ -n "$args" ] || continue
    n=$((n + 1))
    step "variants_$n" 150 env PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 benchmarks/stream_variants.py $args \
      --out "$OUT/variants_$n.json"
  done <<< "$VARIANT_ARGS"
elif [ "$PART" = formats ]; then  # the kernels' number formats, JIT-compiled with CuTe-DSL (needs .offline)
  (tar xJf .offline/cutedsl-4.8.1-py312.tar.xz -C /tmp && . /tmp/cutedsl-4.8.1-py312/env.sh &&
   tests_step formats 300 tests/test_device_formats.py -rs)
elif [ "$PART" = memcheck ]; then
  step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_smoke.py
elif [ "$PART" = grid ]; then  # GRID_SHARD: one or more K/N, space-separated; GRID_SECONDS bounds each; one JSON each
  for shard in ${GRID_SHARD:-0/1}; do
    name=grid_${shard%/*}of${shard#*/}
    step "$name" $(( ${GRID_SECONDS:-500} + 40 )) python3 scripts/correctness_grid.py --shard "$shard" \
      --max-seconds "${GRID_SECONDS:-500}" ${GRID_ARGS:-} --out "$OUT/$name.json"
    grep FAILED "$LOG/$name.log" | head -20 >> "$OUT/summary.txt"
    rm -f "$LOG/$name.log"
  done
elif [ "$PART" = prefill ]; then  # per-kernel times where the wgmma GEMMs run (the default tactic at T=4096)
  step profile_prefill 200 python3 benchmarks/profile_kernels.py \
    --points $PREFILL_T4096
elif [ "$PART" = ab_wgmma ]; then  # AB_DIRS: kernel directories (same kernels, wgmma variants); install + profile each
  # at $AB_POINTS (default: the five shapes at T=4096) with each tactic of $AB_TACTICS ("default" or "tile,s1,s2")
  for d in ${AB_DIRS:-.kernels .kernels_dec2 .kernels_dec2lean}; do
    dir=$(kernel_dir "$d"); tag=$(dir_tag "$d")
    MOE_EXT_KERNEL_DIR=$dir MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$LOG/install_$tag.log" 2>&1
    echo "install $d rc=$?" | tee -a "$OUT/summary.txt"
    profile_tactics "prefill_${tag}_" "$d "
    [ "$dir" = "$MOE_EXT_KERNEL_DIR" ] || [ "${AB_CHECK:-1}" = 0 ] || tests_step "check_$tag" 150 \
      "${AB_CHECK_FILE:-tests/test_hopper_kernels.py}" \
      -k "${AB_CHECK_K:-large_token_count or (shapes_and and 7168 and w4a16) or part_filled}"
  done
  [ "$PARTS" = ab_wgmma ] || MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > /dev/null 2>&1
elif [ "$PART" = ab_bench ]; then  # what per-kernel sums miss: gaps between kernels, overlap under PDL
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for entry in ${AB_DIRS:-.kernels}; do
      d=${entry%@*}; form=rule
      [[ $entry == *@* ]] && form=${entry#*@}
      dir=$(kernel_dir "$d"); tag=$(dir_tag "$d")
      [ "$form" = rule ] || tag="${tag}_$form"
      MOE_EXT_KERNEL_DIR=$dir MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$LOG/install_$tag.log" 2>&1
      name="ab_bench_${tag}_$round"
      step "$name" "${AB_STEP_SECONDS:-200}" python3 -m moe_ext.bench --shapes "${AB_SHAPES:-qwen3-30b-a3b,deepseek-v3-ep8}" \
        --tokens "${AB_TOKENS:-1,8,64}" --modes "${AB_MODES:-w4a16}" --finalize fused --impls moe_ext \
        --tactic "${AB_BENCH_TACTIC:-default}" --decode-form "$form" --iters 50 --max-seconds-per-point 1.0 \
        --energy-seconds "${AB_ENERGY_SECONDS:-0.5}" --out "$OUT/$name.json"
      bench_summary "$OUT/$name.json" "$entry round $round"
    done
  done
  [ "$PARTS" = ab_bench ] || MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > /dev/null 2>&1
elif [ "$PART" = fused_decode ]; then  # the one-launch small-T forward: its tests, then whole forwards (graph
  # replays) with the heuristic's tactic and with FUSED_DECODE, in interleaved rounds ($DECODE_SHAPES x $DECODE_TOKENS)
  tests_step pytest_fused_decode 240 tests/test_fused_decode.py -rs
  decode_rounds fused_decode --tactic "default 8,-3,-3" 1,2,4,8
elif [ "$PART" = decode_forms ]; then  # launcher.decode_fc2_by_gemm1's rule against each form it chooses from
  decode_rounds decode_form --decode-form "${DECODE_FORMS:-fc2 partials}" 1,2,4,8 --tactic default
elif [ "$PART" = tactic_table ]; then
  step tactic_table 560 python3 benchmarks/tactic_table.py --out "$OUT/tactic_table.json" \
    --draws "${TABLE_DRAWS:-5}" ${TABLE_POINTS:+--points "$TABLE_POINTS"}
  sed -n '/^shape /,$p' "$LOG/tactic_table.log" >> "$OUT/summary.txt"
elif [ "$PART" = decode_boundary ]; then  # the one-launch decode, the heuristic (it up to its boundary, a chain past
  # it) and the tuner's pick (mostly the chain at T=8 in session 56) at small T: the data for default_tactic's rule
  decode_rounds decode_boundary --tactic "8,-3,-3 default tuned" 2,3,4,6,8
elif [ "$PART" = tuner ]; then  # what the tuner weighs (its samples, and its sustained timings of long forwards)
  # and the graph replays of what it picked, at $TUNER_SHAPES x $TUNER_TOKENS, all three impls
  step tuner 400 env PYTHONPATH="$PWD:$PWD/.offline/triton_kernels_v3.6" python3 benchmarks/tuner_timings.py \
    --shapes "${TUNER_SHAPES:-deepseek-v3,deepseek-v3-ep8}" --tokens "${TUNER_TOKENS:-4096}" --modes w4a16 \
    --finalize fused --impls moe_ext,torch_grouped_mm_bf16,triton_kernels_mxfp4 --iters 20 \
    --max-seconds-per-point 1.0 --out "$OUT/tuned.json"
  grep -E "timings|moe_ext " "$LOG/tuner.log" | cut -c1-300 >> "$OUT/summary.txt"
elif [ "$PART" = ab_routing ]; then  # AB_DIRS (e.g. ".kernels .kernels+.kernels_route"): each build's routing tests
  # and its routing launches alone (benchmarks/bench_routing.py at $ROUTING_TOKENS), $AB_ROUNDS runs a build (a launch
  # of microseconds is not power-capped: one install a build, rounds back to back)
  for d in ${AB_DIRS:-.kernels}; do
    dir=$(kernel_dir "$d"); tag=$(dir_tag "$d")
    MOE_EXT_KERNEL_DIR=$dir MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$LOG/install_$tag.log" 2>&1
    tests_step "pytest_routing_$tag" 200 tests/test_routing_kernel.py -rs
    for round in $(seq "${AB_ROUNDS:-2}"); do
      step "routing_${tag}_$round" 200 python3 benchmarks/bench_routing.py \
        --tokens "${ROUTING_TOKENS:-1,64,1024,4096,16384}" --out "$OUT/routing_${tag}_$round.json"
      grep -E "T=(1|4096|16384) " "$LOG/routing_${tag}_$round.log" | sed "s/^/$tag $round: /" >> "$OUT/summary.txt"
    done
  done
  [ "$PARTS" = ab_routing ] || MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > /dev/null 2>&1
elif [ "$PART" = routing_cost ]; then  # what the routing launch costs the decode forwards' critical path
  step routing_cost 300 python3 benchmarks/routing_cost.py --out "$OUT/routing_cost.json" \
    ${ROUTING_POINTS:+--points "$ROUTING_POINTS"}
  grep "routing on the path" "$LOG/routing_cost.log" >> "$OUT/summary.txt"
elif [ "$PART" = tma_stream ]; then  # no launcher, no CuTe-DSL: nvcc and the driver only
  step tma_stream 120 bash -c "nvcc -O2 -std=c++17 -arch=sm_90a -o '$LOG/tma_box_stream' benchmarks/tma_box_stream.cu \
    && '$LOG/tma_box_stream'"
  cp "$LOG/tma_stream.log" "$OUT/tma_box_stream.txt"
elif [ "$PART" = launch_cost ]; then  # no launcher, no CuTe-DSL: nvcc and the driver only
  step launch_cost 120 bash -c "nvcc -O2 -std=c++17 -arch=sm_90a -o '$LOG/graph_launch_cost' \
    benchmarks/graph_launch_cost.cu && '$LOG/graph_launch_cost'"
  cp "$LOG/launch_cost.log" "$OUT/graph_launch_cost.txt"
elif [ "$PART" = ab_tactics ]; then  # AB_TACTICS: tactics ("default": the heuristic's), profiled at $AB_POINTS
  profile_tactics prefill_tactic_ ""
elif [ "$PART" = sweep ]; then  # issue 4's sweep, w4a16 fused, all three impls (carry .offline/triton_kernels_v3.6)
  step sweep "${SWEEP_SECONDS:-560}" env PYTHONPATH="$PWD:$PWD/.offline/triton_kernels_v3.6" python3 -m moe_ext.bench \
    --shapes "${SWEEP_SHAPES:-$SHAPES}" \
    --tokens "${SWEEP_TOKENS:-1,8,64,256,1024,4096,16384}" --modes w4a16 --finalize fused \
    --impls moe_ext,torch_grouped_mm_bf16,triton_kernels_mxfp4 --iters 20 --max-seconds-per-point 1.0 \
    --out "$OUT/h200.json"
elif [ "$PART" = prefill_ncu ]; then  # what bounds the wgmma GEMMs: pipes, shared memory, stalls (one launch each)
  step ncu_prefill 300 ncu --clock-control none --profile-from-start off -k regex:wgmma --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section SchedulerStats --section WarpStateStats --section Occupancy \
    python3 benchmarks/profile_kernels.py --points ${PREFILL_POINTS:-mixtral-8x7b:4096} --ncu
elif [ "$PART" = timeline ]; then  # decode_fused's per-CTA timeline (benchmarks/decode_timeline.py) from the build
  # $TIMELINE_DIR (default .kernels+.kernels_phase/timeline), at $TIMELINE_POINTS, then the split_gemm2 form at
  # $TIMELINE_SPLIT_POINTS; reinstalls $MOE_EXT_KERNEL_DIR after (unless alone)
  dir=$(kernel_dir "${TIMELINE_DIR:-.kernels+.kernels_phase/timeline}")
  MOE_EXT_KERNEL_DIR=$dir MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > "$LOG/install_timeline.log" 2>&1
  echo "install $dir rc=$?" | tee -a "$OUT/summary.txt"
  step timeline 200 python3 benchmarks/decode_timeline.py --out "$OUT/decode_timeline.json" \
    --points "${TIMELINE_POINTS:-qwen3-30b-a3b:1,deepseek-v3-ep8:1,gpt-oss-120b:1,mixtral-8x7b:1,qwen3-30b-a3b:2}"
  step timeline_split2 150 python3 benchmarks/decode_timeline.py --split-gemm2 \
    --out "$OUT/decode_timeline_split2.json" --points "${TIMELINE_SPLIT_POINTS:-deepseek-v3-ep8:1,gpt-oss-120b:1,mixtral-8x7b:1}"
  cp "$LOG/timeline.log" "$LOG/timeline_split2.log" "$OUT/" 2>/dev/null
  [ "$PARTS" = timeline ] || MOE_EXT_REQUIRE_LAUNCHER=1 bash scripts/install.sh > /dev/null 2>&1
elif [ "$PART" = ncu_source ]; then  # full ncu set + per-SASS stall samples of $NCU_KERNEL at each of $NCU_POINTS
  for pt in ${NCU_POINTS:-deepseek-v3:1024}; do
    rep="$LOG/ncu_${pt//:/_}"
    step "ncu_${pt//:/_}" 240 ncu --clock-control none --profile-from-start off -k "regex:${NCU_KERNEL:-gemm1}" \
      --launch-count 1 --set full --import-source no -f -o "$rep" python3 benchmarks/profile_kernels.py \
      --points "$pt" --ncu ${NCU_PROFILE_ARGS:-}
    ncu -i "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
    python3 benchmarks/ncu_stalls.py "$rep.sass.csv" --opcodes --regions > "$rep.stalls.txt" 2>&1
    rm -f "$rep.ncu-rep"
    pack
  done
elif [ "$PART" = tile_choice ]; then
  points=deepseek-v3:1024,gpt-oss-120b:1024,deepseek-v3-ep8:512,qwen3-30b-a3b:512,mixtral-8x7b:256
  step profile_default 80 python3 benchmarks/profile_kernels.py --points $points
  step profile_wgmma128 80 python3 benchmarks/profile_kernels.py --points $points --tactic 128,0,0
  step bench_16k 150 python3 -m moe_ext.bench --tokens 16384 --modes w4a16 --finalize fused --iters 10 \
    --max-seconds-per-point 1.5 --out "$OUT/h200_wgmma_16k.json"
elif [ "$PART" = examples ]; then
  step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_smoke.py
  step serving_loop 60 python3 examples/serving_loop.py --steps 50
  step compile_layer 90 python3 examples/compile_layer.py
  step quickstart 60 python3 examples/quickstart.py
  step host_overhead 90 python3 -m moe_ext.bench --host-overhead --shapes qwen3-30b-a3b,deepseek-v3-ep8 \
    --modes w4a16 --finalize fused,deterministic --out "$OUT/h200_host_overhead.json"
  step finalize_modes 150 python3 -m moe_ext.bench --shapes qwen3-30b-a3b,deepseek-v3-ep8,deepseek-v3 \
    --tokens 1,64 --modes w4a16 --finalize fused,deterministic --impls moe_ext --iters 30 \
    --max-seconds-per-point 1.5 --out "$OUT/h200_finalize_modes.json"
elif [ "$PART" = decode ]; then
  points=${DECODE_POINTS:-qwen3-30b-a3b:1,deepseek-v3-ep8:1,mixtral-8x7b:1,deepseek-v3:1}
  step bench_decode 200 python3 -m moe_ext.bench --tokens ${DECODE_TOKENS:-1,8,64} --modes w4a16 \
    --finalize fused,deterministic --impls moe_ext --iters 30 --max-seconds-per-point 1.0 --out "$OUT/h200_decode.json"
  step profile_decode 60 python3 benchmarks/profile_kernels.py --points $points --fused
  step ncu_decode 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/profile_kernels.py --points $points --fused --ncu
elif [ "$PART" = decode_stalls ]; then  # where the streaming GEMMs' warps wait (stall reasons, hottest SASS)
  step ncu_stalls 300 ncu --clock-control none --profile-from-start off -k regex:gemm --section WarpStateStats \
    --section SourceCounters --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    python3 benchmarks/profile_kernels.py --points ${DECODE_POINTS:-qwen3-30b-a3b:1,mixtral-8x7b:1} --fused --ncu
elif [ "$PART" = localized ]; then
  tests_step pytest_localized 300 tests/test_localized.py tests/test_plan.py \
    tests/test_hopper_kernels.py -k "localized or fused_finalize or graph_capture or acceptance" -rs
  step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_smoke.py
  step compile_layer 90 python3 examples/compile_layer.py
  step bench_localized 240 python3 benchmarks/bench_localized.py --out "$OUT/h200_localized.json"
elif [ "$PART" = bench_fused ]; then
  step bench_localized 240 python3 benchmarks/bench_localized.py --out "$OUT/h200_localized.json"
  step bench_fused 300 python3 -m moe_ext.bench --tokens 1,64,1024,4096 --modes w4a16 --finalize fused \
    --iters 30 --max-seconds-per-point 1.5 --out "$OUT/h200_fused.json"
else
  step bench_moe 420 python3 -m moe_ext.bench --tokens 1,64,1024,4096 --modes w4a16,w4a4,w4a8 \
    --finalize deterministic --iters 30 --max-seconds-per-point 1.5 --out "$OUT/h200.json"
  step host_overhead 60 python3 -m moe_ext.bench --host-overhead --shapes qwen3-30b-a3b,deepseek-v3-ep8 \
    --modes w4a16 --finalize deterministic --out "$OUT/h200_host_overhead.json"
  step profile 60 python3 benchmarks/profile_kernels.py
fi
done
