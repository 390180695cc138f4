// The HIP backend (AMD GPUs). Compile-verified and ISA-checked; it has never run on an AMD GPU.
// ONE planning function per op decides support (or the reason not) and the kernel; run_* launches
// exactly that plan on the caller's stream (no allocation, no device reads, no synchronisation).
//
// Host dispatch gates on the device's gcnArchName: a device whose gfx target is not among the
// built targets (FLASHPORT_GPU_ARCHS) is refused with that reason before any launch. What runs is
// the forward main loop shared with CUDA (fwd_kernel.cuh on the AMD tile-MMA layer, instances in
// fwd_amd.hip) with split-KV over key ranges, and the aux kernels shared with CUDA (aux_kernels.cu:
// the split-KV combine, which is also the public merge op and its backward, and the KV-cache append
// + rotary), all planned by amd_plan.hpp; and the attention backward shared with CUDA
// (bwd_kernel.cuh on the AMD tile layer + bwd_aux_kernels.cuh, instances in bwd_amd.hip): preprocess,
// main loop (atomic or deterministic dQ), dq conversion and sink gradient.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "gpu/amd/amd_gate.hpp"
#include "gpu/amd/amd_plan.hpp"
#include "core/backend.hpp"
#include "gpu/mma/bwd_launch.hpp"
#include "gpu/mma/fwd_launch.hpp"

namespace flashport {
namespace gpu {
FP_TARGET_NS_BEGIN
// aux_kernels.cu's HIP launches: warps of the device's wave size.
gpuError_t launch_merge_amd(const MergeArgs& a, int wave_size, gpuStream_t stream);
gpuError_t launch_merge_bwd_amd(const MergeBwdArgs& a, int wave_size, gpuStream_t stream);
gpuError_t launch_append_amd(const AppendArgs& a, bool bf16, int wave_size, gpuStream_t stream);
FP_TARGET_NS_END

namespace {

constexpr int kMaxAmdDevices = 64;

// Device facts read once per device (attribute queries only).
struct AmdDevice {
  bool ok = false;
  int gfx = 0;        // gfx number of gcnArchName, hex digits as written (gfx942 -> 0x942)
  int wave_size = 0;  // the device's wavefront size
  int lds_per_block = 0;
  int compute_units = 0;  // the split-KV heuristic's wave
  char arch_name[64] = {0};
};

const AmdDevice& amd_device(int dev) {
  static AmdDevice cache[kMaxAmdDevices];
  static std::atomic<bool> ready[kMaxAmdDevices];
  static AmdDevice none;
  if (dev < 0 || dev >= kMaxAmdDevices) return none;
  if (!ready[dev].load(std::memory_order_acquire)) {
    AmdDevice d;
    hipDeviceProp_t prop;
    if (hipGetDeviceProperties(&prop, dev) == hipSuccess) {
      d.ok = true;
      std::snprintf(d.arch_name, sizeof(d.arch_name), "%s", prop.gcnArchName);
      d.gfx = amd::gfx_number(prop.gcnArchName);
      d.wave_size = prop.warpSize;
      d.lds_per_block = static_cast<int>(prop.sharedMemPerBlock);
      d.compute_units = prop.multiProcessorCount;
    }
    (void)gpuGetLastError();
    cache[dev] = d;
    ready[dev].store(true, std::memory_order_release);
  }
  return cache[dev];
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    if (hipGetDevice(&prev_) == hipSuccess && prev_ != dev && hipSetDevice(dev) == hipSuccess) restore_ = true;
  }
  ~DeviceGuard() {
    if (restore_) (void)hipSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool restore_ = false;
};

const char* unit_name(int gfx) {
  switch (amd::matrix_unit(gfx)) {
    case amd::MatrixUnit::kMfma: return "mfma";
    case amd::MatrixUnit::kWmmaGfx11:
    case amd::MatrixUnit::kWmmaGfx12: return "wmma";
    default: return "plain";
  }
}


class HipBackend final : public Backend {
 public:
  fp_backend id() const override { return FP_BACKEND_HIP; }
  bool available() const override {
    int n = 0;
    const bool ok = hipGetDeviceCount(&n) == hipSuccess && n > 0;
    (void)gpuGetLastError();
    return ok;
  }
  bool handles_device(fp_device_type dev) const override { return dev == FP_DEVICE_HIP; }

