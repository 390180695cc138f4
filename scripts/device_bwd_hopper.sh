#!/usr/bin/env bash
# The Hopper backward's device script (device tool, carry .gtest): sm_90 build of the library and
# gpu_tests, the Hopper backward tests, the existing backward tests (which now take the Hopper
# kernel where it fits), then the backward benchmark against torch flash (FA2) and cuDNN.
# Logs under $OUT; a short summary last.
#   scripts/device_bwd_hopper.sh [quick|full|tests]    (BENCH_ARGS: extra bench_bwd.py arguments)
#   quick: benchmark at S = 4k only; full: the whole grid; tests: no benchmark.
#   DIAG=1: before the benchmark builds the timing-only variants FLASHPORT_HOPPER_BWD_DIAG=1
#   (no dQ atomics) and 2 (no dQ product, no atomics) and times D64/D128 at S = 4k with the driver.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-quick}
OUT=${OUT:-/tmp/fp_out}
mkdir -p "$OUT"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
nvcc --version | tail -1

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
B=build-bwd-hopper
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_CLI=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DFLASHPORT_CUDA_VERBOSE_PTXAS=ON "${gtest_args[@]}" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
ninja -C $B -j16 gpu_tests flashport >> "$OUT/build.log" 2>&1 || { grep -B2 -A12 error "$OUT/build.log" | head -80; exit 1; }
echo "build: $(elapsed) s"
grep -A2 "bwd_hopper_kernel" "$OUT/build.log" | grep -E "registers|spill" | head -8

echo "== Hopper backward tests"
timeout 150 ./$B/tests/gpu/gpu_tests --gtest_filter='CudaHopperBwd.*' > "$OUT/tests_hopper_bwd.log" 2>&1
rc_h=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|rel|ran |error|kernel " "$OUT/tests_hopper_bwd.log" | head -40
sum_h="rc=$rc_h $(grep -E '^\[  (PASSED|FAILED) |tests? ran' "$OUT/tests_hopper_bwd.log" | tr '\n' ' ')"
echo "hopper bwd tests: $sum_h ($(elapsed) s)"

sum_b="(not run)"
existing_tests() {
  echo "== existing backward tests (Hopper kernel where it fits)"
  timeout $(( 290 - $(elapsed) )) ./$B/tests/gpu/gpu_tests --gtest_filter='CudaBwd.*' > "$OUT/tests_bwd.log" 2>&1
  rc_b=$?
  grep -E "^\[  FAILED|Failure|Expected|Which is|kernel " "$OUT/tests_bwd.log" | head -20
  sum_b="rc=$rc_b $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_bwd.log" | tr '\n' ' ')"
  echo "existing bwd tests: $sum_b ($(elapsed) s)"
}
if [ "$what" != full ] || [ "$rc_h" != 0 ]; then existing_tests; fi

if [ "${DIAG:-0}" = 1 ]; then
  echo "== timing-only variants (wrong dQ): where the time goes"
  cuda=${CUDA_HOME:-/usr/local/cuda}
  for v in 0 1 2; do
    d=$B; [ $v != 0 ] && d=/tmp/build-bwd-diag$v
    if [ $v != 0 ]; then
      [ "$(elapsed)" -gt 150 ] && break
      cmake -S . -B $d -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF -DFLASHPORT_CLI=OFF \
        -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_FLAGS=-DFLASHPORT_HOPPER_BWD_DIAG=$v" > "$OUT/build_diag.log" 2>&1 &&
        ninja -C $d -j16 flashport >> "$OUT/build_diag.log" 2>&1 || { tail -5 "$OUT/build_diag.log"; break; }
    fi
    c++ -O2 -std=c++17 -I include -I $cuda/include bench/gpu/bench_bwd_driver.cpp $d/libflashport.a \
      -L $cuda/lib64 -lcudart -lpthread -o $d/drv || break
    for cfg in "64 4096 4 32 0" "64 4096 4 32 1" "128 4096 4 16 0" "128 4096 4 16 1"; do
      echo "diag$v $cfg $($d/drv $cfg 10 2>&1 | tail -1 | python3 -c 'import sys,json; r=json.loads(sys.stdin.read()); print(r["ms"], r["tflops"])' 2>&1)" | tee -a "$OUT/diag.txt"
    done
  done
fi

if [ "$what" != tests ] && [ "$rc_h" = 0 ]; then
  args=(--quick --iters 10)
  [ "$what" = full ] && args=(--iters 10)
  left=$(( 270 - $(elapsed) ))
  PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT" "${args[@]}" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$? ($(elapsed) s)"
fi

# full: the existing backward tests after the benchmark, time permitting.
if [ "$what" = full ] && [ "$rc_h" = 0 ] && [ "${SKIP_EXISTING:-0}" != 1 ] && [ "$(elapsed)" -lt 200 ]; then existing_tests; fi

echo "== summary ($(elapsed) s)"
cat "$OUT/diag.txt" 2>/dev/null
echo "hopper bwd tests: $sum_h"
echo "existing bwd tests: $sum_b"
if [ -f "$OUT/gpu_bwd_bench.md" ]; then
  grep "^| [0-9]" "$OUT/gpu_bwd_bench.md" | cut -d'|' -f2-12
else
  grep '^{' "$OUT/bench.log" 2>/dev/null | python3 -c 'import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r["D"],r["S"],r["causal"],r.get("tflops"),r.get("flash_tflops"),r.get("cudnn_tflops"),r.get("kernel",r.get("error","")))'
fi
rm -f "$OUT/gpu_bwd_bench.png"
exit 0
