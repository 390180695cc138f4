// The CUDA backend: ONE planning function per op decides support (or the reason not), the
// kernel, the workspace and the split count; run_* launches exactly that plan on the caller's
// stream. No allocation, no device reads, no synchronisation inside a call.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/backend.hpp"
#include "core/heuristics.hpp"
#include "gpu/hopper/bwd_hopper.hpp"
#include "gpu/mma/bwd_launch.hpp"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/mma/fwd_launch.hpp"
#include "gpu/common/probs_kernel.hpp"

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
#if defined(FLASHPORT_DECODE_EXPERIMENTS)
    FP_CASE(kDecodeExp0) FP_CASE(kDecodeExp1) FP_CASE(kDecodeExp2) FP_CASE(kDecodeExp3)
#endif
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
#if defined(FLASHPORT_DECODE_EXPERIMENTS)
    FP_CASE(kDecodeExp0) FP_CASE(kDecodeExp1) FP_CASE(kDecodeExp2) FP_CASE(kDecodeExp3)
#endif
  }
#undef FP_CASE
  return gpuErrorInvalidDevice;
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// How split-KV partials of decode tiles are merged: by the combine kernel (the public merge op)
// behind the main kernel, the default; or, with FLASHPORT_SPLIT_COMBINE=fused, in the main
// kernel's epilogue by each tile's last split block (counters zeroed by a memset before the
// launch). Fused measured 1.5-3.5 us slower per call on H200 (bench/results/gpu_notes.md).
enum class SplitCombine { Kernel, Fused, FusedNoMemset };
SplitCombine split_combine_mode() {
  const char* env = std::getenv("FLASHPORT_SPLIT_COMBINE");
  if (env != nullptr && std::strcmp(env, "fused") == 0) return SplitCombine::Fused;
#if defined(FLASHPORT_DECODE_EXPERIMENTS)
  // Experiments only, to time the memset: counters not zeroed (right only when the last call on
  // this workspace layout was fused and left them at 0).
  if (env != nullptr && std::strcmp(env, "fused-nomemset") == 0) return SplitCombine::FusedNoMemset;
#endif
  return SplitCombine::Kernel;
}

// Everything plan and run must agree on, derived from the problem alone.
struct Decision {
  int tile = 0;
  int pack = 1;
  int splits = 1;
  int64_t m_blocks = 0, heads_grid = 0, work_tiles = 0, key_blocks = 0;
  bool rotary_q = false;
  // Empty: the sm_90a wgmma kernel (fwd_hopper.hpp) runs the call, with `splits` its own count;
  // otherwise why not (the mma.sync kernel runs it).
  std::string hopper_reason;
  SplitCombine combine = SplitCombine::Kernel;  // set only when splits > 1
  // The main kernel's last split block merges the partials (no combine kernel).
  bool fused_combine() const { return combine != SplitCombine::Kernel; }
  size_t ws_q_bytes = 0, ws_o_offset = 0, ws_lse_offset = 0, ws_counters_offset = 0, ws_total = 0;
  int64_t ws_rows = 0;
  int64_t q_rot_row_stride = 0;  // dense rotated-q copy: [rows, Hq, round_up(D, 8)]
};

#if defined(FLASHPORT_DECODE_EXPERIMENTS)
// Experiment builds only: FLASHPORT_DECODE_TILE=<TileId> runs that tile for decode calls whose
// head dims fit it (scripts/device_decode.sh compares decode tiles in one build).
int decode_tile_override(int64_t dmax) {
  const char* env = std::getenv("FLASHPORT_DECODE_TILE");
  if (env == nullptr || *env == 0) return -1;
  const int t = std::atoi(env);
  if (t < kDecode64 || t >= kNumTileIds || kTileConfigs[t].head_dim != head_dim_bucket(dmax)) return -1;
  return t;
}
#endif

int64_t max_keys(const Problem& p) {
  if (p.seq.kv_layout == KvLayout::Paged) return p.seq.max_blocks * p.seq.page_size;
  return p.seq.sk;  // batched/cache capacity, or max_seqlen_k for varlen
}

