#!/usr/bin/env bash
# The Hopper forward's one device script (device tool; carry a git archive with .gtest inside):
# sm_90 build of the library, gpu_tests and the benchmark shim; the ptxas report (registers,
# spills, C75xx warnings) and, where cuobjdump exists, the HGMMA count of the v3 kernels; the
# Hopper tests under schedule v3 and v1 (own processes); the prefill grid with v1, v3, v3 without
# ping-pong, torch flash (FA2) and cuDNN timed in ONE process (the library reads
# FLASHPORT_HOPPER_SCHED / FLASHPORT_HOPPER_PINGPONG at every call); then, time permitting, the
# other forward suites under v3. Logs under $OUT (tar'd); a short table last.
#   scripts/device_hopper.sh [dims] [extra]   dims default 64,128,256; extra "fwdtests" runs the
#   forward suites under v3 even when time is short; "quick" runs only the v3 smoke + tests and the
#   benchmark (FP_BENCH_NOPP=0 also drops the no-ping-pong column).
#   scripts/device_hopper.sh splitkv   v3 split-KV run (bench/results/gpu_hopper_v3_splitkv.md): build,
#   ptxas report, long-KV + prefill timings (v3 split, v3 unsplit, mma.sync split, torch flash,
#   cuDNN) while the GPU is quiet, then the WHOLE gpu_tests binary in parallel shards;
#   "splitkv-bench": the same without the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = splitkv ] || [ "${1:-}" = splitkv-bench ]; then
  mode=$1
  OUT=${OUT:-/tmp/fp_out}
  mkdir -p "$OUT"
  LOG=/tmp/fp_split_logs
  rm -rf "$LOG" && mkdir -p "$LOG"
  t0=$(date +%s)
  trap 'tar -C /tmp -czf "$OUT/logs.tgz" fp_split_logs 2>/dev/null' EXIT
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    nvcc --version | tail -1
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } | tee "$LOG/device.txt"
  gtest_args=()
  if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
  B=/tmp/build-split
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
    -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON -DFLASHPORT_CUDA_VERBOSE_PTXAS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    "${gtest_args[@]}" > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
  grep "flashport CUDA" "$LOG/build.log"
  ninja -C $B -j16 gpu_tests fpbench >> "$LOG/build.log" 2>&1 || { grep -B2 -A12 error "$LOG/build.log" | head -60; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  grep -A2 "Compiling entry function '.*fwd_hopper_v3" "$LOG/build.log" | grep -E "Used|spill" | sort | uniq -c
  grep -E "C75[0-9][0-9]" "$LOG/build.log" | sort | uniq -c | head -5
  tb=$(date +%s)
  PYTHONUNBUFFERED=1 timeout 80 python3 scripts/device_hopper_splitkv_bench.py "$B/bench/gpu/libfpbench.so" \
    > "$LOG/bench.md" 2> "$LOG/bench.err"
  echo "bench rc=$? ($(( $(date +%s) - tb )) s)"
  tail -3 "$LOG/bench.err"
  cp "$LOG/bench.md" "$OUT/bench.md"
  if [ "$mode" = splitkv-bench ]; then echo "== done in $(( $(date +%s) - t0 )) s"; cat "$LOG/bench.md"; exit 0; fi
  tt=$(date +%s)
  G=$B/tests/gpu/gpu_tests
  suites=$($G --gtest_list_tests | grep -E '^[A-Za-z0-9_]+\.$' | tr -d '.')
  for s in $suites; do
    n=1
    case $s in CudaFwd|CudaBwd|CudaHopperFwd|CudaHopperBwd) n=3 ;; esac
    for i in $(seq 0 $((n - 1))); do
      GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout 170 $G --gtest_filter="$s.*" > "$LOG/t_${s}_$i.log" 2>&1 &
    done
  done
  wait
  for f in "$LOG"/t_*.log; do
    res=$(grep -E '^\[  (PASSED|FAILED) ' "$f" | tr '\n' ' ')
    grep -q '^\[  PASSED' "$f" || res="$res NO RESULT (timeout or crash)"
    printf '%-24s %s\n' "$(basename "$f" .log)" "$res"
    grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|differs|Value of| ran " "$f" | head -8
  done | tee "$LOG/tests_summary.txt"
  cp "$LOG/tests_summary.txt" "$OUT/"
  echo "gpu_tests: $(grep -cE '^t_.*PASSED' "$LOG/tests_summary.txt") shards with passes," \
    "$(grep -cE '^t_.*(FAILED|NO RESULT)' "$LOG/tests_summary.txt") shards with failures ($(( $(date +%s) - tt )) s)"
  echo "== done in $(( $(date +%s) - t0 )) s"
  cat "$LOG/bench.md"
  exit 0
