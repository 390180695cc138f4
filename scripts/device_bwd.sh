#!/usr/bin/env bash
# GPU backward on the lent device: build (sm_90, -j16), backward tests, backward benchmark.
# Logs and results under $OUT (device tool) or ./device_out.
#   scripts/device_bwd.sh [tests|bench|all|variants]
#   variants: also builds an alternative tile (ALT_FLAGS) and benches both on the --quick grid;
#   final: tests, the alternative on --quick, then the full grid with the default tile.
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
if [ "$what" = variants ] || [ "$what" = final ]; then
  # ALT_FLAGS: the alternative tiles (default FLASHPORT_BWD_TILES=3), benched on the --quick grid.
  build /tmp/build-bwd-alt "${ALT_FLAGS:--DFLASHPORT_BWD_TILES=3}" "_alt"
  mkdir -p "$OUT/alt"
  if [ "$what" = final ]; then
    timeout 200 /tmp/build-bwd-alt/tests/gpu/gpu_tests --gtest_filter='CudaBwd*' > "$OUT/alt/bwd_tests.log" 2>&1
    echo "alt tests rc=$?"; grep -E "^\[  (FAILED|PASSED) " "$OUT/alt/bwd_tests.log" | head
  fi
  vs="$B:main /tmp/build-bwd-alt:alt"
  [ "$what" = final ] && vs="/tmp/build-bwd-alt:alt"
  for v in $vs; do
    mkdir -p "$OUT/${v##*:}"
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_bwd.py --build-dir ${v%%:*} --out-dir "$OUT/${v##*:}" --quick \
      --iters 10 > "$OUT/${v##*:}/bench.log" 2>&1
    echo "== ${v##*:}"; grep "^| [0-9]" "$OUT/${v##*:}/gpu_bwd_bench.md"
  done
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = final ]; then
  PYTHONUNBUFFERED=1 timeout 280 python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$OUT/gpu_bwd_bench.md" 2>/dev/null || tail -30 "$OUT/bench.log"
fi
# PROFILE=1: Nsight Compute on one backward main loop (D128, S 4k) after the benchmark.
if [ "${PROFILE:-0}" = 1 ] && [ -x $B/bench_bwd_driver ]; then
  timeout 150 ncu --kernel-name regex:bwd_kernel --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    $B/bench_bwd_driver 128 4096 4 16 0 1 > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy|Registers" "$OUT/ncu.txt" | head -30
fi
# At most 8 files come back: drop what the summary already holds.
if [ "$what" = final ]; then
  rm -f "$OUT"/build*.log "$OUT"/alt/bench.log "$OUT"/alt/*.json "$OUT"/alt/*.png
fi
exit $rc
