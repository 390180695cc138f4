// Backward around the main loop: the preprocessing (D = rowsum(dout * out), LSE in log2 units,
// zeroed dq accumulator and semaphores), the dq conversion with the sink gradient, and the
// planning/launch of the three steps (see bwd_launch.hpp). One warp per (row, head) in the
// memory-bound kernels; the dtype is a runtime branch (one instance each).
#include <algorithm>
#include <cstdio>
#include <string>

#include "gpu/common/fwd_plan.hpp"
#include "gpu/mma/bwd_launch.hpp"
#include "gpu/common/tile_mma.hpp"

namespace flashport::gpu {

namespace {

constexpr float kLog2eAux = 1.4426950408889634f;
constexpr int kAuxWarps = 8;

__device__ __forceinline__ float bits_to_float(uint16_t v, bool bf16) {
  return bf16 ? __uint_as_float(uint32_t(v) << 16) : __half2float(__ushort_as_half(v));
}
__device__ __forceinline__ uint16_t float_to_bits(float v, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

// Workspace row r (of total_rows) of head h -> (b, i) addressing arguments: batched rows are
// b * Sq + i; packed rows are addressed directly (b = 0, sequence start 0, row r).
struct RowRef {
  int64_t b, i;
};
__device__ __forceinline__ RowRef row_ref(const BwdArgs& a, int64_t r) {
  if (a.seq.cu_q != nullptr) return {0, r};
  return {r / a.seq.sq, r % a.seq.sq};
}

__global__ void __launch_bounds__(kAuxWarps * 32) bwd_preprocess_kernel(const __grid_constant__ BwdArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = gtid; s < a.sema_count; s += int64_t(gridDim.x) * blockDim.x) a.ws_sema[s] = 0;
  const int64_t w = gtid >> 5;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  const RowRef rr = row_ref(a, r);
  const uint16_t* o = a.out + a.out_addr.at(rr.b, 0, rr.i, h);
  const uint16_t* g = a.dout + a.dout_addr.at(rr.b, 0, rr.i, h);
  float dot = 0.0f;
  for (int c = lane; c < a.dv; c += 32) dot += bits_to_float(o[c], a.bf16) * bits_to_float(g[c], a.bf16);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dot += shfl_xor(dot, off);
  float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.dacc; c += 32) acc[c] = 0.0f;
  if (lane == 0) {
    const float lse = a.lse[a.lse_addr.at(rr.b, 0, h, rr.i)];
    a.ws_dsum[w] = dot;
    // A row that saw nothing (lse = -inf) has P = 0: +inf makes exp2(s - lse2) zero.
    a.ws_lse2[w] = lse == -INFINITY ? INFINITY : lse * kLog2eAux;
  }
}

__global__ void __launch_bounds__(kAuxWarps * 32) bwd_convert_kernel(const __grid_constant__ BwdArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  if (a.seq.cu_q != nullptr && r >= a.seq.cu_q[a.seq.batch]) return;  // not a row of any sequence
  const RowRef rr = row_ref(a, r);
  uint16_t* dst = a.dq_ptr + a.dq_addr.at(rr.b, 0, rr.i, h);
  const float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.d; c += 32) dst[c] = float_to_bits(acc[c] * a.scale, a.bf16);
}

// d_sinks[h] = -sum over rows of exp(sink_h - lse_i) * D_i, one block per head, fixed order.
constexpr int kSinkThreads = 256;
__global__ void __launch_bounds__(kSinkThreads) bwd_sink_kernel(const __grid_constant__ BwdArgs a) {
  __shared__ double part[kSinkThreads];
  const int h = blockIdx.x;
  int64_t rows = a.total_rows;
  if (a.seq.cu_q != nullptr) {
    const int64_t used = a.seq.cu_q[a.seq.batch];
    rows = used < rows ? (used < 0 ? 0 : used) : rows;
  }
  const float sink2 = a.rules.sinks[h] * kLog2eAux;
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kSinkThreads) {
    const int64_t w = int64_t(h) * a.total_rows + r;
    const float l2 = a.ws_lse2[w];
    if (l2 != INFINITY) acc -= double(exp2f(sink2 - l2)) * double(a.ws_dsum[w]);
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kSinkThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) a.d_sinks[h] = static_cast<float>(part[0]);
}

