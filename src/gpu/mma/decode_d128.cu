// Instances of the decode kernel (decode_kernel.cuh): head dims 72..128, fp16 and bf16.
#include "gpu/mma/decode_kernel.cuh"

namespace flashport::gpu {
template KernelInfo decode_kernel_info<false>(int);
template KernelInfo decode_kernel_info<true>(int);
template gpuError_t launch_decode<false>(const FwdArgs&, dim3, gpuStream_t);
template gpuError_t launch_decode<true>(const FwdArgs&, dim3, gpuStream_t);
}  // namespace flashport::gpu
