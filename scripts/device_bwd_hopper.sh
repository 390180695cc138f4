#!/usr/bin/env bash
# The Hopper backward's device script (device tool, carry .gtest): sm_90 build of the library and
# gpu_tests, the Hopper backward tests, the existing backward tests (which now take the Hopper
# kernel where it fits), then the backward benchmark against torch flash (FA2) and cuDNN.
# Logs under $OUT; a short summary last.
#   scripts/device_bwd_hopper.sh [quick|full|tests]    (BENCH_ARGS: extra bench_bwd.py arguments)
#   quick: benchmark at S = 4k only; full: the whole grid; tests: no benchmark.
#   DIAG=1: before the benchmark builds the timing-only variants FLASHPORT_HOPPER_BWD_DIAG=1
#   (no dQ atomics) and 2 (no dQ product, no atomics) and times D64/D128 at S = 4k with the driver.
#   VARIANTS=1: compiles bwd_hopper.cu variants as objects swapped into copies of the library
#   (ar) and times D64/D128 at S = 4k with the driver: v1 = .hopper_v1/bwd_hopper_v1.cu (the
#   committed v1, carry .hopper_v1), atomics = this tree with FLASHPORT_HOPPER_BWD_DQ_BULK=0,
#   bulk = this tree's default (timed twice: the spread between the two is the noise).
#   NCU=1: Nsight Compute (full set, SASS-level stall sampling) of the default kernel, D128 S = 4k.
#   Logs are packed into $OUT/logs.tgz (the device tool returns at most 8 files).
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

