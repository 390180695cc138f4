#!/usr/bin/env bash
# Decode A/B on a GPU machine: two source trees (A: the baseline, B: the change) built side by
# side for the device's arch, B's decode GPU tests, then bench/gpu/bench_ab_fwd.py's decode grid
# (both builds' libfpbench.so loaded in one process, cuDNN beside them).
#
#   A_SRC=. B_SRC=build-ab-decode bash build-ab-decode/scripts/decode_ab.sh build   # both builds
#   A_SRC=. B_SRC=build-ab-decode bash build-ab-decode/scripts/decode_ab.sh tests   # B's decode tests
#   A_SRC=. B_SRC=build-ab-decode bash build-ab-decode/scripts/decode_ab.sh bench   # the A/B table
#   ... decode_ab.sh all                                                            # the three
# Build dirs: $A_BUILD (default build-ab-a) and $B_BUILD (default build-ab-b), relative to the
# current directory. OUT: logs (default /tmp/decode-ab). GTEST_DIR as scripts/device.sh
# (default: $A_SRC/.gtest when present).
set -uo pipefail
mode=${1:-all}
A_SRC=$(cd "${A_SRC:-.}" && pwd)
B_SRC=$(cd "${B_SRC:?B_SRC: the changed tree}" && pwd)
A_BUILD=$(mkdir -p "${A_BUILD:-build-ab-a}" && cd "${A_BUILD:-build-ab-a}" && pwd)
B_BUILD=$(mkdir -p "${B_BUILD:-build-ab-b}" && cd "${B_BUILD:-build-ab-b}" && pwd)
OUT=${OUT:-/tmp/decode-ab}
mkdir -p "$OUT"
arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')}
gtest_args=()
if [ -n "${GTEST_DIR:-}" ]; then gtest_args=(-DGTest_DIR="$GTEST_DIR");
elif [ -d "$A_SRC/.gtest" ]; then gtest_args=(-DGTest_DIR="$A_SRC/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi

build_one() {  # src build log targets...
  local src=$1 dir=$2 log=$3
  shift 3
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=ON \
    -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" "${gtest_args[@]}" \
    > "$OUT/$log.configure.log" 2>&1 || { tail -30 "$OUT/$log.configure.log"; return 1; }
  grep "flashport CUDA" "$OUT/$log.configure.log"
  ninja -C "$dir" -j"$(nproc)" "$@" > "$OUT/$log.build.log" 2>&1 ||
    { grep -B2 -A12 "error" "$OUT/$log.build.log" | head -60; return 1; }
  echo "$log: built $*"
}

if [ "$mode" = build ] || [ "$mode" = all ]; then
  t0=$(date +%s)
  build_one "$A_SRC" "$A_BUILD" a fpbench || exit 1
  build_one "$B_SRC" "$B_BUILD" b fpbench gpu_tests || exit 1
  echo "builds: $(( $(date +%s) - t0 )) s"
fi
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  # The decode kernel's suites, the existing suites whose decode calls it now runs, the planner;
  # one process per suite (their time is mostly the fp64 reference on the host).
  fail=0
  for s in CudaDecodeKernel DecodeKernelPlan CudaFwdDecode CudaGraph CudaFwd CudaPlan GpuTileTable GpuSplitHeuristic; do
    timeout "${SUITE_TIMEOUT:-420}" "$B_BUILD/tests/gpu/gpu_tests" --gtest_filter="$s.*" > "$OUT/t_$s.log" 2>&1 &
  done
  wait
  for s in CudaDecodeKernel DecodeKernelPlan CudaFwdDecode CudaGraph CudaFwd CudaPlan GpuTileTable GpuSplitHeuristic; do
    if grep -q '^\[  PASSED ' "$OUT/t_$s.log" && ! grep -q '^\[  FAILED ' "$OUT/t_$s.log"; then
      printf '%-20s %s\n' "$s" "$(grep -E '^\[  PASSED ' "$OUT/t_$s.log")"
    else
      fail=1
      printf '%-20s FAILED\n' "$s"
      grep -E "^\[  FAILED|Failure|Expected|Which is|differs|rel_err|Value of" "$OUT/t_$s.log" | head -12
    fi
  done
  echo "== decode tests $([ $fail = 0 ] && echo passed || echo FAILED)"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-400}" python3 "$B_SRC/bench/gpu/bench_ab_fwd.py" \
    "$A_BUILD/bench/gpu/libfpbench.so" "$B_BUILD/bench/gpu/libfpbench.so" decode | tee "$OUT/decode_ab.md"
fi
