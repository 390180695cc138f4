#!/usr/bin/env bash
# The Hopper forward's one device script (device tool, carry .gtest): sm_90 build of the library,
# gpu_tests and the benchmark shim; the Hopper tests under both schedules (own processes, so a
# fault there cannot poison the others), the existing forward tests, then the prefill benchmark
# with schedule v1 (default), v2 (FLASHPORT_HOPPER_SCHED=2) and, for D256, the mma.sync kernel
# (FLASHPORT_HOPPER_FWD=0), time permitting. Logs under $OUT; a short table last.
#   scripts/device_hopper.sh [dims]      dims default 64,128,256
set -uo pipefail
cd "$(dirname "$0")/.."
dims=${1:-64,128,256}
shift || true
OUT=${OUT:-/tmp/fp_out}
mkdir -p "$OUT"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
nvcc --version | tail -1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
echo "== build (sm_90 + sm_90a Hopper forward)"
cmake -S . -B build-hopper -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${gtest_args[@]}" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
grep "flashport CUDA" "$OUT/build.log"
ninja -C build-hopper -j16 gpu_tests fpbench >> "$OUT/build.log" 2>&1 || { grep -B2 -A10 error "$OUT/build.log" | head -60; exit 1; }
echo "build: $(elapsed) s"
rm -f "$OUT/build.log"

echo "== Hopper tests, schedule v1 (default)"
timeout 170 ./build-hopper/tests/gpu/gpu_tests --gtest_filter='CudaHopperFwd.*' > "$OUT/tests_hopper.log" 2>&1
rc_h=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|max |kernel |ran |error" "$OUT/tests_hopper.log" | head -30
sum_h="rc=$rc_h $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_hopper.log" | tr '\n' ' ')"
echo "hopper tests v1: $sum_h ($(elapsed) s)"

bench() {  # name, dims, env...
  local name=$1 d=$2
  shift 2
  env "$@" PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_fwd.py --lib build-hopper/bench/gpu/libfpbench.so \
    --out /tmp/bench_$name --only prefill --dims "$d" >> "$OUT/bench.log" 2>&1
  echo "bench $name rc=$? ($(elapsed) s)"
  cp /tmp/bench_$name/gpu_bench.md "$OUT/bench_$name.md" 2>/dev/null
}
echo "== prefill benchmark, schedule v1"
bench v1 "$dims"
echo "== Hopper tests, schedule v2 (FLASHPORT_HOPPER_SCHED=2)"
FLASHPORT_HOPPER_SCHED=2 timeout 170 ./build-hopper/tests/gpu/gpu_tests --gtest_filter='CudaHopperFwd.*' \
  > "$OUT/tests_hopper_v2.log" 2>&1
rc_h1=$?
grep -E "^\[  FAILED|Failure|Expected|Which is" "$OUT/tests_hopper_v2.log" | head -20
sum_h1="rc=$rc_h1 $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_hopper_v2.log" | tr '\n' ' ')"
echo "hopper tests v2: $sum_h1 ($(elapsed) s)"

[ "$(elapsed)" -lt 330 ] && bench v2 "$dims" FLASHPORT_HOPPER_SCHED=2
sum_f="(not run)"
[ "$(elapsed)" -lt 380 ] && {
echo "== existing forward tests (Hopper kernel v1 selected where it fits)"
timeout 200 ./build-hopper/tests/gpu/gpu_tests --gtest_brief=1 \
  --gtest_filter='CudaFwd.*:CudaGraph.*:CudaPlan.*:CudaMerge.*' > "$OUT/tests_fwd.log" 2>&1
rc_f=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|kernel " "$OUT/tests_fwd.log" | head -30
sum_f="rc=$rc_f $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_fwd.log" | tr '\n' ' ')"
echo "forward tests: $sum_f ($(elapsed) s)"
}
[ "$(elapsed)" -lt 470 ] && bench off 256 FLASHPORT_HOPPER_FWD=0

echo "== summary ($(elapsed) s)"
echo "hopper tests v1: $sum_h"
echo "hopper tests v2: $sum_h1"
echo "forward tests: $sum_f"
for n in off v2; do
  [ -f "$OUT/bench_$n.md" ] && { echo "-- $n"; grep "^| [0-9]" "$OUT/bench_$n.md" | cut -d'|' -f2-10; }
done
[ -f "$OUT/bench_v1.md" ] && { echo "-- v1 (default)"; sed -n '/^device/,$p' "$OUT/bench_v1.md"; }
exit 0
