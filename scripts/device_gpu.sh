#!/usr/bin/env bash
# The one script run on the GPU machine (device tool): build (sm_90) + GPU tests + benchmark,
# in a single call. Logs go under $OUT; a short summary is printed last.
#   scripts/device_gpu.sh [all|test|bench|ncu] [extra bench args...]
# Needs: nvcc, cmake, ninja, python3 with torch. GoogleTest comes from .gtest (carried) if the
# machine has none.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
shift || true
OUT=${OUT:-/tmp/fp_out}
mkdir -p "$OUT"
jobs=$(nproc)
t0=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
nvcc --version | tail -1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
echo "== build (sm_90)"
tb=$(date +%s)
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${gtest_args[@]}" \
  > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
grep "flashport CUDA" "$OUT/cmake.log"
ninja -C build-dev -j"$jobs" gpu_tests fpbench > "$OUT/build.log" 2>&1 || { grep -B2 -A10 error "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - tb )) s"

test_summary="(not run)"
rm -f "$OUT/cmake.log" "$OUT/build.log"  # only kept when a build fails (8 files come back)
if [ "$mode" = variants ]; then
  # Tile-table experiments (FLASHPORT_FWD_TILE_VARIANT=N in tile_config.hpp), prefill only.
  for var in ${FP_VARIANTS:-1}; do
    echo "== variant $var (FLASHPORT_FWD_TILE_VARIANT=$var)"
    cmake -S . -B build-var$var -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
      -DFLASHPORT_CLI=OFF -DFLASHPORT_TESTS=OFF -DFLASHPORT_CUDA_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_CUDA_FLAGS=-DFLASHPORT_FWD_TILE_VARIANT=$var > /dev/null 2>&1 &&
      ninja -C build-var$var -j"$jobs" fpbench > /dev/null 2>&1 || echo "variant build failed"
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/bench_fwd.py --lib build-var$var/bench/gpu/libfpbench.so \
      --out /tmp/var$var --only prefill --dims "${FP_VARIANT_DIMS:-64,128,256}" > /tmp/var$var.log 2>&1
    echo "variant $var bench rc=$?"; grep "^| [0-9]" /tmp/var$var/gpu_bench.md | tee -a "$OUT/variants.md"
  done
  mode=${FP_AFTER_VARIANTS:-all}
fi
if [ "$mode" = all ] || [ "$mode" = full ] || [ "$mode" = test ]; then
  echo "== gpu_tests"
  tt=$(date +%s)
  timeout 300 ./build-dev/tests/gpu/gpu_tests --gtest_brief=1 > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^\[  FAILED|Failure|error|Expected|Which is|rel_err|kernel |SEED|Value of|actual" "$OUT/tests.log" | head -60
  test_summary="rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.log" | tr '\n' ' ') ($(( $(date +%s) - tt )) s)"
  echo "tests: $test_summary"
fi

if [ "$mode" = all ] || [ "$mode" = full ] || [ "$mode" = bench ]; then
  echo "== benchmark"
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/gpu/bench_fwd.py --lib build-dev/bench/gpu/libfpbench.so \
    --out "$OUT" ${FP_BENCH_ARGS:-} "$@" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  tail -5 "$OUT/bench.log" | grep -i error
fi

if [ "$mode" = full ] || [ "$mode" = ncu ]; then
  echo "== ncu (one prefill D128 S4k call, one decode B1 Sk8k call)"
  timeout 240 ncu --clock-control none --kernel-name regex:"fwd_kernel|merge_kernel" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 bench/gpu/ncu_one.py build-dev/bench/gpu/libfpbench.so > "$OUT/ncu.log" 2>&1
  grep -E "fwd_kernel|merge_kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|L1/TEX Hit|Bank" "$OUT/ncu.log" | head -40
fi

echo "== summary ($(( $(date +%s) - t0 )) s)"
echo "tests: $test_summary"
[ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
exit 0