Status decide(const Problem& p, const DeviceInfo& dev, Decision* out) {
  Decision d;
  const int64_t dmax = std::max(p.d, p.dv);
  d.pack = (p.group > 1 && p.seq.sq * p.group <= 128) ? static_cast<int>(p.group) : 1;
  // The decode tile (a ring of K/V stages, few rows) when the packed rows fit one of its blocks.
  const bool decode = p.seq.sq * d.pack <= kTileConfigs[tile_id_for(dmax, true)].block_m;
  d.tile = tile_id_for(dmax, decode);
#if defined(FLASHPORT_DECODE_EXPERIMENTS)
  if (decode && decode_tile_override(dmax) >= 0 && p.seq.sq * d.pack <= kTileConfigs[decode_tile_override(dmax)].block_m)
    d.tile = decode_tile_override(dmax);
#endif
  const TileConfig& C = kTileConfigs[d.tile];
  const KernelInfo ki = kernel_info(d.tile, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess)
    return unsupported(std::string("cuda backend: kernel ") + C.name + " has no image for sm_" +
                       std::to_string(dev.arch / 10) + " (built archs: " FLASHPORT_GPU_ARCHS "): " +
                       gpuGetErrorString(ki.status));
  d.m_blocks = (p.seq.sq * d.pack + C.block_m - 1) / C.block_m;
  d.heads_grid = d.pack > 1 ? p.hkv : p.hq;
  d.work_tiles = d.m_blocks * d.heads_grid * p.seq.batch;
  d.key_blocks = std::max<int64_t>(1, (max_keys(p) + C.block_n - 1) / C.block_n);
  // Concurrent block slots = SMs x resident blocks per SM: what one wave fills.
  const int64_t slots = int64_t(dev.sm_count) * std::max(1, ki.blocks_per_sm);
  d.splits = resolve_num_splits(p.num_splits, d.work_tiles, d.key_blocks, slots, kMaxSplits,
                                d.tile >= kDecode64);
  if (d.m_blocks > 0x7fffffff || d.heads_grid > 65535 || p.seq.batch * d.splits > 65535)
    return unsupported("cuda backend: grid too large (batch * splits <= 65535, heads <= 65535)");
  // The sm_90a wgmma kernel takes the call when its check passes, with its own split count (v3's
  // split-KV: the same heuristic over its tiles and occupancy); the workspace below is sized for
  // the kernel that runs.
  const int hopper_splits = hopper_num_splits(p, dev.sm_count, d.splits);
  d.hopper_reason = hopper_fwd_check(p, dev.arch, dev.smem_optin, d.tile >= kDecode64, d.pack, hopper_splits);
  if (d.hopper_reason.empty()) d.splits = hopper_splits;

  size_t off = 0;
  d.rotary_q = p.rotary_dim > 0;
  if (d.rotary_q) {
    d.q_rot_row_stride = p.hq * ((p.d + 7) / 8 * 8);
    d.ws_q_bytes = align_up(size_t(p.total_q_rows) * size_t(d.q_rot_row_stride) * 2, 256);
    off += d.ws_q_bytes;
  }
  if (d.splits > 1) {
    d.ws_rows = p.seq.batch * p.hq * p.seq.sq;
    d.ws_o_offset = off;
    off += align_up(size_t(d.splits) * size_t(d.ws_rows) * size_t(p.dv) * 4, 256);
    d.ws_lse_offset = off;
    off += align_up(size_t(d.splits) * size_t(d.ws_rows) * 4, 256);
    // Fused combine (decode tiles only): one uint32 arrival counter per work tile, zeroed on the
    // stream before each launch.
    d.combine = d.tile >= kDecode64 ? split_combine_mode() : SplitCombine::Kernel;
    if (d.fused_combine()) {
      d.ws_counters_offset = off;
      off += align_up(size_t(d.work_tiles) * 4, 256);
    }
  }
  d.ws_total = off;
  *out = d;
  return Status::ok();
}

