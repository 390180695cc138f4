// Instances of the backward main loop for head dims in the 128 bucket (fp16 and bf16).
#include "gpu/mma/bwd_kernel.cuh"

namespace flashport::gpu {
FP_INSTANTIATE_BWD(kBwd128)
}  // namespace flashport::gpu
