// Backward around the main loop, CUDA side: the launches of the preprocessing, the dq conversion
// and the sink gradient (kernels in bwd_aux_kernels.cuh, shared with HIP), and the planning/launch
// of the three steps (see bwd_launch.hpp).
#include <algorithm>
#include <cstdio>
#include <string>

#include "gpu/common/fwd_plan.hpp"
#include "gpu/mma/bwd_aux_kernels.cuh"
#include "gpu/mma/bwd_launch.hpp"

namespace flashport::gpu {

gpuError_t launch_bwd_preprocess(const BwdArgs& a, gpuStream_t stream) {
  bwd_preprocess_kernel<<<bwd_aux_blocks(a), kAuxWarps * kWarpSize, 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_bwd_convert(const BwdArgs& a, gpuStream_t stream) {
  bwd_convert_kernel<<<bwd_aux_blocks(a), kAuxWarps * kWarpSize, 0, stream>>>(a);
  if (gpuError_t e = gpuGetLastError(); e != gpuSuccess) return e;
  if (a.d_sinks != nullptr && a.rules.sinks != nullptr) {
    bwd_sink_kernel<<<a.hq, kSinkThreads, 0, stream>>>(a);
    return gpuGetLastError();
  }
  return gpuSuccess;
}

gpuError_t launch_bwd_sink_grad(const BwdArgs& a, gpuStream_t stream) {
  if (a.d_sinks == nullptr || a.rules.sinks == nullptr) return gpuSuccess;
  bwd_sink_kernel<<<a.hq, kSinkThreads, 0, stream>>>(a);
  return gpuGetLastError();
}

// ---- planning ------------------------------------------------------------------------------
namespace {

BwdKernelInfo bwd_info(int tile, bool bf16, int dev) {
#define FP_CASE(t) \
  case t:          \
    return bf16 ? bwd_kernel_info<t, true>(dev) : bwd_kernel_info<t, false>(dev);
  switch (tile) { FP_CASE(kBwd64) FP_CASE(kBwd128) FP_CASE(kBwd256) }
#undef FP_CASE
  return BwdKernelInfo{gpuErrorInvalidDevice};
}

gpuError_t launch_bwd_tile(int tile, bool bf16, const BwdArgs& a, dim3 grid, gpuStream_t s) {
#define FP_CASE(t) \
  case t:          \
    return bf16 ? launch_bwd<t, true>(a, grid, s) : launch_bwd<t, false>(a, grid, s);
  switch (tile) { FP_CASE(kBwd64) FP_CASE(kBwd128) FP_CASE(kBwd256) }
#undef FP_CASE
  return gpuErrorInvalidDevice;
}

}  // namespace

Status plan_bwd_cuda(const BwdProblem& bp, int smem_optin, Plan* plan) {
  const Problem& p = bp.fwd;
  if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
  if (p.dtype != FP_F16 && p.dtype != FP_BF16)
    return unsupported(std::string("cuda backend: backward dtype ") +
                       (p.dtype == FP_F32 ? "float32" : "float64") + " not supported (float16, bfloat16)");
  if (!p.has_lse) return invalid("lse: required by the backward");
  if (const std::string why = bwd_shape_refusal(p); !why.empty()) return unsupported("cuda backend: " + why);
  const BwdLayout l = bwd_layout(bp);
  const BwdTile& C = kBwdTiles[l.tile];
  if (C.smem_bytes() > smem_optin)
    return unsupported(std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.smem_bytes()) +
                       " bytes of shared memory per block, device has " + std::to_string(smem_optin));
  const BwdKernelInfo ki = bwd_info(l.tile, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess)
    return unsupported(std::string("cuda backend: kernel ") + C.name + " is not usable on this device (built archs: " FLASHPORT_GPU_ARCHS "): " +
                       gpuGetErrorString(ki.status));
  if (const std::string why = bwd_grid_refusal(p, l.key_blocks); !why.empty())
    return unsupported("cuda backend: " + why);
  *plan = Plan{};
  std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:%s%s", C.name,
                p.dtype == FP_BF16 ? "bf16" : "fp16", bp.deterministic ? ":deterministic" : ":atomic-dq");
  plan->workspace_bytes = l.ws.total;
  plan->num_splits = 1;
  plan->kernel_id = kKernelMmaBwd;
  PlanArgs::set(plan, l.tile, 1);
  return Status::ok();
}

Status run_bwd_cuda(const BwdProblem& bp, const Plan& plan, void* workspace, gpuStream_t stream) {
  const Problem& p = bp.fwd;
  const BwdLayout l = bwd_layout(bp);
  if (l.ws.total != plan.workspace_bytes || plan.kernel_id != kKernelMmaBwd || PlanArgs::tile(plan) != l.tile)
    return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
  if (p.seq.batch == 0) return Status::ok();
  const BwdArgs a = bwd_launch_args(bp, l, workspace);

  if (gpuError_t e = launch_bwd_preprocess(a, stream); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: backward preprocess launch: ") + gpuGetErrorString(e)};
  if (l.key_blocks > 0 && p.hkv > 0) {
    const dim3 grid(unsigned(l.key_blocks), unsigned(p.hkv), unsigned(p.seq.batch));
    if (gpuError_t e = launch_bwd_tile(l.tile, a.bf16, a, grid, stream); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kBwdTiles[l.tile].name + " launch: " +
                                  gpuGetErrorString(e)};
  }
  if (gpuError_t e = launch_bwd_convert(a, stream); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: backward dq conversion launch: ") + gpuGetErrorString(e)};
  return Status::ok();
}

}  // namespace flashport::gpu
