// Instances of the backward main loop for head dims in the 256 bucket (fp16 and bf16).
#include "gpu/mma/bwd_kernel.cuh"

namespace flashport::gpu {
FP_INSTANTIATE_BWD(kBwd256)
}  // namespace flashport::gpu
