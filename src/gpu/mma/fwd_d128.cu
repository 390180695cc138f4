// Instances of the forward main loop for head dims in the 128 bucket (prefill and decode tiles).
#include "gpu/mma/fwd_kernel.cuh"

namespace flashport::gpu {
FP_INSTANTIATE_FWD(kPrefill128)
FP_INSTANTIATE_FWD(kDecode128)
}  // namespace flashport::gpu
