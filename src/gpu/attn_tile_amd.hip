// Instances of the AMD forward attention tile: head dims 64 and 128, fp16 and bf16 (4 kernels).
// Compiled for every target in FLASHPORT_HIP_ARCHS by src/gpu/hip.cmake; their device ISA is
// what scripts/check_amd_isa.sh reads.
#include "attn_tile_amd.cuh"

namespace flashport::gpu {
template __global__ void attn_tile_kernel<64, Half>(const FwdArgs);
template __global__ void attn_tile_kernel<64, BFloat16>(const FwdArgs);
template __global__ void attn_tile_kernel<128, Half>(const FwdArgs);
template __global__ void attn_tile_kernel<128, BFloat16>(const FwdArgs);
}  // namespace flashport::gpu
