// The CUDA backend: ONE planning function per op decides support (or the reason not), the
// kernel, the workspace and the split count; run_* launches exactly that plan on the caller's
// stream. No allocation, no device reads, no synchronisation inside a call.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "core/backend.hpp"
#include "core/heuristics.hpp"
#include "gpu/common/driver_entry.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/hopper/bwd_hopper.hpp"
#include "gpu/mma/bwd_launch.hpp"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/mma/fwd_launch.hpp"
#include "gpu/mma/decode_plan.hpp"
#include "gpu/common/probs_kernel.hpp"
#include "gpu/f32/f32_launch.hpp"

namespace flashport {
namespace gpu {
namespace {

constexpr int kMaxDevicesHost = 64;

// Device facts read once per device (attribute queries only: legal during graph capture).
struct DeviceInfo {
  bool ok = false;
  int sm_count = 0;
  int arch = 0;  // 10 * major + minor, times 10 (FP_ARCH spelling: 800, 860, 900)
  int smem_optin = 0;
};

const DeviceInfo& device_info(int dev) {
  static DeviceInfo cache[kMaxDevicesHost];
  static std::atomic<bool> ready[kMaxDevicesHost];
  static DeviceInfo none;
  if (dev < 0 || dev >= kMaxDevicesHost) return none;
  if (!ready[dev].load(std::memory_order_acquire)) {
    DeviceInfo d;
    int major = 0, minor = 0;
    d.ok = gpuDeviceGetAttribute(&d.sm_count, gpuDevAttrMultiProcessorCount, dev) == gpuSuccess &&
           gpuDeviceGetAttribute(&major, gpuDevAttrComputeCapabilityMajor, dev) == gpuSuccess &&
           gpuDeviceGetAttribute(&minor, gpuDevAttrComputeCapabilityMinor, dev) == gpuSuccess &&
           gpuDeviceGetAttribute(&d.smem_optin, gpuDevAttrMaxSharedMemoryPerBlockOptin, dev) ==
               gpuSuccess;
    d.arch = (major * 10 + minor) * 10;
    gpuGetLastError();
    cache[dev] = d;
    ready[dev].store(true, std::memory_order_release);
  }
  return cache[dev];
}

// The SMs a launch on `stream` may use: the SM count of the stream's green context (a green
// context confines its launches to a partition of the device; CUDA 12.5+ drivers), else the
// device's. Asked only where a plan needs blocks resident together (the deterministic backward's
// rotated walk): two driver queries on that path, none elsewhere.
int launch_sm_count(gpuStream_t stream, int device_sms) {
  struct Fns {
    PFN_cuStreamGetCtx_v12050 stream_ctx = nullptr;
    PFN_cuGreenCtxGetDevResource_v12040 green_resource = nullptr;
  };
  static const Fns fns = {
      reinterpret_cast<PFN_cuStreamGetCtx_v12050>(driver_entry_point("cuStreamGetCtx", 12050)),
      reinterpret_cast<PFN_cuGreenCtxGetDevResource_v12040>(driver_entry_point("cuGreenCtxGetDevResource", 12040))};
  if (fns.stream_ctx == nullptr || fns.green_resource == nullptr) return device_sms;  // no green contexts
  CUcontext ctx = nullptr;
  CUgreenCtx green = nullptr;
  if (fns.stream_ctx(reinterpret_cast<CUstream>(stream), &ctx, &green) != CUDA_SUCCESS || green == nullptr)
    return device_sms;
  CUdevResource sms{};
  if (fns.green_resource(green, &sms, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS) return 0;  // unknown: nothing fits
  return static_cast<int>(sms.sm.smCount);
}

// Makes `dev` current for the scope (kernels launch on the current device) and restores it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != dev) {
      if (cudaSetDevice(dev) == cudaSuccess) restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool restore_ = false;
};

KernelInfo kernel_info(int tile, bool bf16, int dev) {
#define FP_CASE(t)                                                           \
  case t:                                                                    \
    return bf16 ? fwd_kernel_info<t, true>(dev) : fwd_kernel_info<t, false>(dev);
  switch (tile) {
    FP_CASE(kPrefill64) FP_CASE(kPrefill128) FP_CASE(kPrefill256)
    FP_CASE(kDecode64) FP_CASE(kDecode128) FP_CASE(kDecode256)
  }
#undef FP_CASE
  return KernelInfo{gpuErrorInvalidDevice};
}

gpuError_t launch_tile(int tile, bool bf16, const FwdArgs& a, dim3 grid, gpuStream_t s) {
#define FP_CASE(t)                                                           \
  case t:                                                                    \
    return bf16 ? launch_fwd<t, true>(a, grid, s) : launch_fwd<t, false>(a, grid, s);
  switch (tile) {
    FP_CASE(kPrefill64) FP_CASE(kPrefill128) FP_CASE(kPrefill256)
    FP_CASE(kDecode64) FP_CASE(kDecode128) FP_CASE(kDecode256)
  }
#undef FP_CASE
  return gpuErrorInvalidDevice;
}

// The mma.sync candidate (mma/fwd_kernel.cuh): the tile row of the call's shape (decode tile when
// the packed query rows fit one of its blocks), the GQA pack, and the split count from the same
// heuristic over its work tiles, key blocks and occupancy (SMs x resident blocks). Empty string:
// it runs the call; else why not.
struct MmaFwdChoice {
  int tile = 0, pack = 1, splits = 1;
};

std::string mma_fwd_candidate(const Problem& p, const DeviceInfo& dev, MmaFwdChoice* out) {
  MmaFwdChoice c;
  const int64_t dmax = std::max(p.d, p.dv);
  c.pack = gqa_pack(p);
  const bool decode = p.seq.sq * c.pack <= kTileConfigs[tile_id_for(dmax, true)].block_m;
  c.tile = tile_id_for(dmax, decode);
  const TileConfig& C = kTileConfigs[c.tile];
  const KernelInfo ki = kernel_info(c.tile, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess)
    return std::string("cuda backend: kernel ") + C.name + " has no image for sm_" + std::to_string(dev.arch / 10) +
           " (built archs: " FLASHPORT_GPU_ARCHS "): " + gpuGetErrorString(ki.status);
  if (C.smem_bytes() > dev.smem_optin)
    return std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.smem_bytes()) +
           " bytes of shared memory per block, device has " + std::to_string(dev.smem_optin);
  const int64_t m_blocks = (p.seq.sq * c.pack + C.block_m - 1) / C.block_m;
  const int64_t heads_grid = c.pack > 1 ? p.hkv : p.hq;
  const int64_t work_tiles = m_blocks * heads_grid * p.seq.batch;
  const int64_t key_blocks = std::max<int64_t>(1, (max_kv_rows(p) + C.block_n - 1) / C.block_n);
  const int64_t slots = int64_t(dev.sm_count) * std::max(1, ki.blocks_per_sm);
  c.splits = resolve_num_splits(p.num_splits, work_tiles, key_blocks, slots, kMaxSplits, c.tile >= kDecode64);
  if (m_blocks > 0x7fffffff || heads_grid > 65535 || p.seq.batch * c.splits > 65535)
    return "cuda backend: grid too large (batch * splits <= 65535, heads <= 65535)";
  *out = c;
  return std::string();
}

// The decode kernel candidate (mma/decode_kernel.cuh; rules in mma/decode_plan.hpp): calls whose
// packed query rows fit its 16-row tile, head dims 72..128; the split count over its occupancy
// (SMs x resident blocks). Empty string: it runs the call; else why not.
struct DecodeChoice {
  int pack = 1, splits = 1;
};

std::string decode_fwd_candidate(const Problem& p, const DeviceInfo& dev, DecodeChoice* out) {
  if (std::string why = decode_kernel_decline(p); !why.empty()) return why;
  const KernelInfo ki =
      p.dtype == FP_BF16 ? decode_kernel_info<true>(p.device_index) : decode_kernel_info<false>(p.device_index);
  if (ki.status != gpuSuccess)
    return std::string("decode kernel: no image for sm_") + std::to_string(dev.arch / 10) +
           " (built archs: " FLASHPORT_GPU_ARCHS "): " + gpuGetErrorString(ki.status);
  if (kDecodeTile.smem_bytes() > dev.smem_optin || ki.blocks_per_sm < 1)
    return std::string("decode kernel: needs ") + std::to_string(kDecodeTile.smem_bytes()) +
           " bytes of shared memory per block, device has " + std::to_string(dev.smem_optin);
  out->pack = decode_kernel_shape(p).pack;
  out->splits = decode_kernel_splits(p, int64_t(dev.sm_count) * ki.blocks_per_sm);
  return std::string();
}

// The launch grid of a decided mma.sync plan: (row blocks, heads or kv heads when packed,
// batch x splits).
dim3 mma_fwd_grid(const Problem& p, int tile, int pack, int splits) {
  const TileConfig& C = kTileConfigs[tile];
  return dim3(unsigned((p.seq.sq * pack + C.block_m - 1) / C.block_m), unsigned(pack > 1 ? p.hkv : p.hq),
              unsigned(p.seq.batch * splits));
}

class CudaBackend final : public Backend {
 public:
  fp_backend id() const override { return FP_BACKEND_CUDA; }
  bool available() const override {
    int n = 0;
    const bool ok = gpuGetDeviceCount(&n) == gpuSuccess && n > 0;
    gpuGetLastError();
    return ok;
  }
  bool handles_device(fp_device_type dev) const override { return dev == FP_DEVICE_CUDA; }

