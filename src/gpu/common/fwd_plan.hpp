// Host planning pieces both GPU backends share (CUDA: cuda_backend.cu, HIP: amd/amd_plan.hpp):
// the kernel ids a Plan carries, the GQA packing rule, the forward workspace layout, and the
// arguments of the public merge op. One definition each, so the two backends cannot drift.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "gpu/common/kernel_args.hpp"

namespace flashport::gpu {

// Plan::kernel_id of the GPU backends: which kernel family runs the call. The family's own
// choice (tile row, GQA pack) travels in Plan::backend_args (PlanArgs below).
enum GpuKernelId : int32_t {
  kKernelNone = 0,
  kKernelMmaFwd = 1,     // mma.sync forward (mma/fwd_kernel.cuh; on HIP the same loop on the AMD tile layer)
  kKernelHopperFwd = 2,  // sm_90a wgmma/TMA forward (hopper/fwd_hopper.cu)
  kKernelMmaBwd = 3,     // mma.sync backward (mma/bwd_kernel.cuh)
  kKernelHopperBwd = 4,  // sm_90a wgmma backward (hopper/bwd_hopper.cu)
  kKernelMerge = 5,      // merge op / split combine (common/aux_kernels.cu)
  kKernelF32Fwd = 6,     // fp32 forward, 3xTF32 mma.sync (f32/fwd_f32.cu)
  kKernelF32Bwd = 7,     // fp32 backward, 3xTF32 mma.sync (f32/bwd_f32.cu)
  kKernelDecodeFwd = 8,  // decode kernel, warps split the keys, merge in kernel (mma/decode_kernel.cuh; CUDA)
};

// The slots of Plan::backend_args the GPU backends use.
struct PlanArgs {
  static int32_t tile(const Plan& p) { return p.backend_args[0]; }
  static int32_t pack(const Plan& p) { return p.backend_args[1] < 1 ? 1 : p.backend_args[1]; }
  // Blocks to launch when the kernel walks its work tiles with a persistent grid; 0: one block
  // per work tile.
  static int32_t grid(const Plan& p) { return p.backend_args[2]; }
  // The persistent grid takes its tiles from a counter in the workspace (the Hopper forward's
  // dynamic walk).
  static bool tile_counter(const Plan& p) { return p.backend_args[3] != 0; }
  static void set(Plan* p, int32_t tile, int32_t pack, int32_t grid = 0, bool tile_counter = false) {
    p->backend_args[0] = tile;
    p->backend_args[1] = pack;
    p->backend_args[2] = grid;
    p->backend_args[3] = tile_counter ? 1 : 0;
  }
};

// Query heads of a GQA group packed into the rows of one block: when the call is decode-shaped
// (Sq * group <= 128), so K/V are read once per group.
inline int gqa_pack(const Problem& p) {
  return (p.group > 1 && p.seq.sq * p.group <= 128) ? static_cast<int>(p.group) : 1;
}

// A call over a KV cache: rows past a sequence's keys are the cache's, whatever they hold.
inline bool is_kv_cache_call(const Problem& p) {
  return p.seq.seqused_k != nullptr || p.seq.kv_layout == KvLayout::Paged || p.seq.cache_batch_idx != nullptr ||
         p.seq.cache_leftpad != nullptr;
}

// Every work tile of the call costs the same: no causal or window mask, every sequence as long as
// the batched tensors (no varlen), no KV cache (seqused_k, paged, cache_batch_idx, left pad).
inline bool equal_cost_tiles(const Problem& p) {
  return p.rules.window_left < 0 && p.rules.window_right < 0 && p.seq.cu_q == nullptr && p.seq.cu_k == nullptr &&
         !is_kv_cache_call(p);
}

// Key rows a sequence may address: batched/cache capacity, max_seqlen_k for varlen, pages x size.
inline int64_t max_kv_rows(const Problem& p) {
  if (p.seq.kv_layout == KvLayout::Paged) return p.seq.max_blocks * p.seq.page_size;
  return p.seq.sk;
}

// The forward workspace (256-byte aligned parts): rotated q [rows, Hq, round8(D)] in q's dtype
// (16-bit or fp32) when rotary is on; split partials o [splits][B*Hq*Sq][dv] fp32 and lse [splits][B*Hq*Sq] fp32 when
// splits > 1; the tile walk (a NonceCounter, any initial contents) when the plan's grid walks
// tiles dynamically (the Hopper forward: PlanArgs::tile_counter); `split_counters` NonceCounters
// when the decode kernel merges its own splits (kKernelDecodeFwd with splits > 1: one per
// (sequence, block head)).
// Every forward kernel (mma.sync, decode, Hopper, AMD) reads this layout.
struct FwdWorkspace {
  int64_t q_rot_row_stride = 0;  // 0: q is not rotated
  int64_t rows = 0;              // partial rows: B * Hq * Sq (0 without splits)
  size_t o_offset = 0, lse_offset = 0, total = 0;
  bool has_tile_counter = false;
  size_t tile_counter_offset = 0;
  int64_t split_counters = 0;    // NonceCounters (any initial contents); 0: none
  size_t split_counter_offset = 0;
};

// A call's nonce (FwdArgs::call_nonce: the NonceCounters of the decode kernel's split merge and
// the Hopper forward's tile walk): a per-process counter through the splitmix64 finalizer, seeded
// once from std::random_device and the clock, so nonces look random (a workspace holding small
// integers or another process's counters does not match them) and are never 0 (the value the
// kernels reset to).
inline uint64_t call_nonce_seed() {
  uint64_t seed = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  try {
    std::random_device rd;
    seed ^= (uint64_t(rd()) << 32) ^ rd();
  } catch (...) {  // no entropy source: the clock alone
  }
  return seed;
}
inline uint64_t next_call_nonce() {
  static std::atomic<uint64_t> counter{call_nonce_seed()};
  uint64_t z = counter.fetch_add(0x9E3779B97F4A7C15ull, std::memory_order_relaxed) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z != 0 ? z : 1;
}

inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

inline FwdWorkspace fwd_workspace(const Problem& p, int splits, bool tile_counter = false,
                                  int64_t split_counters = 0) {
  FwdWorkspace w;
  size_t off = 0;
  if (p.rotary_dim > 0) {
    w.q_rot_row_stride = p.hq * ((p.d + 7) / 8 * 8);
    off += align256(size_t(p.total_q_rows) * size_t(w.q_rot_row_stride) * (p.dtype == FP_F32 ? 4 : 2));
  }
  if (splits > 1) {
    w.rows = p.seq.batch * p.hq * p.seq.sq;
    w.o_offset = off;
    off += align256(size_t(splits) * size_t(w.rows) * size_t(p.dv) * 4);
    w.lse_offset = off;
    off += align256(size_t(splits) * size_t(w.rows) * 4);
  }
  if (tile_counter) {
    w.has_tile_counter = true;
    w.tile_counter_offset = off;
    off += align256(sizeof(NonceCounter));
  }
  if (split_counters > 0 && splits > 1) {
    w.split_counters = split_counters;
    w.split_counter_offset = off;
    off += align256(size_t(split_counters) * sizeof(NonceCounter));
  }
  w.total = off;
  return w;
}

// The main loop's arguments over a workspace laid out by fwd_workspace (q from its rotated copy
// when rotary is on; the split partials when splits > 1).
inline FwdArgs fwd_args_in(const Problem& p, const FwdWorkspace& w, int pack, int splits, void* workspace) {
  char* ws = static_cast<char*>(workspace);
  FwdArgs a = w.q_rot_row_stride > 0
                  ? fwd_args(p, reinterpret_cast<const uint16_t*>(ws), q_rot_addr(p, w.q_rot_row_stride), pack, splits)
                  : fwd_args(p, static_cast<const uint16_t*>(p.q_ptr), p.q, pack, splits);
  if (splits > 1) {
    a.ws_o = reinterpret_cast<float*>(ws + w.o_offset);
    a.ws_lse = reinterpret_cast<float*>(ws + w.lse_offset);
    a.ws_rows = w.rows;
  }
  if (w.split_counters > 0) a.split_counters = reinterpret_cast<NonceCounter*>(ws + w.split_counter_offset);
  return a;
}

// The append / rotary pre-pass over the same workspace.
inline AppendArgs append_args_in(const Problem& p, const FwdWorkspace& w, void* workspace) {
  return append_args(p, w.q_rot_row_stride > 0 ? static_cast<uint16_t*>(workspace) : nullptr, w.q_rot_row_stride);
}

// The split-KV combine of the partials of `a` (splits > 1) into out / lse.
inline MergeArgs split_combine_args_in(const Problem& p, const FwdArgs& a) {
  return split_combine_args(p, a.ws_o, a.ws_lse, a.ws_rows, a.splits);
}

// The public merge op (fp_merge_fwd) and its backward (fp_merge_bwd).
inline MergeArgs merge_args(const MergeProblem& p) {
  const fp_merge_params& raw = *p.raw;
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
  return m;
}

inline MergeBwdArgs merge_bwd_args(const MergeBwdProblem& mb) {
  MergeBwdArgs g;
  g.fwd = merge_args(mb.fwd);
  g.dout = mb.raw->dout.data;
  g.dlse = mb.has_dlse ? static_cast<const float*>(mb.raw->dlse.data) : nullptr;
  g.d_part = mb.raw->d_out_partials.data;
  g.d_lse_part = static_cast<float*>(mb.raw->d_lse_partials.data);
  std::memcpy(g.dout_stride, mb.dout_stride, sizeof(g.dout_stride));
  std::memcpy(g.dlse_stride, mb.dlse_stride, sizeof(g.dlse_stride));
  std::memcpy(g.d_part_stride, mb.d_part_stride, sizeof(g.d_part_stride));
  std::memcpy(g.d_lse_part_stride, mb.d_lse_part_stride, sizeof(g.d_lse_part_stride));
  return g;
}

}  // namespace flashport::gpu