unsigned aux_blocks(const BwdArgs& a) {
  const int64_t warps = a.total_rows * a.hq;
  return static_cast<unsigned>(std::max<int64_t>(1, (warps + kAuxWarps - 1) / kAuxWarps));
}

}  // namespace

gpuError_t launch_bwd_preprocess(const BwdArgs& a, gpuStream_t stream) {
  bwd_preprocess_kernel<<<aux_blocks(a), kAuxWarps * 32, 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_bwd_convert(const BwdArgs& a, gpuStream_t stream) {
  bwd_convert_kernel<<<aux_blocks(a), kAuxWarps * 32, 0, stream>>>(a);
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

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct BwdLayout {
  int tile = 0;
  int64_t key_blocks = 0, m_blocks = 0;
  BwdWorkspace ws;
};

BwdLayout layout_of(const BwdProblem& bp) {
  const Problem& p = bp.fwd;
  BwdLayout l;
  l.tile = bwd_tile_for(std::max(p.d, p.dv));
  const BwdTile& C = kBwdTiles[l.tile];
  const int64_t max_keys = p.seq.sk;  // batched: rows per sequence; varlen: max_seqlen_k
  l.key_blocks = (max_keys + C.block_n - 1) / C.block_n;
  l.m_blocks = (p.seq.sq + C.block_m - 1) / C.block_m;
  l.ws = bwd_workspace(p, bp.deterministic ? p.seq.batch * p.hq * l.m_blocks : 0);
  return l;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
bool mult8(int64_t x) { return (x & 7) == 0; }

}  // namespace

BwdWorkspace bwd_workspace(const Problem& p, int64_t sema_count) {
  BwdWorkspace w;
  w.total_rows = p.total_q_rows;
  w.dacc = static_cast<int32_t>((p.d + 7) / 8 * 8);
  const size_t rows = size_t(p.hq) * size_t(w.total_rows);
  size_t off = 0;
  w.lse_off = off;
  off += align_up(rows * 4, 256);
  w.dsum_off = off;
  off += align_up(rows * 4, 256);
  w.dq_off = off;
  off += align_up(rows * size_t(w.dacc) * 4, 256);
  w.sema_off = off;
  w.sema_count = sema_count;
  off += align_up(size_t(sema_count) * 4, 256);
  w.total = off;
  return w;
}

BwdArgs bwd_common_args(const BwdProblem& bp, const BwdWorkspace& w, void* workspace) {
  const Problem& p = bp.fwd;
  char* ws = static_cast<char*>(workspace);
  BwdArgs a;
  a.q = static_cast<const uint16_t*>(p.q_ptr);
  a.k = static_cast<const uint16_t*>(p.k_ptr);
  a.v = static_cast<const uint16_t*>(p.v_ptr);
  a.out = static_cast<const uint16_t*>(p.out_ptr);
  a.dout = static_cast<const uint16_t*>(bp.dout_ptr);
  a.lse = static_cast<const float*>(p.lse_ptr);
  a.dq_ptr = static_cast<uint16_t*>(bp.dq_ptr);
  a.dk_ptr = static_cast<uint16_t*>(bp.dk_ptr);
  a.dv_ptr = static_cast<uint16_t*>(bp.dv_ptr);
  a.d_sinks = p.rules.sinks != nullptr ? bp.d_sinks : nullptr;
  a.seq = p.seq;
  a.q_addr = p.q, a.out_addr = p.out, a.dout_addr = bp.dout, a.dq_addr = bp.dq;
  a.k_addr = p.k, a.v_addr = p.v, a.dk_addr = bp.dk, a.dv_addr = bp.dv;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.k_rows_cap = p.seq.kv_layout == KvLayout::Batched ? p.seq.sk : 0;
  a.total_rows = w.total_rows;
  a.hq = int32_t(p.hq), a.hkv = int32_t(p.hkv), a.d = int32_t(p.d), a.dv = int32_t(p.dv);
  a.group = int32_t(p.group);
  a.dacc = w.dacc;
  a.bf16 = p.dtype == FP_BF16;
  auto even = [](int64_t x) { return (x & 1) == 0; };
  a.kv_out_vec_ok = (reinterpret_cast<uintptr_t>(a.dk_ptr) & 3) == 0 && (reinterpret_cast<uintptr_t>(a.dv_ptr) & 3) == 0 &&
                    even(bp.dk.s0) && even(bp.dk.s1) && even(bp.dk.s2) && even(bp.dv.s0) &&
                    even(bp.dv.s1) && even(bp.dv.s2);
  a.scale = p.rules.scale;
  a.scale_log2 = p.rules.scale * kLog2eAux;
  if (p.rules.softcap > 0.0f) {
    a.softcap_in = p.rules.scale / p.rules.softcap;
    a.softcap_out = p.rules.softcap * kLog2eAux;
  }
  a.ws_lse2 = reinterpret_cast<float*>(ws + w.lse_off);
  a.ws_dsum = reinterpret_cast<float*>(ws + w.dsum_off);
  a.ws_dq = reinterpret_cast<float*>(ws + w.dq_off);
  return a;
}

Status plan_bwd_cuda(const BwdProblem& bp, int smem_optin, Plan* plan) {
  const Problem& p = bp.fwd;
  if (p.device != FP_DEVICE_CUDA) return unsupported("cuda backend: tensors are not on a CUDA device");
  if (p.dtype != FP_F16 && p.dtype != FP_BF16)
    return unsupported(std::string("cuda backend: backward dtype ") +
                       (p.dtype == FP_F32 ? "float32" : "float64") + " not supported (float16, bfloat16)");
  if (!p.has_lse) return invalid("lse: required by the backward");
  if (p.lse_dtype != FP_F32) return unsupported("cuda backend: lse must be float32");
  if (p.d > 256 || p.dv > 256) return unsupported("cuda backend: head dim > 256");
  if (p.seq.snew > 0 || p.rotary_dim > 0)
    return unsupported("cuda backend: no backward for append-then-attend (k_new, rotary)");
  if (p.seq.kv_layout == KvLayout::Paged || p.seq.cache_batch_idx != nullptr)
    return unsupported("cuda backend: backward over a paged cache or cache_batch_idx is not supported");
  const BwdLayout l = layout_of(bp);
  const BwdTile& C = kBwdTiles[l.tile];
  if (C.smem_bytes() > smem_optin)
    return unsupported(std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.smem_bytes()) +
                       " bytes of shared memory per block, device has " + std::to_string(smem_optin));
  const BwdKernelInfo ki = bwd_info(l.tile, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess)
    return unsupported(std::string("cuda backend: kernel ") + C.name + " is not usable on this device (built archs: " FLASHPORT_GPU_ARCHS "): " +
                       gpuGetErrorString(ki.status));
  if (l.key_blocks > 0x7fffffff || p.hkv > 65535 || p.seq.batch > 65535)
    return unsupported("cuda backend: backward grid too large (batch <= 65535, kv heads <= 65535)");
  if (p.seq.sq > 0x3fffffff || p.seq.sk > 0x3fffffff)
    return unsupported("cuda backend: sequence lengths must fit int32");
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
  const BwdLayout l = layout_of(bp);
  if (l.ws.total != plan.workspace_bytes || plan.kernel_id != kKernelMmaBwd || PlanArgs::tile(plan) != l.tile)
    return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
  if (p.seq.batch == 0) return Status::ok();
  BwdArgs a = bwd_common_args(bp, l.ws, workspace);
  a.m_blocks = static_cast<int32_t>(l.m_blocks);
  a.vec_ok = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.dout) &&
             mult8(p.q.row_stride) && mult8(p.q.head_stride) && mult8(p.q.batch_stride) &&
             mult8(bp.dout.row_stride) && mult8(bp.dout.head_stride) && mult8(bp.dout.batch_stride) &&
             mult8(p.k.s0) && mult8(p.k.s1) && mult8(p.k.s2) && mult8(p.v.s0) && mult8(p.v.s1) &&
             mult8(p.v.s2);
  a.deterministic = bp.deterministic;
  a.ws_sema = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + l.ws.sema_off);
  a.sema_count = l.ws.sema_count;

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
