// The HIP backend (AMD GPUs). Compile-verified and ISA-checked; it has never run on an AMD GPU.
// ONE planning function per op decides support (or the reason not) and the kernel; run_* launches
// exactly that plan on the caller's stream (no allocation, no device reads, no synchronisation).
//
// Host dispatch gates on the device's gcnArchName: a device whose gfx target is not among the
// built targets (FLASHPORT_GPU_ARCHS) is refused with that reason before any launch. What runs is
// the forward main loop shared with CUDA (fwd_kernel.cuh on the AMD tile-MMA layer, instances in
// fwd_amd.hip), planned by amd_plan.hpp; what needs kernels not built for HIP (the split-KV combine,
// the KV-cache append, the backward) is refused by name.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "amd_gate.hpp"
#include "amd_plan.hpp"
#include "core/backend.hpp"
#include "fwd_launch.hpp"

namespace flashport {
namespace gpu {
namespace {

constexpr int kMaxAmdDevices = 64;

// Device facts read once per device (attribute queries only).
struct AmdDevice {
  bool ok = false;
  int gfx = 0;        // gfx number of gcnArchName, hex digits as written (gfx942 -> 0x942)
  int wave_size = 0;  // the device's wavefront size
  int lds_per_block = 0;
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

  // Everything plan and run must agree on comes from amd_plan.hpp (tile row, packing, grid).
  Status plan_fwd(const Problem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_HIP) return unsupported("hip backend: tensors are not on a HIP device");
    if (const std::string why = amd_fwd_refusal(p); !why.empty()) return unsupported("hip backend: " + why);
    const AmdFwdLaunch l = amd_fwd_launch(p);
    if (const std::string why = amd_grid_refusal(l); !why.empty()) return unsupported("hip backend: " + why);
    const TileConfig& C = kTileConfigs[l.tile];
    AmdDevice dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, C.smem_bytes(), &dev));
    std::snprintf(plan->kernel, sizeof(plan->kernel), "hip:%s:%s:%s:%s%s", C.name,
                  p.dtype == FP_BF16 ? "bf16" : "fp16", unit_name(dev.gfx), dev.arch_name,
                  l.pack > 1 ? ":packgqa" : "");
    plan->workspace_bytes = 0;
    plan->num_splits = 1;  // num_splits 0 (auto) runs one split: no combine on AMD yet
    plan->kernel_id = l.tile * 2 + (p.dtype == FP_BF16 ? 1 : 0);
    return Status::ok();
  }

  Status run_fwd(const Problem& p, const Plan& plan, void*) const override {
    if (const std::string why = amd_fwd_refusal(p); !why.empty()) return unsupported("hip backend: " + why);
    const AmdFwdLaunch l = amd_fwd_launch(p);
    if (plan.num_splits != 1 || plan.workspace_bytes != 0 ||
        plan.kernel_id != l.tile * 2 + (p.dtype == FP_BF16 ? 1 : 0))
      return {FP_ERR_RUNTIME, "hip backend: plan does not match the call (re-select after changing it)"};
    AmdDevice dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, kTileConfigs[l.tile].smem_bytes(), &dev));
    DeviceGuard guard(p.device_index);
    if (l.m_blocks == 0 || l.batch == 0) return Status::ok();
    const FwdArgs a = amd_fwd_args(p, l);
    const dim3 grid(unsigned(l.m_blocks), unsigned(l.heads_grid), unsigned(l.batch));
    if (gpuError_t e = launch_fwd_amd(l.tile, p.dtype == FP_BF16, a, grid, dev.wave_size,
                                      static_cast<gpuStream_t>(p.raw->stream));
        e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("hip backend: ") + plan.kernel + " launch: " + gpuGetErrorString(e)};
    return Status::ok();
  }

  Status plan_bwd(const BwdProblem&, Plan*) const override {
    return unsupported("hip backend: backward not implemented");
  }
  Status run_bwd(const BwdProblem&, const Plan&, void*) const override {
    return unsupported("hip backend: backward not implemented");
  }
  Status plan_merge(const MergeProblem&, Plan*) const override {
    return unsupported("hip backend: merge is not ported to AMD yet");
  }
  Status run_merge(const MergeProblem&, const Plan&) const override {
    return unsupported("hip backend: merge is not ported to AMD yet");
  }
  Status run_merge_bwd(const MergeBwdProblem&, const Plan&) const override {
    return unsupported("hip backend: merge backward not implemented");
  }
};

}  // namespace
}  // namespace gpu

const Backend* hip_backend() {
  static const gpu::HipBackend backend;
  return &backend;
}

}  // namespace flashport