  // The gate: the device's gfx target must be one this library was built for, with the wave
  // size its code objects were compiled for, and LDS for the tile (amd_gate.hpp).
  Status check_device(int index, int kernel_lds, AmdDevice* out) const {
    const AmdDevice& d = amd_device(index);
    if (!d.ok) return unsupported("hip backend: device " + std::to_string(index) + " is not usable");
    const std::string why =
        amd::device_refusal(d.arch_name, d.wave_size, d.lds_per_block, kernel_lds, FLASHPORT_GPU_ARCHS);
    if (!why.empty()) return unsupported("hip backend: device " + std::to_string(index) + ": " + why);
    *out = d;
    return Status::ok();
  }

  // Everything plan and run must agree on comes from amd_plan.hpp (tile row, packing, splits,
  // workspace, grid); run_fwd launches the plan's decision.
  Status decide_fwd(const Problem& p, AmdFwdLaunch* l, AmdDevice* dev) const {
    if (const std::string why = amd_fwd_refusal(p); !why.empty()) return unsupported("hip backend: " + why);
    const AmdDevice& d = amd_device(p.device_index);
    *l = amd_fwd_launch(p, d.ok ? d.compute_units : 0);
    if (const std::string why = amd_grid_refusal(*l); !why.empty()) return unsupported("hip backend: " + why);
    return check_device(p.device_index, kTileConfigs[l->tile].smem_bytes(), dev);
  }

  Status plan_fwd(const Problem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_HIP) return unsupported("hip backend: tensors are not on a HIP device");
    AmdFwdLaunch l;
    AmdDevice dev;
    FP_RETURN_IF_ERROR(decide_fwd(p, &l, &dev));
    const TileConfig& C = kTileConfigs[l.tile];
    std::snprintf(plan->kernel, sizeof(plan->kernel), "hip:%s:%s:%s:%s%s%s%s", C.name,
                  p.dtype == FP_BF16 ? "bf16" : "fp16", unit_name(dev.gfx), dev.arch_name,
                  l.pack > 1 ? ":packgqa" : "", l.splits > 1 ? ":splitkv+combine" : "",
                  l.append ? (l.rotary_q ? ":append+rotary" : ":append") : (l.rotary_q ? ":rotary" : ""));
    plan->workspace_bytes = l.ws_bytes;
    plan->num_splits = l.splits;
    plan->kernel_id = kKernelMmaFwd;
    PlanArgs::set(plan, l.tile, l.pack);
    return Status::ok();
  }

  Status run_fwd(const Problem& p, const Plan& plan, void* workspace) const override {
    // The plan's decision (tile, pack, splits), not a new one; the device gate is cached.
    const int tile = PlanArgs::tile(plan);
    if (plan.kernel_id != kKernelMmaFwd || tile < 0 || tile >= kNumTileIds || plan.num_splits < 1)
      return {FP_ERR_RUNTIME, "hip backend: the plan is not a HIP forward plan"};
    const AmdFwdLaunch l = amd_fwd_shape(p, static_cast<TileId>(tile), PlanArgs::pack(plan), plan.num_splits);
    if (plan.workspace_bytes != l.ws_bytes)
      return {FP_ERR_RUNTIME, "hip backend: plan does not match the call (re-select after changing it)"};
    AmdDevice dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, kTileConfigs[l.tile].smem_bytes(), &dev));
    DeviceGuard guard(p.device_index);
    const auto stream = static_cast<gpuStream_t>(p.raw->stream);
    const bool bf16 = p.dtype == FP_BF16;
    // In stream order: cache append (+ rotated q), the main loop, the split combine.
    if (l.append || l.rotary_q) {
      if (gpuError_t e = launch_append_amd(amd_append_args(p, l, workspace), bf16, dev.wave_size, stream);
          e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("hip backend: append/rotary launch: ") + gpuGetErrorString(e)};
    }
    if (l.m_blocks > 0 && l.batch > 0) {
      const FwdArgs a = amd_fwd_args(p, l, workspace);
      const dim3 grid(unsigned(l.m_blocks), unsigned(l.heads_grid), unsigned(l.batch * l.splits));
      if (gpuError_t e = launch_fwd_amd(l.tile, bf16, a, grid, dev.wave_size, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("hip backend: ") + plan.kernel + " launch: " + gpuGetErrorString(e)};
    }
    if (l.splits > 1) {
      if (gpuError_t e = launch_merge_amd(amd_combine_args(p, l, workspace), dev.wave_size, stream);
          e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("hip backend: split-KV combine launch: ") + gpuGetErrorString(e)};
    }
    return Status::ok();
  }

  // The backward: the CUDA plan's layout and arguments on the AMD rows (amd_plan.hpp).
  Status decide_bwd(const BwdProblem& bp, BwdLayout* l, AmdDevice* dev) const {
    if (const std::string why = amd_bwd_refusal(bp); !why.empty()) return unsupported("hip backend: " + why);
    *l = bwd_layout(bp);
    return check_device(bp.fwd.device_index, kBwdTiles[l->tile].smem_bytes(), dev);
  }

