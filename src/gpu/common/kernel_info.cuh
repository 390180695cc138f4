// The per-device kernel query behind every *_kernel_info of the CUDA build (host code; reads
// kernel attributes through the runtime, so only CUDA translation units include it).
#pragma once
#include <atomic>

#include "gpu/common/kernel_info.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

// The query for kernel `kKernel` launched with `threads` threads and `smem` bytes of dynamic
// shared memory, on the current device `device`; cached per device (each kernel instance has
// its own cache). Host code of the CUDA build only: kernel attributes are read through the runtime.
template <auto kKernel>
KernelInfo cached_kernel_info(int device, int threads, int smem) {
  constexpr int kMaxDevices = 64;
  static KernelInfo cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return KernelInfo{gpuErrorInvalidDevice};
  if (ready[device].load(std::memory_order_acquire)) return cache[device];
  KernelInfo info;
  gpuFuncAttributes attr;
  info.status = gpuFuncGetAttributes(&attr, kKernel);
  if (info.status == gpuSuccess) {
    info.num_regs = attr.numRegs;
    info.local_bytes = static_cast<int>(attr.localSizeBytes);
    info.status = gpuFuncSetAttribute(kKernel, gpuFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  if (info.status == gpuSuccess)
    info.status = gpuOccupancyMaxActiveBlocksPerMultiprocessor(&info.blocks_per_sm, kKernel, threads, smem);
  gpuGetLastError();  // a failed query must not surface as a later launch error
  cache[device] = info;
  ready[device].store(true, std::memory_order_release);
  return info;
}

// One kernel instance with the block shape it runs with: the per-device query and the launch read
// the same threads and dynamic shared memory, so "usable on this device" describes the launch.
template <auto kKernel, int kThreads, int kSmemBytes>
struct KernelInstance {
  static KernelInfo info(int device) { return cached_kernel_info<kKernel>(device, kThreads, kSmemBytes); }
  // On the caller's stream; returns the launch's error.
  template <typename Args>
  static gpuError_t launch(const Args& a, dim3 grid, gpuStream_t stream) {
    kKernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
    return gpuGetLastError();
  }
};

}  // namespace flashport::gpu
