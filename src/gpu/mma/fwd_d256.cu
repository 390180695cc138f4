// Instances of the forward main loop for head dims in the 256 bucket (prefill and decode tiles).
#include "gpu/mma/fwd_kernel.cuh"

namespace flashport::gpu {
FP_INSTANTIATE_FWD(kPrefill256)
FP_INSTANTIATE_FWD(kDecode256)
}  // namespace flashport::gpu
