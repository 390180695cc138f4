// Instances of the shared backward (bwd_kernel.cuh, bwd_aux_kernels.cuh) for AMD: the main loop on
// the AMD rows of bwd_launch.hpp's tile table (head dims 64, 128, 256) x fp16/bf16 (6 kernels), the
// preprocess, dq conversion and sink-gradient kernels (3), and their launch entries. Compiled for
// every target in FLASHPORT_HIP_ARCHS by src/gpu/amd/hip.cmake; their device ISA is what
// scripts/check_amd_isa.sh reads. Compile-verified and emulated (tests/amd), never run on AMD.
#include "gpu/mma/bwd_aux_kernels.cuh"
#include "gpu/mma/bwd_kernel.cuh"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

namespace {
template <int kTile>
gpuError_t launch_bwd_tile(bool bf16, const BwdArgs& a, dim3 grid, int wave_size, gpuStream_t stream) {
  constexpr BwdTile C = kBwdTiles[kTile];
  const dim3 block(unsigned(C.threads(wave_size)));
  // Dynamic LDS within the 64 KiB a workgroup may use without an opt-in (static_assert in the table).
  if (bf16) bwd_kernel<kTile, BFloat16><<<grid, block, C.smem_bytes(), stream>>>(a);
  else bwd_kernel<kTile, Half><<<grid, block, C.smem_bytes(), stream>>>(a);
  return gpuGetLastError();
}
}  // namespace

gpuError_t launch_bwd_amd(int tile, bool bf16, const BwdArgs& a, dim3 grid, int wave_size, gpuStream_t stream) {
  switch (tile) {
    case kBwd64: return launch_bwd_tile<kBwd64>(bf16, a, grid, wave_size, stream);
    case kBwd128: return launch_bwd_tile<kBwd128>(bf16, a, grid, wave_size, stream);
    case kBwd256: return launch_bwd_tile<kBwd256>(bf16, a, grid, wave_size, stream);
    default: return hipErrorInvalidValue;
  }
}

// The aux kernels are compiled for the target's wave size (kWarpSize); the device's must match
// (the gate checks it), so `wave_size` only shapes the launch.
gpuError_t launch_bwd_preprocess_amd(const BwdArgs& a, int wave_size, gpuStream_t stream) {
  bwd_preprocess_kernel<<<bwd_aux_blocks(a), unsigned(kAuxWarps * wave_size), 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_bwd_convert_amd(const BwdArgs& a, int wave_size, gpuStream_t stream) {
  bwd_convert_kernel<<<bwd_aux_blocks(a), unsigned(kAuxWarps * wave_size), 0, stream>>>(a);
  if (gpuError_t e = gpuGetLastError(); e != gpuSuccess) return e;
  if (a.d_sinks != nullptr && a.rules.sinks != nullptr) {
    bwd_sink_kernel<<<unsigned(a.hq), unsigned(kSinkThreads), 0, stream>>>(a);
    return gpuGetLastError();
  }
  return gpuSuccess;
}

FP_TARGET_NS_END
}  // namespace flashport::gpu
