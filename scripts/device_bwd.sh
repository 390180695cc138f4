#!/usr/bin/env bash
# GPU backward on the lent device: build (sm_90, -j16), backward tests, backward benchmark.
# Logs and results under $OUT (device tool) or ./device_out.
#   scripts/device_bwd.sh [tests|bench|all]
set -u
what=${1:-all}
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
B=/tmp/build-bwd-dev
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
{ time (cmake -S . -B $B -G Ninja -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CLI=OFF > "$OUT/build.log" 2>&1 &&
  ninja -C $B -j16 gpu_tests flashport >> "$OUT/build.log" 2>&1); } 2>> "$OUT/build.log" || { tail -40 "$OUT/build.log"; exit 1; }
echo "build ok"
rc=0
if [ "$what" != bench ]; then
  timeout 300 $B/tests/gpu/gpu_tests --gtest_filter='CudaBwd*' > "$OUT/bwd_tests.log" 2>&1; rc=$?
  grep -E "^\[  (FAILED|PASSED) |^\[==========\]|Failure|rel_err|differs|error" "$OUT/bwd_tests.log" | head -60
  echo "tests rc=$rc"
fi
if [ "$what" != tests ]; then
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$OUT/gpu_bwd_bench.md" 2>/dev/null || tail -30 "$OUT/bench.log"
fi
exit $rc