fi
dims=${1:-64,128,256}
extra=${2:-}
OUT=${OUT:-/tmp/fp_out}
mkdir -p "$OUT"
LOG=/tmp/fp_hopper_logs
rm -rf "$LOG" && mkdir -p "$LOG"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
finish() { tar -C /tmp -czf "$OUT/logs.tgz" fp_hopper_logs 2>/dev/null; }
trap finish EXIT

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
nvcc --version | tail -1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

gtest_args=()
if [ -d .gtest ]; then gtest_args=(-DGTest_DIR="$PWD/.gtest/lib/x86_64-linux-gnu/cmake/GTest"); fi
echo "== build (sm_90 + sm_90a Hopper forward)"
cmake -S . -B build-hopper -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_CLI=OFF -DFLASHPORT_CUDA_BENCH=ON -DFLASHPORT_CUDA_VERBOSE_PTXAS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  "${gtest_args[@]}" > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
grep "flashport CUDA" "$LOG/build.log"
ninja -C build-hopper -j16 gpu_tests fpbench >> "$LOG/build.log" 2>&1 || { grep -B2 -A10 error "$LOG/build.log" | head -60; exit 1; }
echo "build: $(elapsed) s"
grep "flashport CUDA" "$LOG/build.log" | tail -1
echo "-- ptxas, Hopper forward kernels (registers / spills); C75xx warnings:"
grep -A2 "Compiling entry function '.*fwd_hopper" "$LOG/build.log" | grep -E "Used|spill" | sort | uniq -c
grep -E "C75[0-9][0-9]" "$LOG/build.log" | sort | uniq -c | head
obj=$(find build-hopper -name 'fwd_hopper.cu.o' | head -1)
if command -v cuobjdump > /dev/null && [ -n "$obj" ]; then
  cuobjdump -sass "$obj" > "$LOG/fwd_hopper.sass" 2>&1
  echo "-- SASS: HGMMA / warpgroup waits / setmaxnreg / TMA per kernel"
  awk '/Function :/ {f=$3} /HGMMA/ {h[f]++} /WARPGROUP.DEPBAR/ {w[f]++} /SETMAXNREG|USETMAXREG/ {r[f]++} /UTMALDG/ {t[f]++}
       END {for (k in h) printf "%s HGMMA=%d DEPBAR=%d SETMAXREG=%d UTMALDG=%d\n", k, h[k], w[k], r[k], t[k]}' \
       "$LOG/fwd_hopper.sass" | sed 's/_ZN9flashport3gpu4sm90//' | sort
fi

run_tests() {  # name, env...
  local name=$1
  shift
  env "$@" timeout 150 ./build-hopper/tests/gpu/gpu_tests --gtest_filter='CudaHopperFwd.*' > "$LOG/tests_$name.log" 2>&1
  local rc=$?
  grep -E "^\[  FAILED|Failure|Expected|Which is|rel_err|ran " "$LOG/tests_$name.log" | head -20
  echo "hopper tests $name: rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$LOG/tests_$name.log" | tr '\n' ' ') ($(elapsed) s)"
}
echo "== v3 smoke (a hang here skips v3's tests and the benchmark)"
FLASHPORT_HOPPER_SCHED=3 timeout 60 ./build-hopper/tests/gpu/gpu_tests \
  --gtest_filter='CudaHopperFwd.LongKeysManyTiles:CudaHopperFwd.BothSchedulesInOneProcess' \
  > "$LOG/smoke_v3.log" 2>&1
rc_smoke=$?
tail -3 "$LOG/smoke_v3.log"
echo "smoke rc=$rc_smoke ($(elapsed) s)"
if [ $rc_smoke -eq 124 ]; then
  echo "hopper tests v3: HANG in smoke test" > "$LOG/sum_v3.txt"
  dims=""
else
echo "== Hopper tests, schedule v3 (FLASHPORT_HOPPER_SCHED=3)"
run_tests v3 FLASHPORT_HOPPER_SCHED=3 | tee "$LOG/sum_v3.txt"
[ "$extra" != quick ] && echo "== Hopper tests, schedule v3 on a persistent grid (FLASHPORT_HOPPER_PERSISTENT=1)"
[ "$extra" != quick ] && run_tests v3p FLASHPORT_HOPPER_SCHED=3 FLASHPORT_HOPPER_PERSISTENT=1 | tee "$LOG/sum_v3p.txt"
fi

