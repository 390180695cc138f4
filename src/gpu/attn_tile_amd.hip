// Instances of the AMD forward attention tile: head dims 64, 128 and 256, fp16 and bf16 (6 kernels),
// and their launch entry. Compiled for every target in FLASHPORT_HIP_ARCHS by src/gpu/hip.cmake;
// their device ISA is what scripts/check_amd_isa.sh reads.
#include "attn_tile_amd.cuh"

namespace flashport::gpu {

gpuError_t launch_attn_tile_amd(int head_dim, bool bf16, const FwdArgs& a, dim3 grid, int wave_size,
                                gpuStream_t stream) {
  const dim3 block(unsigned(amd_tile(head_dim).waves * wave_size));
#define FP_LAUNCH(D)                                                                  \
  if (head_dim == D) {                                                                \
    if (bf16) attn_tile_kernel<D, BFloat16><<<grid, block, 0, stream>>>(a);          \
    else attn_tile_kernel<D, Half><<<grid, block, 0, stream>>>(a);                   \
    return gpuGetLastError();                                                         \
  }
  FP_LAUNCH(64)
  FP_LAUNCH(128)
  FP_LAUNCH(256)
#undef FP_LAUNCH
  return hipErrorInvalidValue;
}

}  // namespace flashport::gpu
