// A CUDA driver function through the runtime (no -lcuda link), for the few driver-only calls the
// CUDA build makes (the TMA encoder, a stream's green context). CUDA only (host code).
#pragma once
#include <cuda_runtime.h>

namespace flashport::gpu {

// The entry point of driver function `name` with the ABI of CUDA `version` (e.g. 12050), or null
// when the driver lacks it; the runtime's error state is left clear either way.
inline void* driver_entry_point(const char* name, int version) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &f, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return f;
}

}  // namespace flashport::gpu
