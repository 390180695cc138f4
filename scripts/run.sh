#!/usr/bin/env bash
# The main job: build flashport (CPU; CUDA too where nvcc and a GPU are present) and run the
# `flashport` CLI on its embedded prefill and decode cases, checked against the fp64 reference.
# Extra arguments go to the CLI (see `build/flashport --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cuda_flags=()
device_args=()
if command -v nvcc >/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  cuda_flags=(-DFLASHPORT_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${FLASHPORT_CUDA_ARCHS:-90}")
  device_args=(--device cuda)
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_TESTS=OFF "${cuda_flags[@]}" >/dev/null
ninja -C build flashport_cli
./build/flashport "${device_args[@]}" "$@"
