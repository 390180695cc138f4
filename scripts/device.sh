#!/usr/bin/env bash
# The one GPU driver (run on a machine with an NVIDIA GPU; nothing here needs the network):
#   scripts/device.sh tests    build the CUDA backend for the device's arch (sm_90a kernels included
#                              on an H100/H200) and run every GPU GoogleTest suite (tests/gpu),
#                              one process per suite in parallel; exit status 1 on any failure
#   scripts/device.sh bench    build + the C kernel benchmarks (bench/gpu): forward grid (prefill,
#                              decode, long-KV) and backward grid, flashport vs torch SDPA flash
#                              and cuDNN (needs torch with CUDA)
#   scripts/device.sh codegen  build with ptxas -v and print per-kernel registers, spills and SASS
#                              instruction counts (scripts/cuda_codegen_stats.py)
#   scripts/device.sh steps CMD...
#                              one device call's session: the Python package (CUDA, build-py/site-cuda)
#                              and gpu_tests (or $STEPS_TARGETS) built side by side, then each CMD (a shell command; $B is
#                              the CMake build dir) under `timeout $STEP_TIMEOUT` (default 150 s), its
#                              output in $OUT/steps.log and on stdout; the build logs in $OUT/logs.tgz
#                              (the device tool returns at most 8 files: keep $OUT small). E.g.
#                                scripts/device.sh steps "OUT=/tmp/device-logs GTEST_FILTER='CudaDecodeKernel.*' bash scripts/device.sh tests" \
#                                  "PYTHONPATH=build-py/site-cuda python3 bench/python/decode_check.py"
#   scripts/device.sh record   the steps session with the benchmarks of record of issues #17 and
#                              #18 (tables into $OUT/record; ~20 min on an H200, longer than one
#                              device call: start it with setsid and poll $OUT/steps.log for ALLDONE):
#                              bench_api grid + decode (bf16 and fp16, D 64/128/256), bench_coverage,
#                              bench_dropout, bench_f32, and bench_bwd's deterministic ratios;
#                              bench/results/targets.md is then refreshed from these files
#   scripts/device.sh profile  build fpbench and ncu (--set full, one warm call each) the points
#                              #17 still misses, at this commit: the forward at S1k (D64/D128,
#                              causal and not) and D128 S4k non-causal, decode B1 Sk8k (main
#                              kernel and combine), the D128 backward at S4k; $OUT/ncu_summary.md
#                              (scripts/ncu_summary.py: sections, pipes, stall reasons, and the
#                              stall samples by SASS opcode and instruction) and each report's
#                              CSVs (details, raw, source); PROFILE_POINTS
#                              (ncu_one.py's points: fwd:D:S:CAUSAL, decode:B:SK, bwd:D:S:CAUSAL)
#                              picks others
#   scripts/device.sh ab TREE [POINTS]
#                              interleaved A/B (bench/gpu/bench_ab_fwd.py): TREE (another checkout,
#                              e.g. `git archive BASE | tar -x -C TREE`, carried) as A against this
#                              tree as B, both fpbench builds in one process with cuDNN; POINTS as
#                              bench_ab_fwd.py takes them (head dims "64,128,256" or "decode")
# Environment: OUT (logs and tables; default /tmp/flashport-device), SUITE_TIMEOUT (s per test
# process, default 420), SUITE_SHARDS (processes per suite, gtest sharding; default 4), GTEST_FILTER (tests: only these, e.g. 'CudaBwd.*:CudaFwd.Dropout'), BUILD (default
# /tmp/build-device; an existing build dir is rebuilt from the tree it was configured from), CUDA_ARCH (default: the device's, e.g. 90), GTEST_DIR (a GTest CMake
# package dir when the system has none; .gtest/ in the tree is used when present).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-tests}
OUT=${OUT:-/tmp/flashport-device}
B=${BUILD:-/tmp/build-device}
mkdir -p "$OUT"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -1; } | tee "$OUT/device.txt"
arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')}

