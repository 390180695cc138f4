#!/usr/bin/env bash
# D256 Hopper backward, dQ by bulk reduce (FLASHPORT_HOPPER_BWD_D256_DQ_BULK=1) against the red.v4
# atomics version (=0): one sm_90 build of gpu_tests + flashport with the new variant, the Hopper
# backward tests on it, then the D256 benchmark (bench_bwd.py, torch FA2 and cuDNN in the same
# run) for the new build and for a copy of its libflashport.a with bwd_hopper.cu recompiled as
# the old variant (one object swapped in, no second full build). Device tool, carry [".gtest"].
#   scripts/device_bwd_d256.sh [NEW_FLAG]   (NEW_FLAG default -DFLASHPORT_HOPPER_BWD_D256_DQ_BULK=1;
#   OLD_FLAG default -DFLASHPORT_HOPPER_BWD_D256_DQ_BULK=0; the variant given by the source's default
#   is built as whichever flag says so explicitly)
set -uo pipefail
cd "$(dirname "$0")/.."
NEW_FLAG=${1:--DFLASHPORT_HOPPER_BWD_D256_DQ_BULK=1}
OLD_FLAG=${OLD_FLAG:--DFLASHPORT_HOPPER_BWD_D256_DQ_BULK=0}
OUT=${OUT:-/tmp/fp_out}
mkdir -p "$OUT"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
B=build-bwd-d256
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_CLI=OFF -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_FLAGS=$NEW_FLAG" "${gtest_args[@]}" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
ninja -C $B -j16 gpu_tests flashport >> "$OUT/build.log" 2>&1 || { grep -B2 -A12 error "$OUT/build.log" | head -60; exit 1; }
echo "build (new: $NEW_FLAG): $(elapsed) s"

# Old variant: bwd_hopper.cu recompiled with OLD_FLAG into a copy of the library.
OLD=/tmp/build-bwd-d256-old
mkdir -p $OLD
obj=src/gpu/CMakeFiles/flashport_gpu_hopper.dir/bwd_hopper.cu.o
cmd=$(ninja -C $B -t commands $obj | tail -1)
cmd=${cmd//"$NEW_FLAG"/"$OLD_FLAG"}
cmd=${cmd//"-o $obj"/"-o $OLD/bwd_hopper.cu.o"}
(cd $B && eval "$cmd -Xptxas=-v") > "$OUT/build_old.log" 2>&1 && cp $B/libflashport.a $OLD/libflashport.a &&
  ar r $OLD/libflashport.a $OLD/bwd_hopper.cu.o >> "$OUT/build_old.log" 2>&1 || { tail -30 "$OUT/build_old.log"; exit 1; }
echo "build (old: $OLD_FLAG): $(elapsed) s"
grep -A2 "d256_kernel" "$OUT/build_old.log" | grep -E "registers|spill" | head -4

# Tests first, alone on the GPU (the benchmark must not share it).
timeout ${TEST_TIMEOUT:-170} ./$B/tests/gpu/gpu_tests --gtest_filter='CudaHopperBwd.*' > "$OUT/tests_hopper_bwd.log" 2>&1
trc=$?
grep -E "^\[  (FAILED|PASSED) |^\[==========\]|Failure" "$OUT/tests_hopper_bwd.log" | head -20
echo "tests rc=$trc ($(elapsed) s)"

for v in "$B:new" "$OLD:old"; do
  mkdir -p "$OUT/${v##*:}"
  PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-120} python3 bench/gpu/bench_bwd.py --build-dir ${v%%:*} \
    --out-dir "$OUT/${v##*:}" --dims 256 --iters 10 > "$OUT/${v##*:}/bench.log" 2>&1
  echo "== ${v##*:} (bench rc=$?, $(elapsed) s)"
  grep "^| " "$OUT/${v##*:}/gpu_bwd_bench.md" 2>/dev/null || tail -15 "$OUT/${v##*:}/bench.log"
done
tar czf "$OUT/logs.tgz" -C "$OUT" build.log build_old.log tests_hopper_bwd.log 2>/dev/null &&
  rm -f "$OUT/build.log" "$OUT/build_old.log"
echo "summary: tests rc=$trc, $(elapsed) s; tables above (new = $NEW_FLAG, old = $OLD_FLAG)"
exit $trc
