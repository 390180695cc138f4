#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suites (CTest; the host suites again under ASan +
# UBSan), the CUDA build for sm_80/sm_90
# (compiled here; its tests run only where a GPU is present), the AMD build and its ISA check
# (compile only), and the Python suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh --python
jobs=$(nproc)
start=$(date +%s)

echo "== C++ build (CPU backends) and CTest"
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build-test -j"$jobs"
ctest --test-dir build-test --output-on-failure -j"$jobs"

echo "== Host suites under ASan + UBSan (CPU build; any report fails)"
san="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHPORT_CUDA=OFF \
  "-DCMAKE_C_FLAGS=$san" "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_EXE_LINKER_FLAGS=$san" >/dev/null
ninja -C build-sanitize -j"$jobs" core_tests reference_tests cpu_tests dropout_lanes_emu
for t in core/core_tests reference/reference_tests cpu/cpu_tests amd/dropout_lanes_emu; do
  echo "-- $t"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "build-sanitize/tests/$t" 2>&1 | tail -n 25
done

if command -v nvcc >/dev/null; then
  echo "== CUDA build (sm_80, sm_90)"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_CUDA=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=${FLASHPORT_CUDA_ARCHS:-80;90}" >/dev/null
  ninja -C build-cuda -j"$jobs"
  # GPU tests skip themselves where no device is present; here they prove the binary links and runs.
  if [ -x build-cuda/tests/gpu/gpu_tests ]; then ./build-cuda/tests/gpu/gpu_tests; fi
fi

echo "== AMD (HIP) build for gfx90a/gfx942/gfx1100/gfx1201 and the ISA check (compile only)"
bash scripts/check_amd_isa.sh build-hip-isa

if [ -f pyproject.toml ]; then
  echo "== Python package (pip install .) and pytest"
  FLASHPORT_CUDA="${FLASHPORT_PY_CUDA:-OFF}" python3 -m pip install -q --disable-pip-version-check --no-build-isolation .
  python3 -m pytest -q tests/python
fi
echo "== all tests passed in $(( $(date +%s) - start )) s"