if [ "${VARIANTS:-0}" = 1 ]; then
  echo "== building bwd_hopper.cu variants (background)"
  cuda=${CUDA_HOME:-/usr/local/cuda}
  obj=src/gpu/CMakeFiles/flashport_gpu_hopper.dir/bwd_hopper.cu.o
  base_cmd=$(ninja -C $B -t commands $obj | tail -1)
  root=$PWD
  build_variant() {  # name source extra-flags
    local dir=/tmp/var_$1; mkdir -p $dir
    local src_pat="-c $PWD/src/gpu/hopper/bwd_hopper.cu"
    local cmd=${base_cmd//"$obj"/"$dir/bwd_hopper.cu.o"}
    cmd=${cmd//"$src_pat"/"-c $2"}
    (cd $B && eval "$cmd -I$root/src/gpu $3") > $dir/build.log 2>&1 &&
      cp $B/libflashport.a $dir/lib.a && ar r $dir/lib.a $dir/bwd_hopper.cu.o &&
      c++ -O2 -std=c++17 -I include -I $cuda/include bench/gpu/bench_bwd_driver.cpp $dir/lib.a \
        -L $cuda/lib64 -lcudart -lpthread -o $dir/drv >> $dir/build.log 2>&1
    echo "variant $1 build rc=$? $(grep -A2 'bwd_hopper_kernelILi128ENS0_8BF' $dir/build.log | grep -oE '[0-9]+ bytes spill stores' | head -1)"
  }
  build_variant v1 $PWD/.hopper_v1/bwd_hopper_v1.cu "-DFLASHPORT_HOPPER_BWD_DQ_BULK=0 -Xptxas=-v" &
  build_variant atomics $PWD/src/gpu/hopper/bwd_hopper.cu "-DFLASHPORT_HOPPER_BWD_DQ_BULK=0 -Xptxas=-v" &
  mkdir -p /tmp/var_bulk && cp $B/libflashport.a /tmp/var_bulk/lib.a &&
    c++ -O2 -std=c++17 -I include -I $cuda/include bench/gpu/bench_bwd_driver.cpp /tmp/var_bulk/lib.a \
      -L $cuda/lib64 -lcudart -lpthread -o /tmp/var_bulk/drv
fi

echo "== Hopper backward tests"
timeout 150 ./$B/tests/gpu/gpu_tests --gtest_filter='CudaHopperBwd.*' > "$OUT/tests_hopper_bwd.log" 2>&1
rc_h=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|rel|ran |error|kernel " "$OUT/tests_hopper_bwd.log" | head -40
sum_h="rc=$rc_h $(grep -E '^\[  (PASSED|FAILED) |tests? ran' "$OUT/tests_hopper_bwd.log" | tr '\n' ' ')"
echo "hopper bwd tests: $sum_h ($(elapsed) s)"

sum_b="(not run)"
existing_tests() {
  echo "== existing backward tests (Hopper kernel where it fits)"
  timeout ${EXISTING_TIMEOUT:-$(( 290 - $(elapsed) ))} ./$B/tests/gpu/gpu_tests --gtest_filter='CudaBwd.*' > "$OUT/tests_bwd.log" 2>&1
  rc_b=$?
  grep -E "^\[  FAILED|Failure|Expected|Which is|kernel " "$OUT/tests_bwd.log" | head -20
  sum_b="rc=$rc_b $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_bwd.log" | tr '\n' ' ')"
  echo "existing bwd tests: $sum_b ($(elapsed) s)"
}
if { [ "$what" != full ] && [ "${SKIP_EXISTING:-0}" != 1 ]; } || [ "$rc_h" != 0 ] || [ "${EXISTING_FIRST:-0}" = 1 ]; then
  existing_tests
fi

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

if [ "${VARIANTS:-0}" = 1 ]; then
  wait  # variant builds
  echo "== bwd_hopper.cu variants (driver, S = 4k)"
  for v in bulk v1 atomics; do
    [ -x /tmp/var_$v/drv ] || continue
    for cfg in "64 4096 4 32 0" "64 4096 4 32 1" "128 4096 4 16 0" "128 4096 4 16 1"; do
      echo "$v $cfg $(/tmp/var_$v/drv $cfg 10 2>&1 | tail -1 | python3 -c 'import sys,json; r=json.loads(sys.stdin.read()); print(r["ms"], r["tflops"], r["kernel"])' 2>&1)" | tee -a "$OUT/variants.txt"
    done
  done
  echo "variants done ($(elapsed) s)"
fi

if [ "$what" != tests ] && [ "$rc_h" = 0 ]; then
  args=(--quick --iters 10)
  [ "$what" = full ] && args=(--iters 10)
  left=$(( ${BENCH_END:-270} - $(elapsed) ))
  PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu/bench_bwd.py --build-dir $B --out-dir "$OUT" "${args[@]}" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$? ($(elapsed) s)"
fi

if [ "${NCU:-0}" = 1 ] && [ -x /tmp/var_bulk/drv ] && [ "$(elapsed)" -lt 250 ]; then
  echo "== ncu: default kernel, D128 S=4k non-causal"
  timeout $(( 285 - $(elapsed) )) ncu --clock-control none --set full --import-source no -k regex:bwd_hopper_kernel --launch-skip 1 --launch-count 1 \
    -f -o /tmp/ncu_d128 /tmp/var_bulk/drv 128 4096 4 16 0 2 > /tmp/ncu_run.log 2>&1
  echo "ncu rc=$? ($(elapsed) s)"
  ncu -i /tmp/ncu_d128.ncu-rep --page details > "$OUT/ncu_d128_details.txt" 2>&1
  ncu -i /tmp/ncu_d128.ncu-rep --page source --csv --print-source sass > /tmp/ncu_d128_sass.csv 2>&1
  gzip -c /tmp/ncu_d128_sass.csv > "$OUT/ncu_d128_sass.csv.gz"
  grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Compute \(SM\) Throughput|Shared Memory|Bank" "$OUT/ncu_d128_details.txt" | head -12
fi

# full: the existing backward tests after the benchmark, time permitting.
if [ "$what" = full ] && [ "$rc_h" = 0 ] && [ "${SKIP_EXISTING:-0}" != 1 ] && [ "${EXISTING_FIRST:-0}" != 1 ] &&
   [ "$(elapsed)" -lt 200 ]; then existing_tests; fi

echo "== summary ($(elapsed) s)"
cat "$OUT/diag.txt" "$OUT/variants.txt" 2>/dev/null
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
(cd "$OUT" && tar czf logs.tgz build.log tests_*.log bench.log 2>/dev/null && rm -f build.log tests_*.log bench.log)
exit 0