gtest_args=()
if [ -n "${GTEST_DIR:-}" ]; then gtest_args=(-DGTest_DIR="$GTEST_DIR");
elif [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi

build() {  # PTXAS_VERBOSE TARGETS...; SRC/B: source tree and build dir (default: the tree $B was
  # configured from, else this tree: a BUILD of another checkout keeps its own sources)
  local tb=$(date +%s) src=${SRC:-}
  if [ -z "$src" ] && [ -f "$B/CMakeCache.txt" ]; then
    src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$B/CMakeCache.txt")
  fi
  cmake -S "${src:-.}" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=ON \
    -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" \
    "-DFLASHPORT_CUDA_VERBOSE_PTXAS=$1" "${gtest_args[@]}" > "$OUT/configure.log" 2>&1 ||
    { tail -30 "$OUT/configure.log"; exit 1; }
  grep "flashport CUDA" "$OUT/configure.log"
  shift
  ninja -C "$B" -j"$(nproc)" "$@" > "$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 "error" "$OUT/build.log" | head -60; exit 1; }
  grep "library build took" "$OUT/build.log"
  echo "build: $(( $(date +%s) - tb )) s"
}

run_steps() {  # CMD...: the steps mode (see above); each CMD's output and rc in $OUT/steps.log
  mkdir -p /tmp/device-logs
  ( OUT=/tmp/device-logs bash python/device_test.sh build > /tmp/device-logs/pybuild.log 2>&1
    echo "python package: rc=$? at $(( $(date +%s) - t0 )) s" ) &
  ( build OFF ${STEPS_TARGETS:-gpu_tests} > /tmp/device-logs/gbuild.log 2>&1
    echo "${STEPS_TARGETS:-gpu_tests}: rc=$? at $(( $(date +%s) - t0 )) s" ) &
  wait
  for cmd in "$@"; do
    echo "== $cmd" | tee -a "$OUT/steps.log"
    B=$B timeout "${STEP_TIMEOUT:-150}" bash -c "$cmd" 2>&1 | tee -a "$OUT/steps.log"
    echo "== rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.log"
  done
  tar czf "$OUT/logs.tgz" -C /tmp device-logs
}

case "$mode" in
  tests)
    build OFF gpu_tests
    # SUITE_SHARDS processes per suite (gtest sharding): most of their time is the fp64 reference
    # on the host. GTEST_FILTER (optional) picks tests.
    picked=$("$B/tests/gpu/gpu_tests" --gtest_list_tests --gtest_filter="${GTEST_FILTER:-*}" |
      awk '/^[A-Za-z0-9_]+\.$/ {s = $1; next} /^  / {print s $1}')
    suites=$(echo "$picked" | cut -d. -f1 | sort -u)
    shards=${SUITE_SHARDS:-4}
    for s in $suites; do
      f=$(echo "$picked" | grep "^$s\." | paste -sd:)
      for k in $(seq 0 $((shards - 1))); do
        GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$k timeout "${SUITE_TIMEOUT:-420}" "$B/tests/gpu/gpu_tests" \
          --gtest_filter="$f" > "$OUT/t_${s}_$k.log" 2>&1 &
      done
    done
    wait
    fail=0
    for s in $suites; do
      passed=$(cat "$OUT"/t_${s}_*.log | grep -E '^\[  PASSED ' | grep -oE '[0-9]+ test' | awk '{n += $1} END {print n + 0}')
      if [ "$(cat "$OUT"/t_${s}_*.log | grep -c '^\[  PASSED ')" = "$shards" ] && ! grep -q '^\[  FAILED ' "$OUT"/t_${s}_*.log; then
        printf '%-24s %s tests passed\n' "$s" "$passed"
      else
        fail=1
        printf '%-24s FAILED\n' "$s"
        cat "$OUT"/t_${s}_*.log | grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|differs|Value of" | head -10
      fi
    done | tee "$OUT/gpu_tests_summary.txt"
    cat "$OUT"/t_*.log > "$OUT/gpu_tests.log" && rm -f "$OUT"/t_*.log
    grep -q FAILED "$OUT/gpu_tests_summary.txt" && fail=1
    echo "== gpu tests $([ $fail = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - t0 )) s"
    exit $fail
    ;;
  bench)
    build OFF fpbench flashport
    PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu/bench_fwd.py --lib "$B/bench/gpu/libfpbench.so" \
      --out "$OUT/fwd" > "$OUT/fwd_bench.log" 2>&1; echo "forward bench rc=$?"
    PYTHONUNBUFFERED=1 timeout 240 python3 bench/gpu/bench_bwd.py --build-dir "$B" --out-dir "$OUT/bwd" \
      --iters 10 > "$OUT/bwd_bench.log" 2>&1; echo "backward bench rc=$?"
    grep "^|" "$OUT/fwd/gpu_bench.md" 2>/dev/null | head -60
    grep "^|" "$OUT/bwd/gpu_bwd_bench.md" 2>/dev/null | head -30
    ;;
  codegen)
    targets=(flashport_gpu)
    [ "$arch" = 90 ] && targets+=(flashport_gpu_hopper)
    build ON "${targets[@]}"
    python3 scripts/cuda_codegen_stats.py "$B" "$OUT/build.log" | tee "$OUT/codegen.txt"
    ;;
  ab)
    tree=${2:?usage: scripts/device.sh ab TREE [POINTS]}
    build OFF fpbench
    SRC=$tree B=$B-ab build OFF fpbench
    PYTHONUNBUFFERED=1 timeout 400 python3 bench/gpu/bench_ab_fwd.py "$B-ab/bench/gpu/libfpbench.so" \
      "$B/bench/gpu/libfpbench.so" ${3:-} | tee "$OUT/ab.md"
    ;;
  steps)
    shift
    run_steps "$@"
    ;;
  profile)
    build OFF fpbench
    lib=$B/bench/gpu/libfpbench.so
    for pt in ${PROFILE_POINTS:-fwd:64:1024:0 fwd:64:1024:1 fwd:128:1024:0 fwd:128:1024:1 fwd:128:4096:0 decode:1:8192 bwd:128:4096:0}; do
      name=ncu_${pt//:/_}
      run=(python3 bench/gpu/ncu_one.py "$lib" "$pt")
      filter='regex:fwd_hopper|decode|combine|merge'
      [ "${pt%%:*}" = bwd ] && filter='regex:bwd_hopper'  # the main loop (the forward that makes out/lse runs first)
      timeout 300 ncu --clock-control none -k "$filter" --launch-skip 2 --launch-count 2 --set full \
        -f -o "$OUT/$name" "${run[@]}" > "$OUT/$name.log" 2>&1 || echo "ncu $pt: rc=$?"
      ncu --import "$OUT/$name.ncu-rep" --page details --csv > "$OUT/$name.csv" 2>/dev/null
      ncu --import "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>/dev/null
      ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_source.csv" 2>/dev/null
    done
    python3 scripts/ncu_summary.py "$OUT"/ncu_*.csv | tee "$OUT/ncu_summary.md"
    ;;
  record)
    R=$OUT/record
    mkdir -p "$R"
    py="PYTHONUNBUFFERED=1 PYTHONPATH=build-py/site-cuda python3"
    api="$py bench/python/bench_api.py --out $R"
    STEPS_TARGETS=fpbench STEP_TIMEOUT=${STEP_TIMEOUT:-900} run_steps \
      "$api --name api_d64 --modes grid --dims 64 --dtypes bf16,fp16 --reps 8" \
      "$api --name api_d128 --modes grid --dims 128 --dtypes bf16,fp16 --reps 8" \
      "$api --name api_d256 --modes grid --dims 256 --dtypes bf16,fp16 --reps 8" \
      "$api --name api_decode --modes decode,host" \
      "$py bench/gpu/bench_bwd.py --build-dir \$B --out-dir $R/bwd --iters 10" \
      "FLASHPORT_LOG=1 $py bench/python/bench_coverage.py --out $R" \
      "$py bench/python/bench_dropout.py --out $R" \
      "$py bench/python/bench_f32.py --out $R"
    echo "ALLDONE" | tee -a "$OUT/steps.log"
    ;;
  *)
    echo "usage: scripts/device.sh tests|bench|codegen|steps CMD...|ab TREE [POINTS]|record|profile" >&2
    exit 2
    ;;
esac
echo "== done in $(( $(date +%s) - t0 )) s"
