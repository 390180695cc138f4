// Instances of the AMD forward attention tile: head dims 64 and 128, fp16 and bf16 (4 kernels),
// and their launch entry. Compiled for every target in FLASHPORT_HIP_ARCHS by src/gpu/hip.cmake;
// their device ISA is what scripts/check_amd_isa.sh reads.
#include "attn_tile_amd.cuh"

namespace flashport::gpu {

gpuError_t launch_attn_tile_amd(int head_dim, bool bf16, const FwdArgs& a, dim3 grid, int wave_size,
                                gpuStream_t stream) {
  const dim3 block(unsigned(kAttnWaves * wave_size));
  if (head_dim == 64) {
    if (bf16) attn_tile_kernel<64, BFloat16><<<grid, block, 0, stream>>>(a);
    else attn_tile_kernel<64, Half><<<grid, block, 0, stream>>>(a);
  } else if (head_dim == 128) {
    if (bf16) attn_tile_kernel<128, BFloat16><<<grid, block, 0, stream>>>(a);
    else attn_tile_kernel<128, Half><<<grid, block, 0, stream>>>(a);
  } else {
    return hipErrorInvalidValue;
  }
  return gpuGetLastError();
}

}  // namespace flashport::gpu