  Status plan_bwd(const BwdProblem& bp, Plan* plan) const override {
    if (bp.fwd.device != FP_DEVICE_HIP) return unsupported("hip backend: tensors are not on a HIP device");
    BwdLayout l;
    AmdDevice dev;
    FP_RETURN_IF_ERROR(decide_bwd(bp, &l, &dev));
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "%s",
                  amd_bwd_plan_name(bp, l, unit_name(dev.gfx), dev.arch_name).c_str());
    plan->workspace_bytes = l.ws.total;
    plan->num_splits = 1;
    plan->kernel_id = kKernelMmaBwd;
    PlanArgs::set(plan, l.tile, 1);
    return Status::ok();
  }

  Status run_bwd(const BwdProblem& bp, const Plan& plan, void* workspace) const override {
    const BwdLayout l = bwd_layout(bp);
    if (plan.kernel_id != kKernelMmaBwd || PlanArgs::tile(plan) != l.tile || plan.workspace_bytes != l.ws.total)
      return {FP_ERR_RUNTIME, "hip backend: plan does not match the call (re-select after changing it)"};
    AmdDevice dev;
    FP_RETURN_IF_ERROR(check_device(bp.fwd.device_index, kBwdTiles[l.tile].smem_bytes(), &dev));
    if (bp.fwd.seq.batch == 0) return Status::ok();
    DeviceGuard guard(bp.fwd.device_index);
    const auto stream = static_cast<gpuStream_t>(bp.fwd.raw->stream);
    const BwdArgs a = bwd_launch_args(bp, l, workspace);
    // In stream order: preprocess (D, lse2, zeroed dq accumulator and semaphores), main loop,
    // dq conversion (+ sink gradient).
    if (gpuError_t e = launch_bwd_preprocess_amd(a, dev.wave_size, stream); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("hip backend: backward preprocess launch: ") + gpuGetErrorString(e)};
    const AmdBwdGrid g = amd_bwd_grid(bp, l);
    if (g.x > 0 && g.y > 0) {
      if (gpuError_t e = launch_bwd_amd(l.tile, a.bf16, a, dim3(g.x, g.y, g.z), dev.wave_size, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("hip backend: ") + plan.kernel + " launch: " + gpuGetErrorString(e)};
    }
    if (gpuError_t e = launch_bwd_convert_amd(a, dev.wave_size, stream); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("hip backend: backward dq conversion launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }

  // The merge op: the aux merge kernel (no workspace). Its device gate needs no LDS.
  Status merge_device(const MergeProblem& p, AmdDevice* dev) const {
    if (const std::string why = amd_merge_refusal(p); !why.empty()) return unsupported("hip backend: " + why);
    return check_device(p.raw != nullptr ? p.raw->out.device_index : 0, 0, dev);
  }
  Status plan_merge(const MergeProblem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_HIP) return unsupported("hip backend: tensors are not on a HIP device");
    AmdDevice dev;
    FP_RETURN_IF_ERROR(merge_device(p, &dev));
    std::snprintf(plan->kernel, sizeof(plan->kernel), "hip:merge:%s", dev.arch_name);
    plan->workspace_bytes = 0;
    plan->num_splits = static_cast<int32_t>(p.splits);
    return Status::ok();
  }
  Status run_merge(const MergeProblem& p, const Plan&) const override {
    AmdDevice dev;
    FP_RETURN_IF_ERROR(merge_device(p, &dev));
    DeviceGuard guard(p.raw->out.device_index);
    if (gpuError_t e = launch_merge_amd(merge_args(p), dev.wave_size, static_cast<gpuStream_t>(p.raw->stream));
        e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("hip backend: merge launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }
  Status run_merge_bwd(const MergeBwdProblem& mb, const Plan&) const override {
    const MergeProblem& p = mb.fwd;
    if (!p.has_lse || p.raw->lse.data == nullptr) return unsupported("hip backend: merge backward needs the forward lse");
    AmdDevice dev;
    FP_RETURN_IF_ERROR(merge_device(p, &dev));
    DeviceGuard guard(p.raw->out.device_index);
    const MergeBwdArgs g = merge_bwd_args(mb);
    if (gpuError_t e = launch_merge_bwd_amd(g, dev.wave_size, static_cast<gpuStream_t>(p.raw->stream));
        e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("hip backend: merge backward launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }
};

}  // namespace
}  // namespace gpu

const Backend* hip_backend() {
  static const gpu::HipBackend backend;
  return &backend;
}

}  // namespace flashport
