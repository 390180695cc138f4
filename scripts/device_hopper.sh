#!/usr/bin/env bash
# The Hopper forward's one device script (device tool, carry .gtest): sm_90 build of the library,
# gpu_tests and the benchmark shim; the Hopper tests (own process, so a fault there cannot poison
# the others), the existing forward tests, then the prefill benchmark with the Hopper kernel and,
# time permitting, with it switched off (FLASHPORT_HOPPER_FWD=0, the mma.sync kernel) in the same
# run. Logs under $OUT; a short table last.
#   scripts/device_hopper.sh [dims] [extra bench args...]      dims default 64,128
set -uo pipefail
cd "$(dirname "$0")/.."
dims=${1:-64,128}
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

echo "== Hopper tests"
timeout 150 ./build-hopper/tests/gpu/gpu_tests --gtest_filter='CudaHopperFwd.*' > "$OUT/tests_hopper.log" 2>&1
rc_h=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|max |kernel |ran |error" "$OUT/tests_hopper.log" | head -40
sum_h="rc=$rc_h $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_hopper.log" | tr '\n' ' ')"
echo "hopper tests: $sum_h ($(elapsed) s)"

echo "== existing forward tests (Hopper kernel selected where it fits)"
timeout 200 ./build-hopper/tests/gpu/gpu_tests --gtest_brief=1 \
  --gtest_filter='CudaFwd.*:CudaGraph.*:CudaPlan.*:CudaMerge.*' > "$OUT/tests_fwd.log" 2>&1
rc_f=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|kernel " "$OUT/tests_fwd.log" | head -30
sum_f="rc=$rc_f $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_fwd.log" | tr '\n' ' ')"
echo "forward tests: $sum_f ($(elapsed) s)"

echo "== prefill benchmark, Hopper kernel on (dims $dims)"
PYTHONUNBUFFERED=1 timeout 170 python3 bench/gpu/bench_fwd.py --lib build-hopper/bench/gpu/libfpbench.so \
  --out /tmp/bench_on --only prefill --dims "$dims" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(elapsed) s)"
cp /tmp/bench_on/gpu_bench.md "$OUT/bench_hopper_on.md" 2>/dev/null
if [ "$(elapsed)" -lt 400 ]; then
  echo "== prefill benchmark, Hopper kernel off (mma.sync), same run"
  FLASHPORT_HOPPER_FWD=0 PYTHONUNBUFFERED=1 timeout $(( 500 - $(elapsed) )) python3 bench/gpu/bench_fwd.py \
    --lib build-hopper/bench/gpu/libfpbench.so --out /tmp/bench_off --only prefill --dims "$dims" "$@" \
    >> "$OUT/bench.log" 2>&1
  echo "bench (off) rc=$? ($(elapsed) s)"
  cp /tmp/bench_off/gpu_bench.md "$OUT/bench_hopper_off.md" 2>/dev/null
fi

echo "== summary ($(elapsed) s)"
echo "hopper tests: $sum_h"
echo "forward tests: $sum_f"
[ -f "$OUT/bench_hopper_off.md" ] && { echo "-- Hopper off (mma.sync)"; grep "^| [0-9]" "$OUT/bench_hopper_off.md"; }
[ -f "$OUT/bench_hopper_on.md" ] && { echo "-- Hopper on"; cat "$OUT/bench_hopper_on.md"; }
exit 0
