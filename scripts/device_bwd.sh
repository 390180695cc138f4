#!/usr/bin/env bash
# GPU backward on the lent device: build (sm_90, -j16), backward tests, backward benchmark.
# Logs and results under $OUT (device tool) or ./device_out.
#   scripts/device_bwd.sh [tests|bench|all|variants]
#   variants: also builds FLASHPORT_BWD_WARPS=8 and benches both tile variants (--quick grid).
set -u
what=${1:-all}
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
build() {  # dir, extra CUDA flags
  { time (cmake -S . -B $1 -G Ninja -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CLI=OFF "-DCMAKE_CUDA_FLAGS=$2" > "$OUT/build$3.log" 2>&1 &&
    ninja -C $1 -j16 gpu_tests flashport >> "$OUT/build$3.log" 2>&1); } 2>> "$OUT/build$3.log" || { tail -40 "$OUT/build$3.log"; exit 1; }
}
B=/tmp/build-bwd-dev
build $B "" ""
echo "build ok"
rc=0
if [ "$what" != bench ]; then
  timeout 200 $B/tests/gpu/gpu_tests --gtest_filter='CudaBwd*' > "$OUT/bwd_tests.log" 2>&1; rc=$?
  grep -E "^\[  (FAILED|PASSED) |^\[==========\]|Failure|rel_err|differs|error" "$OUT/bwd_tests.log" | head -60
  echo "tests rc=$rc"
fi
if [ "$what" = variants ]; then
  build /tmp/build-bwd-w8 "-DFLASHPORT_BWD_WARPS=8" "_w8"
  for v in "$B:w16" "/tmp/build-bwd-w8:w8"; do
    mkdir -p "$OUT/${v##*:}"
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_bwd.py --build-dir ${v%%:*} --out-dir "$OUT/${v##*:}" --quick \
      --iters 10 > "$OUT/${v##*:}/bench.log" 2>&1
    echo "== ${v##*:}"; grep "^| [0-9]" "$OUT/${v##*:}/gpu_bwd_bench.md"
  done
elif [ "$what" != tests ]; then
  PYTHONUNBUFFERED=1 timeout 280 python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$OUT/gpu_bwd_bench.md" 2>/dev/null || tail -30 "$OUT/bench.log"
fi
exit $rc
