// Instances of the shared forward main loop (fwd_kernel.cuh) for AMD: the tile rows of
// tile_config.hpp's AMD table (head dims 64, 128, 256) x fp16/bf16 (6 kernels), and their launch
// entry. Compiled for every target in FLASHPORT_HIP_ARCHS by src/gpu/amd/hip.cmake; their device ISA
// is what scripts/check_amd_isa.sh reads.
#include "gpu/mma/fwd_kernel.cuh"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

namespace {
template <int kTile>
gpuError_t launch_tile(bool bf16, const FwdArgs& a, dim3 grid, int wave_size, gpuStream_t stream) {
  constexpr TileConfig C = kTileConfigs[kTile];
  const dim3 block(unsigned(C.threads(wave_size)));
  // Dynamic LDS within the 64 KiB a workgroup may use without an opt-in (static_assert in the table).
  if (bf16) fwd_kernel<kTile, BFloat16><<<grid, block, C.smem_bytes(), stream>>>(a);
  else fwd_kernel<kTile, Half><<<grid, block, C.smem_bytes(), stream>>>(a);
  return gpuGetLastError();
}
}  // namespace

gpuError_t launch_fwd_amd(TileId tile, bool bf16, const FwdArgs& a, dim3 grid, int wave_size,
                          gpuStream_t stream) {
  switch (tile) {
    case kPrefill64: return launch_tile<kPrefill64>(bf16, a, grid, wave_size, stream);
    case kPrefill128: return launch_tile<kPrefill128>(bf16, a, grid, wave_size, stream);
    case kPrefill256: return launch_tile<kPrefill256>(bf16, a, grid, wave_size, stream);
    default: return hipErrorInvalidValue;  // decode ids are not used on AMD (tile_id_for)
  }
}

FP_TARGET_NS_END
}  // namespace flashport::gpu
