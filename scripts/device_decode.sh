#!/usr/bin/env bash
# Decode / split-KV work on the GPU machine (device tool), one call: build (sm_90), forward GPU
# tests, decode + long-KV benchmark; logs and tables under $OUT, a short summary last.
#   scripts/device_decode.sh explore   experiment build (-DFLASHPORT_DECODE_EXPERIMENTS: extra
#                                      decode tiles, FLASHPORT_DECODE_TILE), variants + split sweeps, ncu
#   scripts/device_decode.sh final     the production build: tests, then the decode + long-KV table
# Env: FP_VARIANTS / FP_VARIANT_SPLITS (explore: bench --decode-variants / --variant-splits), NCU=0/1.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-final}
OUT=${OUT:-/tmp/fp_decode_out}
mkdir -p "$OUT"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -1
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } | tee "$OUT/device.txt"

flags=""
[ "$mode" = explore ] && flags="-DFLASHPORT_DECODE_EXPERIMENTS=1"
gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
B=/tmp/build-decode
tb=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF -DFLASHPORT_CLI=OFF \
  -DFLASHPORT_CUDA_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_FLAGS=$flags" "${gtest_args[@]}" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
ninja -C $B -j"$(nproc)" gpu_tests fpbench >> "$OUT/build.log" 2>&1 || { grep -B2 -A12 "error" "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - tb )) s"
rm -f "$OUT/build.log"

tt=$(date +%s)
timeout ${FP_TEST_TIMEOUT:-100} $B/tests/gpu/gpu_tests --gtest_brief=1 \
  --gtest_filter='CudaFwd*:CudaFwdDecode*:CudaGraph*:CudaMerge*:CudaPlan*:Gpu*' > "$OUT/tests.log" 2>&1
test_rc=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|kernel |differs|Value of|actual" "$OUT/tests.log" | head -40
test_summary="rc=$test_rc $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.log" | tr '\n' ' ') ($(( $(date +%s) - tt )) s)"

bench_args=(--only decode,longkv --split-sweep)
if [ "$mode" = final ]; then
  bench_args+=(--decode-variants "fused:FLASHPORT_SPLIT_COMBINE=fused")
fi
if [ "$mode" = explore ]; then
  bench_args+=(--decode-variants "${FP_VARIANTS:-kernel:;fused:FLASHPORT_SPLIT_COMBINE=fused}"
               --variant-splits "${FP_VARIANT_SPLITS:-}")
fi
PYTHONUNBUFFERED=1 timeout ${FP_BENCH_TIMEOUT:-150} python3 bench/gpu/bench_fwd.py --lib $B/bench/gpu/libfpbench.so \
  --out "$OUT" "${bench_args[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -iE "error|Traceback" "$OUT/bench.log" | head -5
rm -f "$OUT/gpu_prefill.png"

if [ "${NCU:-0}" = 1 ] && [ $(( $(date +%s) - t0 )) -lt ${FP_NCU_BEFORE:-220} ]; then
  # One decode call, B=1 Sk=8k (main kernel with the fused combine; memset node before it).
  timeout 90 ncu --kernel-name regex:"fwd_kernel|merge_kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -c "
import sys, torch; sys.path.insert(0, 'bench/gpu')
from bench_fwd import Flashport, load_lib
fp = Flashport(load_lib('$B/bench/gpu/libfpbench.so'))
q = torch.randn(1, 1, 32, 128, device='cuda', dtype=torch.bfloat16)
k = torch.randn(1, 8192, 8, 128, device='cuda', dtype=torch.bfloat16); v = torch.randn_like(k)
out = torch.empty_like(q); f = fp.prepare(q, k, v, out, False, 0); f(); f(); torch.cuda.synchronize(); print(f.kernel)
" > "$OUT/ncu.log" 2>&1
  grep -E "fwd_kernel|merge_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Block Limit" "$OUT/ncu.log" | head -30
fi

echo "== summary ($(( $(date +%s) - t0 )) s)"
echo "tests: $test_summary"
[ -f "$OUT/gpu_bench.md" ] && sed '/^### Decode variants/,$d' "$OUT/gpu_bench.md" | grep -E "^\| |^device|^B=|^## "
exit 0
