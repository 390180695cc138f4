// Launch entry points of the GPU kernels (host side). Instances live in fwd_d{64,128,256}.cu,
// one head-dim bucket each, so the CUDA build compiles them in parallel.
#pragma once
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/kernel_info.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

// kTile x {Half, BFloat16}; defined in the instance files.
template <int kTile, bool kBf16>
KernelInfo fwd_kernel_info(int device);
template <int kTile, bool kBf16>
gpuError_t launch_fwd(const FwdArgs& a, dim3 grid, gpuStream_t stream);

gpuError_t launch_merge(const MergeArgs& a, gpuStream_t stream);
gpuError_t launch_merge_bwd(const MergeBwdArgs& a, gpuStream_t stream);
gpuError_t launch_append(const AppendArgs& a, bool bf16, gpuStream_t stream);
// The same append / rotary kernels for fp32 calls (q, k, v, k_new, v_new fp32; CUDA only).
gpuError_t launch_append_f32(const AppendArgs& a, gpuStream_t stream);

// Number of kernel template instances the build compiles (printed by CMake, checked by a test).
inline constexpr int kFwdInstances = kNumTileIds * 2;

#if defined(FP_TARGET_NVIDIA)
// The decode kernel (decode_kernel.cuh, CUDA only) x {Half, BFloat16}; defined in decode_d128.cu.
template <bool kBf16>
KernelInfo decode_kernel_info(int device);
template <bool kBf16>
gpuError_t launch_decode(const FwdArgs& a, dim3 grid, gpuStream_t stream);
inline constexpr int kDecodeInstances = 2;
#endif

#if defined(FP_TARGET_AMD)
FP_TARGET_NS_BEGIN
// HIP: the same main loop's instances for the AMD tile rows (one per head-dim bucket: kPrefill64,
// kPrefill128, kPrefill256) x {fp16, bf16}, launched with warps x `wave_size` threads (the
// device's wave size; the gate has checked it is the one the code objects were built for).
// Defined in fwd_amd.hip.
inline constexpr int kAmdFwdInstances = 3 * 2;
gpuError_t launch_fwd_amd(TileId tile, bool bf16, const FwdArgs& a, dim3 grid, int wave_size,
                          gpuStream_t stream);
FP_TARGET_NS_END
#endif

}  // namespace flashport::gpu