// The sm_90a wgmma prefill kernel (fwd_hopper.cu) runs the call when its capability check
// passes (Decision::hopper_reason empty); otherwise the mma.sync plan below does.
constexpr int32_t kHopperKernelId = 1 << 20;

// Merges the split partials in the workspace into out / lse (the combine kernel), after the
// main kernel (mma.sync or Hopper v3) wrote them.
gpuError_t launch_split_combine(const Problem& p, const Decision& d, const FwdArgs& a, gpuStream_t stream) {
  return launch_merge(split_combine_args(p, a.ws_o, a.ws_lse, d.ws_rows, d.splits), stream);
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
    if (p.dtype != FP_F16 && p.dtype != FP_BF16)
      return unsupported(std::string("cuda backend: dtype ") +
                         (p.dtype == FP_F32 ? "float32" : "float64") + " not supported (float16, bfloat16)");
    if (p.has_lse && p.lse_dtype != FP_F32) return unsupported("cuda backend: lse must be float32");
    if (p.d > 256 || p.dv > 256) return unsupported("cuda backend: head dim > 256");
    if (p.rotary_dim > 0 && p.rotary_dtype != FP_F32 && p.rotary_dtype != p.dtype)
      return unsupported("cuda backend: rotary_cos/sin must be float32 or q's dtype");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, &dev));
    Decision d;
    FP_RETURN_IF_ERROR(decide(p, dev, &d));
    if (d.hopper_reason.empty()) {
      hopper_kernel_name(plan->kernel, sizeof(plan->kernel), p, d.splits);
      plan->workspace_bytes = d.ws_total;  // 0: no split, no rotary
      plan->num_splits = d.splits;
      plan->kernel_id = kHopperKernelId;
      return Status::ok();
    }
    const TileConfig& C = kTileConfigs[d.tile];
    if (C.smem_bytes() > dev.smem_optin)
      return unsupported(std::string("cuda backend: ") + C.name + " needs " +
                         std::to_string(C.smem_bytes()) + " bytes of shared memory per block, device has " +
                         std::to_string(dev.smem_optin));
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:%s%s%s%s",
                  kTileConfigs[d.tile].name, p.dtype == FP_BF16 ? "bf16" : "fp16",
                  d.pack > 1 ? ":packgqa" : "",
                  d.splits > 1 ? (d.fused_combine() ? ":splitkv+fused" : ":splitkv+combine") : "",
                  p.seq.snew > 0 ? (d.rotary_q ? ":append+rotary" : ":append") : "");
    plan->workspace_bytes = d.ws_total;
    plan->num_splits = d.splits;
    plan->kernel_id = d.tile * 2 + (p.dtype == FP_BF16 ? 1 : 0);
    return Status::ok();
  }

  Status run_fwd(const Problem& p, const Plan& plan, void* workspace) const override {
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, &dev));
    Decision d;
    FP_RETURN_IF_ERROR(decide(p, dev, &d));
    if (d.splits != plan.num_splits || d.ws_total != plan.workspace_bytes)
      return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
    DeviceGuard guard(p.device_index);
    auto stream = static_cast<gpuStream_t>(p.raw->stream);
    const bool bf16 = p.dtype == FP_BF16;
    char* ws = static_cast<char*>(workspace);

    uint16_t* q_rot = d.rotary_q ? reinterpret_cast<uint16_t*>(ws) : nullptr;
    if (p.seq.snew > 0 || d.rotary_q) {
      if (gpuError_t e = launch_append(append_args(p, q_rot, d.q_rot_row_stride), bf16, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: append/rotary launch: ") + gpuGetErrorString(e)};
    }
    FwdArgs a = d.rotary_q ? fwd_args(p, q_rot, q_rot_addr(p, d.q_rot_row_stride), d.pack, d.splits)
                           : fwd_args(p, static_cast<const uint16_t*>(p.q_ptr), p.q, d.pack, d.splits);
    if (d.splits > 1) {
      a.ws_o = reinterpret_cast<float*>(ws + d.ws_o_offset);
      a.ws_lse = reinterpret_cast<float*>(ws + d.ws_lse_offset);
      a.ws_rows = d.ws_rows;
      if (d.fused_combine()) a.ws_counters = reinterpret_cast<uint32_t*>(ws + d.ws_counters_offset);
    }
    if (plan.kernel_id == kHopperKernelId) {
#if defined(FLASHPORT_WITH_HOPPER_FWD)
      if (!d.hopper_reason.empty())
        return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
      if (const gpuError_t e = hopper_launch(p, a, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: sm90 wgmma prefill launch: ") + gpuGetErrorString(e)};
      if (d.splits > 1) {
        if (gpuError_t e = launch_split_combine(p, d, a, stream); e != gpuSuccess)
          return {FP_ERR_RUNTIME, std::string("cuda backend: split-KV combine launch: ") + gpuGetErrorString(e)};
      }
      return Status::ok();
#else
      return {FP_ERR_RUNTIME, "cuda backend: plan names the Hopper kernel, which is not built"};
#endif
    }
    const dim3 grid(unsigned(d.m_blocks), unsigned(d.heads_grid), unsigned(p.seq.batch * d.splits));
    if (d.m_blocks > 0 && p.seq.batch > 0) {
      // The workspace holds anything on entry: the fused combine's counters start at zero.
      if (a.ws_counters != nullptr && d.combine != SplitCombine::FusedNoMemset) {
        if (cudaError_t e = cudaMemsetAsync(a.ws_counters, 0, size_t(d.work_tiles) * 4, stream); e != cudaSuccess)
          return {FP_ERR_RUNTIME, std::string("cuda backend: split-KV counter reset: ") + cudaGetErrorString(e)};
      }
      if (gpuError_t e = launch_tile(d.tile, bf16, a, grid, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kTileConfigs[d.tile].name +
                                    " launch: " + gpuGetErrorString(e)};
    }
    if (d.splits > 1 && !d.fused_combine()) {
      if (gpuError_t e = launch_split_combine(p, d, a, stream); e != gpuSuccess)
        return {FP_ERR_RUNTIME, std::string("cuda backend: split-KV combine launch: ") + gpuGetErrorString(e)};
    }
    return Status::ok();
  }

  Status plan_bwd(const BwdProblem& p, Plan* plan) const override {
    if (p.fwd.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.fwd.device_index, &dev));
    FP_RETURN_IF_ERROR(plan_bwd_cuda(p, dev.smem_optin, plan));  // bwd_aux.cu
    // The sm_90a wgmma backward (bwd_hopper.cu) takes the call when its check passes (same
    // workspace); otherwise the mma.sync plan stands.
#if defined(FLASHPORT_WITH_HOPPER_BWD)
    if (hopper_bwd_check(p, dev.arch, dev.smem_optin).empty()) hopper_bwd_plan(p, plan);
#endif
    return Status::ok();
  }
  Status run_bwd(const BwdProblem& p, const Plan& plan, void* workspace) const override {
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.fwd.device_index, &dev));
    DeviceGuard guard(p.fwd.device_index);
#if defined(FLASHPORT_WITH_HOPPER_BWD)
    if (plan.kernel_id == kHopperBwdKernelId) {
      if (!hopper_bwd_check(p, dev.arch, dev.smem_optin).empty())
        return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
      return run_bwd_hopper(p, plan, workspace, static_cast<gpuStream_t>(p.fwd.raw->stream));
    }
#endif
    return run_bwd_cuda(p, plan, workspace, static_cast<gpuStream_t>(p.fwd.raw->stream));
  }

  // fp_attn_probs: one element-wise kernel (probs_kernel.cu), no workspace.
  Status plan_probs(const ProbsProblem& pp, Plan* plan) const override {
    const Problem& p = pp.fwd;
    if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
    if (p.dtype != FP_F16 && p.dtype != FP_BF16)
      return unsupported("cuda backend: probs of float16/bfloat16 calls only");
    if (p.lse_dtype != FP_F32) return unsupported("cuda backend: lse must be float32");
    DeviceInfo dev;
    FP_RETURN_IF_ERROR(check_device(p.device_index, &dev));
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:probs:%s", p.dtype == FP_BF16 ? "bf16" : "fp16");
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
    plan->workspace_bytes = 0;
    plan->num_splits = static_cast<int32_t>(p.splits);
    return Status::ok();
  }

  Status run_merge(const MergeProblem& p, const Plan&) const override {
    const fp_merge_params& raw = *p.raw;
    DeviceGuard guard(raw.out.device_index);
    MergeArgs m;
    m.part = raw.out_partials.data;
    m.part_dtype = p.part_dtype;
    m.lse_part = static_cast<const float*>(raw.lse_partials.data);
    m.out = raw.out.data;
    m.out_dtype = p.out_dtype;
    m.lse = p.has_lse ? static_cast<float*>(raw.lse.data) : nullptr;
    m.splits = p.splits, m.batch = p.batch, m.seqlen = p.seqlen, m.heads = p.heads, m.dv = p.dv;
    std::memcpy(m.part_stride, p.part_stride, sizeof(m.part_stride));
    std::memcpy(m.lse_part_stride, p.lse_part_stride, sizeof(m.lse_part_stride));
    std::memcpy(m.out_stride, p.out_stride, sizeof(m.out_stride));
    std::memcpy(m.lse_stride, p.lse_stride, sizeof(m.lse_stride));
    if (gpuError_t e = launch_merge(m, static_cast<gpuStream_t>(raw.stream)); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: merge launch: ") + gpuGetErrorString(e)};
    return Status::ok();
  }
  Status run_merge_bwd(const MergeBwdProblem& mb, const Plan&) const override {
    const MergeProblem& p = mb.fwd;
    const fp_merge_params& raw = *p.raw;
    if (!p.has_lse || raw.lse.data == nullptr)
      return unsupported("cuda backend: merge backward needs the forward lse");
    DeviceGuard guard(raw.out.device_index);
    MergeBwdArgs g;
    MergeArgs& m = g.fwd;
    m.part = raw.out_partials.data;
    m.part_dtype = p.part_dtype;
    m.lse_part = static_cast<const float*>(raw.lse_partials.data);
    m.out = raw.out.data;
    m.out_dtype = p.out_dtype;
    m.lse = static_cast<float*>(raw.lse.data);
    m.splits = p.splits, m.batch = p.batch, m.seqlen = p.seqlen, m.heads = p.heads, m.dv = p.dv;
    std::memcpy(m.part_stride, p.part_stride, sizeof(m.part_stride));
    std::memcpy(m.lse_part_stride, p.lse_part_stride, sizeof(m.lse_part_stride));
    std::memcpy(m.out_stride, p.out_stride, sizeof(m.out_stride));
    std::memcpy(m.lse_stride, p.lse_stride, sizeof(m.lse_stride));
    g.dout = mb.raw->dout.data;
    g.dlse = mb.has_dlse ? static_cast<const float*>(mb.raw->dlse.data) : nullptr;
    g.d_part = mb.raw->d_out_partials.data;
    g.d_lse_part = static_cast<float*>(mb.raw->d_lse_partials.data);
    std::memcpy(g.dout_stride, mb.dout_stride, sizeof(g.dout_stride));
    std::memcpy(g.dlse_stride, mb.dlse_stride, sizeof(g.dlse_stride));
    std::memcpy(g.d_part_stride, mb.d_part_stride, sizeof(g.d_part_stride));
    std::memcpy(g.d_lse_part_stride, mb.d_lse_part_stride, sizeof(g.d_lse_part_stride));
    if (gpuError_t e = launch_merge_bwd(g, static_cast<gpuStream_t>(raw.stream)); e != gpuSuccess)
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
