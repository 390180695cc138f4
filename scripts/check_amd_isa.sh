#!/usr/bin/env bash
# AMD build check (no AMD GPU needed or used): installs the HIP toolchain (scripts/hip_toolchain.sh),
# builds the HIP sources for gfx90a, gfx942 (MFMA) and gfx1100, gfx1201 (WMMA) with
# -DFLASHPORT_HIP=ON, then reads the device ISA. Fails unless every attention kernel contains
# v_mfma instructions on gfx90a/gfx942 and v_wmma instructions on gfx1100/gfx1201 (and none of the
# other family) and no scratch (VGPR spills or stack arrays). Prints instruction counts,
# VGPRs/AGPRs/SGPRs, LDS (static, and the dynamic LDS of the tile row the launch passes), scratch
# and spills per kernel. The attention kernels are the forward main loop shared with CUDA
# (src/gpu/mma/fwd_kernel.cuh) and the attention backward shared with CUDA (src/gpu/mma/bwd_kernel.cuh).
# The aux kernels shared with CUDA (src/gpu/common/aux_kernels.cu: merge / split-KV combine, merge
# backward, KV-cache append, rotary q; src/gpu/mma/bwd_aux_kernels.cuh: backward preprocess, dq
# conversion, sink gradient) are memory-bound and have no matrix instructions: each must be present
# on every target, with no scratch, and no matrix instruction is required of them.
# Usage: scripts/check_amd_isa.sh [BUILD_DIR]        (default build-hip-isa)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-hip-isa}"
archs="${FLASHPORT_HIP_ARCHS:-gfx90a;gfx942;gfx1100;gfx1201}"
start=$(date +%s)

bitcode=$(bash scripts/hip_toolchain.sh | tail -n 1)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHPORT_HIP=ON -DFLASHPORT_CPU=OFF \
  -DFLASHPORT_TESTS=OFF -DFLASHPORT_CLI=OFF -DFLASHPORT_PYTHON=OFF \
  "-DFLASHPORT_HIP_ARCHS=${archs}" "-DFLASHPORT_HIP_DEVICE_LIBS=${bitcode}" >/dev/null
ninja -C "$build" -j"$(nproc)" flashport_hip_objects >/dev/null

# The dynamic LDS of each tile row, read from the tables themselves (AMD rows, host compile).
probe="$build/hip_isa/lds_probe"
cat > "$probe.cpp" <<'CPP'
#include <cstdio>
#include "gpu/common/tile_config.hpp"
#include "gpu/mma/bwd_launch.hpp"
int main() {
  using namespace flashport::gpu;
  for (int t = 0; t < kNumTileIds; ++t) std::printf("fwd_kernel %d %d\n", t, kTileConfigs[t].smem_bytes());
  for (int t = 0; t < kNumBwdTiles; ++t) std::printf("bwd_kernel %d %d\n", t, kBwdTiles[t].smem_bytes());
}
CPP
/usr/lib/llvm-19/bin/clang++ -std=c++20 -DFLASHPORT_HIP_HOST -D__HIP_PLATFORM_AMD__ -I/usr/include -Isrc -Iinclude \
  "$probe.cpp" -o "$probe"
"$probe" > "$build/hip_isa/lds_rows.txt"

python3 - "$build/hip_isa" "$archs" <<'EOF'
import glob, os, re, subprocess, sys

isa_dir, archs = sys.argv[1], sys.argv[2].split(";")
# Attention kernels: the forward main loop shared with CUDA (fwd_kernel.cuh, instances in fwd_amd.hip)
# and the backward shared with CUDA (bwd_kernel.cuh, instances in bwd_amd.hip).
ATTENTION = re.compile(r"fwd_kernel|bwd_kernel")
BACKWARD = re.compile(r"bwd_kernel")
BWD_PER_TARGET = 6
# Aux kernels (aux_kernels.cu, bwd_aux_kernels.cuh): no matrix instruction required; 7 instances a target.
AUX = re.compile(r"merge_kernel|merge_bwd_kernel|append_rotate_kernel|"
                 r"bwd_preprocess_kernel|bwd_convert_kernel|bwd_sink_kernel")
AUX_PER_TARGET = 7
# Dynamic LDS per (kernel, tile row) from the tables (lds_probe).
DYN_LDS = {}
for line in open(os.path.join(isa_dir, "lds_rows.txt")):
    kind, tile, lds = line.split()
    DYN_LDS[(kind, int(tile))] = int(lds)

def dyn_lds(name):
    m = re.search(r"(fwd_kernel|bwd_kernel)<(\d+)", name)
    return DYN_LDS.get((m.group(1), int(m.group(2))), 0) if m else 0
FIELDS = ["vgpr_count", "agpr_count", "sgpr_count", "group_segment_fixed_size",
          "private_segment_fixed_size", "vgpr_spill_count", "sgpr_spill_count"]

def demangle(names):
    for tool in ("/usr/lib/llvm-19/bin/llvm-cxxfilt", "c++filt"):
        try:
            out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
            return dict(zip(names, out.stdout.splitlines()))
        except (OSError, subprocess.CalledProcessError):
            continue
    return {n: n for n in names}

