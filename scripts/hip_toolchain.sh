#!/usr/bin/env bash
# Installs the HIP toolchain that compiles flashport for AMD GPUs on Debian 12 (clang-19 with
# Debian's HIP 5.2 headers, runtime and device libraries; clang-tools-19 for the offload bundler)
# and makes the device-library folder clang needs for targets newer than Debian's bitcode
# (gfx942, gfx1100, gfx1201). Idempotent.
# Usage: scripts/hip_toolchain.sh [BITCODE_DIR]      (default: build-hip-toolchain/bitcode)
# Prints the bitcode folder on its last line. No AMD GPU is needed (or used).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build-hip-toolchain/bitcode}"
llvm=/usr/lib/llvm-19/bin
sys_bc=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode

if [ ! -x "$llvm/clang++" ] || [ ! -x "$llvm/ld.lld" ] || [ ! -x "$llvm/clang-offload-bundler" ] ||
   [ ! -f /usr/include/hip/hip_runtime.h ] ||
   [ ! -f "$sys_bc/oclc_isa_version_90a.bc" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    clang-19 clang-tools-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs >/dev/null
fi

# Debian ships oclc_isa_version_<gfx>.bc up to gfx940. Each is a module holding one constant
# (the ISA version, e.g. 9010 for gfx90a); the newer targets get a copy with theirs.
mkdir -p "$out"
for f in "$sys_bc"/*.bc; do
  [ -e "$out/$(basename "$f")" ] || cp "$f" "$out/"
done
for v in 942:9402 1100:11000 1201:12001; do
  gfx="${v%%:*}" num="${v#*:}"
  dst="$out/oclc_isa_version_${gfx}.bc"
  [ -f "$dst" ] && continue
  "$llvm/llvm-dis" "$sys_bc/oclc_isa_version_90a.bc" -o - | sed "s/i32 9010/i32 ${num}/" |
    "$llvm/llvm-as" -o "$dst.tmp"
  grep -q . <("$llvm/llvm-dis" "$dst.tmp" -o - | grep "i32 ${num}") ||
    { echo "hip_toolchain: could not make $dst" >&2; exit 1; }
  mv "$dst.tmp" "$dst"
done
echo "$(cd "$out" && pwd)"
