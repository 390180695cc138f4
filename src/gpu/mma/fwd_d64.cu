// Instances of the forward main loop for head dims in the 64 bucket (prefill and decode tiles).
#include "gpu/mma/fwd_kernel.cuh"

namespace flashport::gpu {
FP_INSTANTIATE_FWD(kPrefill64)
FP_INSTANTIATE_FWD(kDecode64)
}  // namespace flashport::gpu