  Status check_device(int device_index, DeviceInfo* out) const {
    const DeviceInfo& dev = device_info(device_index);
    if (!dev.ok)
      return unsupported("cuda backend: device " + std::to_string(device_index) + " is not usable");
    if (dev.arch < kMinNvidiaArch)
      return unsupported("cuda backend: device sm_" + std::to_string(dev.arch / 10) +
                         " is below sm_80 (mma.sync bf16, cp.async); built archs: " FLASHPORT_GPU_ARCHS);
    *out = dev;
    return Status::ok();
  }

  Status plan_fwd(const Problem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    if (p.dtype != FP_F16 && p.dtype != FP_BF16 && p.dtype != FP_F32)
      return unsupported("cuda backend: dtype float64 not supported (float16, bfloat16, float32)");
    if (p.has_lse && p.lse_dtype != FP_F32) return unsupported("cuda backend: lse must be float32");
    if (p.d > 256 || p.dv > 256) return unsupported("cuda backend: head dim > 256");
    if (p.rotary_dim > 0 && p.rotary_dtype != FP_F32 && p.rotary_dtype != p.dtype)
      return unsupported("cuda backend: rotary_cos/sin must be float32 or q's dtype");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, &dev));
    if (p.dtype == FP_F32) {
      // float32: the fp32 kernel (f32/: 3xTF32 mma.sync products), the one candidate of this dtype.
      F32FwdChoice c;
      if (std::string why = f32_fwd_candidate(p, dev.sm_count, dev.smem_optin, &c); !why.empty())
        return unsupported(why);
      std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:fp32%s%s%s", kF32FwdTiles[c.tile].name,
                    c.pack > 1 ? ":packgqa" : "", c.splits > 1 ? ":splitkv+combine" : "",
                    p.seq.snew > 0 ? (p.rotary_dim > 0 ? ":append+rotary" : ":append") : "");
      plan->workspace_bytes = fwd_workspace(p, c.splits).total;
      plan->num_splits = c.splits;
      plan->kernel_id = kKernelF32Fwd;
      PlanArgs::set(plan, c.tile, c.pack);
      return Status::ok();
    }
    // Peer candidates, fastest first: the sm_90a kernel, then the mma.sync kernel.
    int hopper_splits = 1;
    HopperGrid hgrid;
    const std::string hopper_why =
        hopper_fwd_candidate(p, dev.arch, dev.sm_count, dev.smem_optin, &hopper_splits, &hgrid);
    if (hopper_why.empty()) {
      hopper_kernel_name(plan->kernel, sizeof(plan->kernel), p, hopper_splits);
      // 0 bytes without a split, rotary or the dynamic walk's counter.
      plan->workspace_bytes = fwd_workspace(p, hopper_splits, hgrid.dynamic).total;
      plan->num_splits = hopper_splits;
      plan->kernel_id = kKernelHopperFwd;
      PlanArgs::set(plan, 0, 1, hgrid.blocks, hgrid.dynamic);
      return Status::ok();
    }
    DecodeChoice dc;
    const std::string decode_why = decode_fwd_candidate(p, dev, &dc);
    if (decode_why.empty()) {
      std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:%s%s%s%s", kDecodeTile.name,
                    p.dtype == FP_BF16 ? "bf16" : "fp16", dc.pack > 1 ? ":packgqa" : "",
                    dc.splits > 1 ? ":splitkv+combine_in_kernel" : "",
                    p.seq.snew > 0 ? (p.rotary_dim > 0 ? ":append+rotary" : ":append") : "");
      plan->workspace_bytes = decode_kernel_workspace_bytes(decode_kernel_workspace(p, dc.splits));
      plan->num_splits = dc.splits;
      plan->kernel_id = kKernelDecodeFwd;
      PlanArgs::set(plan, 0, dc.pack);
      return Status::ok();
    }
    if (dev.arch == 900) std::snprintf(plan->passed_over, sizeof(plan->passed_over), "%s", hopper_why.c_str());
    MmaFwdChoice c;
    if (std::string why = mma_fwd_candidate(p, dev, &c); !why.empty()) return unsupported(why);
    // A decode-shaped call the decode kernel declined: its reason is the one worth logging.
    if (c.tile >= kDecode64) std::snprintf(plan->passed_over, sizeof(plan->passed_over), "%s", decode_why.c_str());
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:%s%s%s%s", kTileConfigs[c.tile].name,
                  p.dtype == FP_BF16 ? "bf16" : "fp16", c.pack > 1 ? ":packgqa" : "",
                  c.splits > 1 ? ":splitkv+combine" : "",
                  p.seq.snew > 0 ? (p.rotary_dim > 0 ? ":append+rotary" : ":append") : "");
    plan->workspace_bytes = fwd_workspace(p, c.splits).total;
    plan->num_splits = c.splits;
    plan->kernel_id = kKernelMmaFwd;
    PlanArgs::set(plan, c.tile, c.pack);
    return Status::ok();
  }

  // Launches the plan's decision (kernel, tile, pack, splits): nothing is decided again here.
  Status run_fwd(const Problem& p, const Plan& plan, void* caller_workspace) const override {
    const int splits = plan.num_splits, tile = PlanArgs::tile(plan), pack = PlanArgs::pack(plan);
    const bool hopper = plan.kernel_id == kKernelHopperFwd, f32 = plan.kernel_id == kKernelF32Fwd;
    const bool decode = plan.kernel_id == kKernelDecodeFwd;
    if ((!hopper && !f32 && !decode && plan.kernel_id != kKernelMmaFwd) || splits < 1 || splits > kMaxSplits ||
        tile < 0 || tile >= (f32 ? int(kNumF32FwdTiles) : int(kNumTileIds)))
      return {FP_ERR_RUNTIME, "cuda backend: the plan is not a CUDA forward plan"};
    const FwdWorkspace w = decode ? decode_kernel_workspace(p, splits)
                                  : fwd_workspace(p, splits, hopper && PlanArgs::tile_counter(plan));
    // The decode kernel's layout starts at the caller's first 16-byte boundary (float4 partials).
    void* workspace = decode ? decode_kernel_workspace_base(caller_workspace) : caller_workspace;
    if ((decode ? decode_kernel_workspace_bytes(w) : w.total) != plan.workspace_bytes ||
        (f32 && !f32_tile_serves(kF32FwdTiles[tile], std::max(p.d, p.dv))))
      return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
    DeviceGuard guard(p.device_index);
    auto stream = static_cast<gpuStream_t>(p.raw->stream);
    const bool bf16 = p.dtype == FP_BF16;
    if (p.seq.snew > 0 || p.rotary_dim > 0) {
      const AppendArgs ap = append_args_in(p, w, workspace);
      if (gpuError_t e = f32 ? launch_append_f32(ap, stream) : launch_append(ap, bf16, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: append/rotary launch: ") + gpuGetErrorString(e)};
    }
    FwdArgs a = fwd_args_in(p, w, pack, splits, workspace);
    // The split counters' and the tile walk's nonce (fixed in a captured graph).
    if ((decode && w.split_counters > 0) || (hopper && w.has_tile_counter)) a.call_nonce = next_call_nonce();
    if (f32) {
      const dim3 grid = f32_fwd_grid(p, tile, pack, splits, &a.query_blocks_outer);
      if (grid.x > 0 && grid.y > 0 && grid.z > 0) {
        if (gpuError_t e = launch_f32_fwd(tile, a, grid, stream); e != gpuSuccess)
          return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kF32FwdTiles[tile].name +
                                      " launch: " + gpuGetErrorString(e)};
      }
    } else if (hopper) {
#if defined(FLASHPORT_WITH_HOPPER_FWD)
      NonceCounter* walk =
          w.has_tile_counter ? reinterpret_cast<NonceCounter*>(static_cast<char*>(workspace) + w.tile_counter_offset)
                             : nullptr;
      if (const gpuError_t e = hopper_launch(p, a, PlanArgs::grid(plan), walk, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: sm90 wgmma prefill launch: ") + gpuGetErrorString(e)};
#else
      return {FP_ERR_RUNTIME, "cuda backend: plan names the Hopper kernel, which is not built"};
#endif
    } else if (decode) {
      const dim3 grid(unsigned(splits), unsigned(decode_kernel_shape(p).heads), unsigned(p.seq.batch));
      if (p.seq.batch > 0 && grid.y > 0) {
        if (gpuError_t e = bf16 ? launch_decode<true>(a, grid, stream) : launch_decode<false>(a, grid, stream);
            e != gpuSuccess)
          return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kDecodeTile.name + " launch: " + gpuGetErrorString(e)};
      }
    } else {
      const dim3 grid = mma_fwd_grid(p, tile, pack, splits);
      if (grid.x > 0 && p.seq.batch > 0) {
        if (gpuError_t e = launch_tile(tile, bf16, a, grid, stream); e != gpuSuccess)
          return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kTileConfigs[tile].name +
                                      " launch: " + gpuGetErrorString(e)};
      }
    }
    if (splits > 1 && !decode) {
      if (gpuError_t e = launch_merge(split_combine_args_in(p, a), stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: split-KV combine launch: ") + gpuGetErrorString(e)};
    }
    return Status::ok();
  }

  Status plan_bwd(const BwdProblem& p, Plan* plan) const override {
    if (p.fwd.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.fwd.device_index, &dev));
    // float32: the fp32 backward (f32/bwd_f32.cu, 3xTF32), the one candidate of this dtype.
    if (p.fwd.dtype == FP_F32) return plan_bwd_f32(p, dev.smem_optin, plan);
    if (p.fwd.dtype == FP_F64)
      return unsupported("cuda backend: backward dtype float64 not supported (float16, bfloat16, float32)");
    // Peer candidates, fastest first: the sm_90a backward (bwd_hopper.cu), then the mma.sync
    // backward (bwd_aux.cu), whose checks give the reason when neither runs the call.
#if defined(FLASHPORT_WITH_HOPPER_BWD)
    const std::string hopper_why = hopper_bwd_check(p, dev.arch, dev.smem_optin);
    if (hopper_why.empty()) {
      // Deterministic mode's rotated walk needs a head's key blocks resident together: the wave of
      // the caller's stream (its SMs x blocks per SM); the default mode asks nothing.
      int64_t wave_slots = 0;
      if (p.deterministic) {
        const BwdKernelInfo ki = hopper_bwd_info_for(hopper_bwd_head_bucket(p.fwd), p.fwd.dtype == FP_BF16,
                                                     p.fwd.device_index);
        wave_slots = int64_t(launch_sm_count(static_cast<gpuStream_t>(p.fwd.raw->stream), dev.sm_count)) *
                     ki.blocks_per_sm;
      }
      if (hopper_bwd_plan(p, wave_slots, plan)) return Status::ok();
    }
    const Status st = plan_bwd_cuda(p, dev.smem_optin, plan);
    if (st.is_ok() && dev.arch == 900)
      std::snprintf(plan->passed_over, sizeof(plan->passed_over), "%s", hopper_why.c_str());
    return st;
#else
    return plan_bwd_cuda(p, dev.smem_optin, plan);
#endif
  }
  Status run_bwd(const BwdProblem& p, const Plan& plan, void* workspace) const override {
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.fwd.device_index, &dev));
    DeviceGuard guard(p.fwd.device_index);
    if (plan.kernel_id == kKernelF32Bwd)
      return run_bwd_f32(p, plan, workspace, static_cast<gpuStream_t>(p.fwd.raw->stream));
#if defined(FLASHPORT_WITH_HOPPER_BWD)
    if (plan.kernel_id == kKernelHopperBwd) {
      return run_bwd_hopper(p, plan, workspace, static_cast<gpuStream_t>(p.fwd.raw->stream));
    }
#endif
    return run_bwd_cuda(p, plan, workspace, static_cast<gpuStream_t>(p.fwd.raw->stream));
  }

  // fp_attn_probs: one element-wise kernel (probs_kernel.cu), no workspace.
  Status plan_probs(const ProbsProblem& pp, Plan* plan) const override {
    const Problem& p = pp.fwd;
    if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    if (p.dtype != FP_F16 && p.dtype != FP_BF16 && p.dtype != FP_F32)
      return unsupported("cuda backend: probs of float16/bfloat16/float32 calls only");
    if (p.lse_dtype != FP_F32) return unsupported("cuda backend: lse must be float32");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, &dev));
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:probs:%s",
                  p.dtype == FP_BF16 ? "bf16" : (p.dtype == FP_F32 ? "fp32" : "fp16"));
    return Status::ok();
  }
  Status run_probs(const ProbsProblem& pp, const Plan&) const override {
    DeviceGuard guard(pp.fwd.device_index);
    if (gpuError_t e = launch_probs(probs_args(pp), static_cast<gpuStream_t>(pp.fwd.raw->stream)); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: probs launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }

  Status plan_merge(const MergeProblem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    auto ok_part = [](fp_dtype t) { return t == FP_F32 || t == FP_F16 || t == FP_BF16; };
    if (!ok_part(p.part_dtype) || !ok_part(p.out_dtype))
      return unsupported("cuda backend: merge supports float32/float16/bfloat16 partials and output");
    if (p.lse_dtype != FP_F32) return unsupported("cuda backend: merge lse must be float32");
    if (p.raw != nullptr) {
      DeviceInfo dev;
      FP_RETURN_IF_ERROR(check_device(p.raw->out.device_index, &dev));
    }
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:merge");
    plan->kernel_id = kKernelMerge;
    plan->workspace_bytes = 0;
    plan->num_splits = static_cast<int32_t>(p.splits);
    return Status::ok();
  }

  Status run_merge(const MergeProblem& p, const Plan&) const override {
    DeviceGuard guard(p.raw->out.device_index);
    if (gpuError_t e = launch_merge(merge_args(p), static_cast<gpuStream_t>(p.raw->stream)); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: merge launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }
  Status run_merge_bwd(const MergeBwdProblem& mb, const Plan&) const override {
    const MergeProblem& p = mb.fwd;
    if (!p.has_lse || p.raw->lse.data == nullptr)
      return unsupported("cuda backend: merge backward needs the forward lse");
    DeviceGuard guard(p.raw->out.device_index);
    if (gpuError_t e = launch_merge_bwd(merge_bwd_args(mb), static_cast<gpuStream_t>(p.raw->stream)); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: merge backward launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }
};

}  // namespace
}  // namespace gpu

const Backend* cuda_backend() {
  static const gpu::CudaBackend backend;
  return &backend;
}

}  // namespace flashport