def kernels(path):
    """Per kernel: matrix instruction counts from its body and the code-object metadata."""
    text = open(path).read()
    found = {}
    for m in re.finditer(r"^(\S+):\s*(?:;[^\n]*)?\n(.*?)^\.Lfunc_end\d+:", text, re.S | re.M):
        name, body = m.group(1), m.group(2)
        if name.startswith(".") or not (ATTENTION.search(name) or AUX.search(name)):
            continue
        found[name] = {"mfma": len(re.findall(r"^\s+v_mfma_\S+", body, re.M)),
                       "wmma": len(re.findall(r"^\s+v_wmma_\S+", body, re.M))}
    meta = text[text.find("amdhsa.kernels:"):]
    for block in re.split(r"\n  - ", meta)[1:]:
        nm = re.search(r"^\s*\.name:\s+(\S+)", block, re.M)
        if nm and nm.group(1) in found:
            for f in FIELDS:
                v = re.search(r"^\s*\." + f + r":\s+(\d+)", block, re.M)
                found[nm.group(1)][f] = int(v.group(1)) if v else 0
    return found

failures, rows = [], []
for arch in archs:
    # MFMA on gfx90a/gfx94x, WMMA on gfx11xx/gfx12xx; other targets take the plain path.
    if re.fullmatch(r"gfx90a|gfx94[0-2]", arch):
        want, other = "mfma", "wmma"
    elif re.fullmatch(r"gfx1[12][0-9a-f]{2}", arch):
        want, other = "wmma", "mfma"
    else:
        want, other = None, None
    files = sorted(glob.glob(os.path.join(isa_dir, f"*-{arch}.s")))
    if not files:
        failures.append(f"{arch}: no device ISA in {isa_dir}")
        continue
    seen = aux_seen = bwd_seen = 0
    for path in files:
        ks = kernels(path)
        names = demangle(list(ks))
        for name, k in sorted(ks.items(), key=lambda kv: names[kv[0]]):
            rows.append((arch, names[name], k))
            if AUX.search(name):
                aux_seen += 1
                if k.get("private_segment_fixed_size", 0) or k.get("vgpr_spill_count", 0):
                    failures.append(f"{arch}: {names[name]} uses scratch ({k.get('private_segment_fixed_size', 0)} "
                                    f"bytes, {k.get('vgpr_spill_count', 0)} VGPRs spilled)")
                continue
            seen += 1
            bwd_seen += 1 if BACKWARD.search(name) else 0
            if want and k[want] == 0:
                failures.append(f"{arch}: {names[name]} has no v_{want} instruction")
            if other and k[other] != 0:
                failures.append(f"{arch}: {names[name]} has v_{other} instructions")
            if k.get("private_segment_fixed_size", 0) or k.get("vgpr_spill_count", 0):
                failures.append(f"{arch}: {names[name]} uses scratch ({k.get('private_segment_fixed_size', 0)} "
                                f"bytes, {k.get('vgpr_spill_count', 0)} VGPRs spilled)")
    if seen == 0:
        failures.append(f"{arch}: no attention kernel found")
    if aux_seen != AUX_PER_TARGET:
        failures.append(f"{arch}: {aux_seen} aux kernels found, expected {AUX_PER_TARGET}")
    if bwd_seen != BWD_PER_TARGET:
        failures.append(f"{arch}: {bwd_seen} backward kernels found, expected {BWD_PER_TARGET}")

# lds: static LDS; dynlds: the dynamic LDS of the launch (the tile row of tile_config.hpp /
# bwd_launch.hpp's AMD tables the kernel is instantiated for).
print(f"{'target':8} {'kernel':58} {'mfma':>5} {'wmma':>5} {'vgpr':>5} {'agpr':>5} {'sgpr':>5} "
      f"{'lds':>6} {'dynlds':>6} {'scratch':>7} {'vspill':>6} {'sspill':>6}")
for arch, name, k in rows:
    short = (name.replace("flashport::gpu::", "").replace("amd_target::", "")
             .replace("(FwdArgs)", "").replace("(flashport::gpu::FwdArgs)", "")
             .replace("(anonymous namespace)::", "").replace("(flashport::gpu::MergeArgs)", "")
             .replace("(flashport::gpu::MergeBwdArgs)", "").replace("(flashport::gpu::AppendArgs)", "")
             .replace("(flashport::gpu::BwdArgs)", "").replace("(BwdArgs)", ""))
    print(f"{arch:8} {short:58} {k['mfma']:5} {k['wmma']:5} {k.get('vgpr_count', 0):5} "
          f"{k.get('agpr_count', 0):5} {k.get('sgpr_count', 0):5} {k.get('group_segment_fixed_size', 0):6} "
          f"{dyn_lds(name):6} {k.get('private_segment_fixed_size', 0):7} {k.get('vgpr_spill_count', 0):6} "
          f"{k.get('sgpr_spill_count', 0):6}")
if failures:
    print("AMD ISA check FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
n_aux = sum(1 for r in rows if AUX.search(r[1]))
n_bwd = sum(1 for r in rows if BACKWARD.search(r[1]) and not AUX.search(r[1]))
print(f"AMD ISA check passed: {len(rows) - n_aux} attention ({len(rows) - n_aux - n_bwd} forward + {n_bwd} backward) "
      f"+ {n_aux} aux kernels over {len(archs)} targets (compile-verified and ISA-checked; not run on AMD hardware)")
EOF
echo "AMD ISA check took $(( $(date +%s) - start )) s"