echo "== prefill grid: v1, v3, v3 no ping-pong, torch flash, cuDNN in one process"
[ -n "$dims" ] && PYTHONUNBUFFERED=1 timeout 200 python3 - "$dims" > "$LOG/bench.md" 2> "$LOG/bench.err" <<'EOF'
import os, sys
sys.path.insert(0, "bench/gpu")
import torch
from bench_fwd import Flashport, load_lib, time_ms, try_time, sdpa_fn, rel_err, copy_bandwidth
from torch.nn.attention import SDPBackend

dims = [int(x) for x in sys.argv[1].split(",")]
lib = load_lib("build-hopper/bench/gpu/libfpbench.so")
fp = Flashport(lib)
variants = [("v1", "1", "1", "0"), ("v3", "3", "1", "0"), ("v3p", "3", "1", "1")] + \
    ([("v3nopp", "3", "0", "0")] if os.environ.get("FP_BENCH_NOPP", "1") == "1" else [])
print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
print(f"device-to-device copy: {copy_bandwidth():.2f} TB/s\n")
print("| D | S | B | causal | v1 | v3 | v3 persistent | v3 no-pp | v3 again | torch flash | cuDNN | v3/v1 | v3/flash | v3/cuDNN | v3p/v3 | v3 err | v3 kernel |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for D in dims:
    for S in (1024, 4096, 16384):
        B, H = 16384 // S, 2048 // D
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out = torch.empty_like(q)
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            tf = lambda t: flops / (t * 1e-3) / 1e12
            ref = sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, False)().transpose(1, 2)
            res, errs, kern = {}, {}, {}
            for name, sched, pp, persist in variants + [("v3b", "3", "1", "0")]:
                os.environ["FLASHPORT_HOPPER_SCHED"], os.environ["FLASHPORT_HOPPER_PINGPONG"] = sched, pp
                os.environ["FLASHPORT_HOPPER_PERSISTENT"] = persist
                out.fill_(float("nan"))
                f = fp.prepare(q, k, v, out, causal, 0)
                f()
                torch.cuda.synchronize()
                errs[name], kern[name] = rel_err(out, ref), f.kernel
                res[name] = time_ms(f)
            t_fa, _ = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, False))
            t_cd, _ = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, False))
            bad = [n for n in errs if not (errs[n] < 2e-2)]
            print(f"| {D} | {S} | {B} | {'y' if causal else 'n'} | {tf(res['v1']):.0f} | {tf(res['v3']):.0f} | "
                  f"{tf(res['v3p']):.0f} | {tf(res.get('v3nopp', float('nan'))):.0f} | {tf(res['v3b']):.0f} | {tf(t_fa):.0f} | {tf(t_cd):.0f} | "
                  f"{res['v1'] / res['v3']:.2f} | {t_fa / res['v3']:.2f} | {t_cd / res['v3']:.2f} | {res['v3'] / res['v3p']:.2f} | "
                  f"{errs['v3']:.1e}{' BAD ' + ','.join(bad) if bad else ''} | {kern['v3']} |", flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
EOF
echo "bench rc=$? ($(elapsed) s)"
tail -3 "$LOG/bench.err"
cp "$LOG/bench.md" "$OUT/bench.md" 2>/dev/null

[ "$extra" != quick ] && echo "== Hopper tests, schedule v1 (FLASHPORT_HOPPER_SCHED=1)"
[ "$extra" != quick ] && run_tests v1 FLASHPORT_HOPPER_SCHED=1 | tee "$LOG/sum_v1.txt"

sum_f="(not run)"
if { [ "$(elapsed)" -lt 300 ] && [ "$extra" != quick ]; } || [ "$extra" = fwdtests ]; then
  echo "== other forward suites under v3 (Hopper kernel v3 selected where it fits)"
  FLASHPORT_HOPPER_SCHED=3 timeout 200 ./build-hopper/tests/gpu/gpu_tests --gtest_brief=1 \
    --gtest_filter='CudaFwd.*:CudaGraph.*:CudaPlan.*:CudaMerge.*' > "$LOG/tests_fwd_v3.log" 2>&1
  rc_f=$?
  grep -E "^\[  FAILED|Failure|Expected|Which is" "$LOG/tests_fwd_v3.log" | head -20
  sum_f="rc=$rc_f $(grep -E '^\[  (PASSED|FAILED) ' "$LOG/tests_fwd_v3.log" | tr '\n' ' ')"
fi

echo "== summary ($(elapsed) s)"
cat "$LOG/sum_v3.txt" "$LOG/sum_v3p.txt" "$LOG/sum_v1.txt" 2>/dev/null | grep "hopper tests"
echo "forward suites under v3: $sum_f"
cat "$LOG/bench.md"
exit 0
