#!/usr/bin/env bash
# The end-of-session GPU run (device tool), in two calls that share the build on a warm machine:
#   scripts/device_final.sh check   build (sm_90) + every GPU test + the Python suite on CUDA
#   scripts/device_final.sh bench   build (reused if warm) + forward grid (prefill, decode, long-KV)
#                                   + backward grid, flashport vs torch SDPA flash and cuDNN
# Logs and tables go under $OUT; a short summary is printed last. Needs .gtest carried.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-check}
OUT=${OUT:-/tmp/fp_final_out}
mkdir -p "$OUT"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -1
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } | tee "$OUT/device.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
B=/tmp/build-final
build() {
  local tb=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
    -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${gtest_args[@]}" \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  grep "flashport CUDA" "$OUT/build.log"
  ninja -C $B -j"$(nproc)" "$@" >> "$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 "error" "$OUT/build.log" | head -60; exit 1; }
  echo "build: $(( $(date +%s) - tb )) s"
}

if [ "$mode" = check ]; then
  # The Python package builds on the CPU cores while the GPU tests run.
  (FLASHPORT_CUDA_ARCHS=90 bash python/device_test.sh build > "$OUT/py_build.log" 2>&1; echo "py build rc=$?" >> "$OUT/py_build.log") &
  pybuild=$!
  build gpu_tests
  # Suites run as parallel processes: most of their time is the fp64 reference on the host.
  tt=$(date +%s)
  suites=$($B/tests/gpu/gpu_tests --gtest_list_tests | grep -E '^[A-Za-z0-9_]+\.$' | tr -d '.')
  for s in $suites; do
    timeout 420 $B/tests/gpu/gpu_tests --gtest_filter="$s.*" > "$OUT/t_$s.log" 2>&1 &
  done
  wait $pybuild
  tail -2 "$OUT/py_build.log"
  tp=$(date +%s)
  (timeout 300 bash python/device_test.sh test > /dev/null 2>&1; echo "pytest rc=$? ($(( $(date +%s) - tp )) s)" > "$OUT/pytest_rc.txt") &
  wait
  for s in $suites; do
    printf '%-20s %s\n' "$s" "$(grep -E '^\[  (PASSED|FAILED) ' "$OUT/t_$s.log" | tr '\n' ' ')"
    grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|differs|Value of" "$OUT/t_$s.log" | head -10
  done | tee "$OUT/gpu_tests_summary.txt"
  cat "$OUT"/t_*.log > "$OUT/gpu_tests_$gpu.log"; rm -f "$OUT"/t_*.log
  echo "gpu_tests: $(grep -c PASSED "$OUT/gpu_tests_summary.txt") suites passed, $(grep -c FAILED "$OUT/gpu_tests_summary.txt") with failures ($(( $(date +%s) - tt )) s)"
  cat "$OUT/pytest_rc.txt"
  cp build-py/python-tests-*.txt "$OUT/" 2>/dev/null
  tail -3 "$OUT"/python-tests-*.txt 2>/dev/null
fi

if [ "$mode" = bench ]; then
  build fpbench flashport
  tf=$(date +%s)
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu/bench_fwd.py --lib $B/bench/gpu/libfpbench.so \
    --out "$OUT/fwd" > "$OUT/fwd_bench.log" 2>&1
  echo "fwd bench rc=$? ($(( $(date +%s) - tf )) s)"
  grep -iE "error|Traceback" "$OUT/fwd_bench.log" | head -5
  tb=$(date +%s)
  PYTHONUNBUFFERED=1 timeout 240 python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT/bwd" \
    --iters 10 > "$OUT/bwd_bench.log" 2>&1
  echo "bwd bench rc=$? ($(( $(date +%s) - tb )) s)"
  grep -iE "error|Traceback" "$OUT/bwd_bench.log" | head -5
  cat "$OUT/fwd/gpu_bench.md" 2>/dev/null | grep "^|" | head -60
  cat "$OUT/bwd/gpu_bwd_bench.md" 2>/dev/null | grep "^|" | head -30
fi
rm -f "$OUT/build.log"
echo "== done in $(( $(date +%s) - t0 )) s"
