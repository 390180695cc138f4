// Thin vendor layer: the few runtime calls and device intrinsics flashport's GPU code uses, under
// one spelling (gpu*), so each kernel source is written once for CUDA and HIP. Only what is used
// is mapped; add a line here rather than calling cuda*/hip* directly in a kernel file.
//
// Architecture is one number: FP_ARCH = vendor offset + native number (NVIDIA: 10*major+minor,
// e.g. 800, 900; AMD: 0x10000 + gfx number later). Host code compares the device's capability
// against it; device code built for an unsupported arch traps with the compiled list.
//
// tests/amd's CPU emulation of AMD workgroups (FP_AMD_EMULATION) provides these names itself
// (tests/amd/simt_emu.hpp), so this header is empty there.
#pragma once
#if !defined(FP_AMD_EMULATION)

#if defined(__HIPCC__) || defined(FLASHPORT_HIP_HOST)
#include <hip/hip_runtime.h>
#define FP_VENDOR_AMD 1
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
using gpuFuncAttributes = hipFuncAttributes;
#define gpuSuccess hipSuccess
#define gpuErrorInvalidDevice hipErrorInvalidDevice
#define gpuErrorNoKernelImageForDevice hipErrorNoBinaryForGpu
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDevice hipGetDevice
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeSharedMemPerBlockOptin
#define gpuDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define gpuFuncSetAttribute(f, a, v) hipFuncSetAttribute(reinterpret_cast<const void*>(f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuFuncGetAttributes(attr, f) hipFuncGetAttributes(attr, reinterpret_cast<const void*>(f))
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuPointerGetAttributes hipPointerGetAttributes
#if defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;  // 64 on CDNA (gfx9), 32 on RDNA (gfx10+)
#else
constexpr int kWarpSize = 64;  // host pass: launch shapes use the device's wave size at run time
#endif
#else
#include <cuda_runtime.h>
#define FP_VENDOR_NVIDIA 1
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
using gpuFuncAttributes = cudaFuncAttributes;
#define gpuSuccess cudaSuccess
#define gpuErrorInvalidDevice cudaErrorInvalidDevice
#define gpuErrorNoKernelImageForDevice cudaErrorNoKernelImageForDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDevice cudaGetDevice
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrMaxSharedMemoryPerBlockOptin cudaDevAttrMaxSharedMemoryPerBlockOptin
#define gpuDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor cudaDevAttrComputeCapabilityMinor
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuFuncGetAttributes cudaFuncGetAttributes
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
constexpr int kWarpSize = 32;
#endif

#ifndef FLASHPORT_GPU_ARCHS
#define FLASHPORT_GPU_ARCHS "unknown"  // set by src/gpu/CMakeLists.txt from the arch list
#endif

// Vendor offset + native arch number of the code being compiled for the device (0 on the host).
#if defined(__CUDA_ARCH__)
#define FP_ARCH (__CUDA_ARCH__ / 10 * 10)
#else
#define FP_ARCH 0
#endif

namespace flashport::gpu {

constexpr int kMinNvidiaArch = 800;  // mma.sync m16n8k16 bf16, ldmatrix, cp.async

// Device helpers: only in GPU compilations (plain C++ sources include this header for the
// runtime names above).
#if defined(__CUDACC__) || defined(__HIPCC__)
// Warp shuffles and fast math under one name. Width is the lane group reduced over.
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
#if defined(FP_VENDOR_AMD)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// Whether `pred` holds in any lane of the warp (wave).
__device__ __forceinline__ bool warp_any(bool pred) {
#if defined(FP_VENDOR_AMD)
  return __any(pred);
#else
  return __any_sync(0xffffffffu, pred);
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
#if defined(FP_VENDOR_AMD)
  return __builtin_amdgcn_exp2f(x);
#else
  return exp2f(x);  // ex2.approx.ftz under -use_fast_math; exact enough for softmax weights
#endif
}

__device__ __forceinline__ float fast_log2(float x) { return __log2f(x); }
#endif  // __CUDACC__ || __HIPCC__

// Device-side arch gate: a kernel body compiled for an arch below what its code needs (or for
// the host pass) traps with the list of archs this library was built for, instead of running
// garbage. Host code checks the same thing before launching, so this fires only on misuse.
#define FP_REQUIRE_ARCH(min_arch)                                                              \
  do {                                                                                         \
    if (FP_ARCH != 0 && FP_ARCH < (min_arch)) {                                                \
      if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)           \
        printf("flashport: kernel needs sm_%d+, this code was compiled for sm_%d (built archs: " \
               "%s)\n",                                                                        \
               (min_arch) / 10, FP_ARCH / 10, FLASHPORT_GPU_ARCHS);                            \
      __trap();                                                                                \
    }                                                                                          \
  } while (0)

}  // namespace flashport::gpu

// Kernel declaration pieces that are spelled differently per vendor:
//   FP_LAUNCH_BOUNDS(threads, min_blocks): CUDA's second argument is blocks per SM; HIP's would be
//     waves per execution unit, a different budget, so AMD kernels give the thread count only;
//   FP_GRID_CONSTANT: kernel arguments read in place from the constant bank (CUDA); HIP kernel
//     arguments are always in the kernarg segment;
//   FP_EXTERN_SMEM(type, name): the dynamic shared memory of a launch, 128-byte aligned.
#if defined(FP_VENDOR_AMD)
#define FP_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads)
#define FP_GRID_CONSTANT
#define FP_EXTERN_SMEM(type, name) extern __shared__ __attribute__((aligned(128))) type name[]
#else
#define FP_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#define FP_GRID_CONSTANT __grid_constant__
#define FP_EXTERN_SMEM(type, name) extern __shared__ __align__(128) type name[]
#endif

#endif  // !FP_AMD_EMULATION
