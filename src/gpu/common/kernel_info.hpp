// Per-(device, kernel) facts read once, for every kernel of the GPU backend: whether the device
// has an image of the kernel, its registers and local memory, and how many blocks fit per SM at
// its shared-memory size (the dynamic limit is raised on first use).
#pragma once
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

struct KernelInfo {
  gpuError_t status = gpuSuccess;  // cudaErrorNoKernelImageForDevice when the arch wasn't built
  int blocks_per_sm = 0;
  int num_regs = 0;
  int local_bytes = 0;
};

}  // namespace flashport::gpu
