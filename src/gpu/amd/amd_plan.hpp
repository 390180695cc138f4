// The HIP backend's plans, host side: whether the shared forward main loop (fwd_kernel.cuh) and
// the aux kernels (aux_kernels.cu: split-KV combine / merge, KV-cache append + rotary) can run a
// validated call on AMD (or the reason not), which tile row, split count, workspace layout and
// launch shape it takes, and the kernel arguments of each launch. Read by the HIP backend
// (hip_backend.hip) and by the CPU emulation tests (tests/amd), so what is tested is what is
// launched. AMD rows of tile_config.hpp only (HIP host pass or the emulation).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/heuristics.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_config.hpp"

#if !defined(FP_TARGET_AMD)
#error "amd_plan.hpp is for the HIP build and the AMD emulation (AMD tile rows)"
#endif

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

// The launches of one call: KV-cache append + rotary pre-pass (optional), the main loop over
// (row blocks, heads, batch x splits), the split-KV combine (splits > 1), and the workspace.
struct AmdFwdLaunch {
  TileId tile = kPrefill64;
  int pack = 1;            // query heads of a GQA group packed into the rows of a block
  int splits = 1;          // key ranges per (row block, head): partials merged by the combine kernel
  int64_t m_blocks = 0;    // grid x
  int64_t heads_grid = 0;  // grid y: query heads, or kv heads when packed
  int64_t batch = 0;       // grid z = batch * splits
  int64_t work_tiles = 0, key_blocks = 0;
  bool append = false;     // k_new/v_new written into the cache before the main loop
  bool rotary_q = false;   // q rotated into the workspace (the main loop reads the copy)
  // Workspace (256-byte aligned parts, the CUDA backend's layout): rotated q [rows, Hq, round8(D)]
  // 16-bit; split partials o [splits][B*Hq*Sq][dv] fp32 and lse [splits][B*Hq*Sq] fp32.
  int64_t q_rot_row_stride = 0, ws_rows = 0;
  size_t ws_o_offset = 0, ws_lse_offset = 0, ws_bytes = 0;
};

// "" when the main loop and the aux kernels run the call on AMD; else why not.
inline std::string amd_fwd_refusal(const Problem& p) {
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "dtype must be float16 or bfloat16";
  if (p.has_lse && p.lse_dtype != FP_F32) return "lse must be float32";
  if (std::max(p.d, p.dv) > 256) return "head dim > 256";
  if (p.rotary_dim > 0 && p.rotary_dtype != FP_F32 && p.rotary_dtype != p.dtype)
    return "rotary_cos/sin must be float32 or q's dtype";
  return "";
}

inline int64_t amd_max_keys(const Problem& p) {
  if (p.seq.kv_layout == KvLayout::Paged) return p.seq.max_blocks * p.seq.page_size;
  return p.seq.sk;  // batched/cache capacity, or max_seqlen_k for varlen
}

inline size_t amd_align256(size_t x) { return (x + 255) / 256 * 256; }

// Same packing rule as the CUDA plan: the query heads of a GQA group become rows of one block
// when the call is decode-shaped (Sq * group <= 128), so K/V are read once per group. Split count:
// the caller's num_splits (>= 2 forced, 1 off), or with 0 the pure heuristic of
// core/heuristics.hpp over the device's `compute_units` (one workgroup of the prefill tile per CU
// counted as the wave; AMD runs the prefill tiles only).
inline AmdFwdLaunch amd_fwd_launch(const Problem& p, int64_t compute_units) {
  AmdFwdLaunch l;
  l.tile = tile_id_for(std::max(p.d, p.dv), false);
  l.pack = (p.group > 1 && p.seq.sq * p.group <= 128) ? static_cast<int>(p.group) : 1;
  const TileConfig& c = kTileConfigs[l.tile];
  l.m_blocks = (p.seq.sq * l.pack + c.block_m - 1) / c.block_m;
  l.heads_grid = l.pack > 1 ? p.hkv : p.hq;
  l.work_tiles = l.m_blocks * l.heads_grid * p.seq.batch;
  l.key_blocks = std::max<int64_t>(1, (amd_max_keys(p) + c.block_n - 1) / c.block_n);
  l.splits = resolve_num_splits(p.num_splits, l.work_tiles, l.key_blocks, compute_units, kMaxSplits);
  l.batch = p.seq.batch;
  l.append = p.seq.snew > 0;
  l.rotary_q = p.rotary_dim > 0;
  size_t off = 0;
  if (l.rotary_q) {
    l.q_rot_row_stride = p.hq * ((p.d + 7) / 8 * 8);
    off += amd_align256(size_t(p.total_q_rows) * size_t(l.q_rot_row_stride) * 2);
  }
  if (l.splits > 1) {
    l.ws_rows = p.seq.batch * p.hq * p.seq.sq;
    l.ws_o_offset = off;
    off += amd_align256(size_t(l.splits) * size_t(l.ws_rows) * size_t(p.dv) * 4);
    l.ws_lse_offset = off;
    off += amd_align256(size_t(l.splits) * size_t(l.ws_rows) * 4);
  }
  l.ws_bytes = off;
  return l;
}

// "" when the grid fits the launch limits; else why not.
inline std::string amd_grid_refusal(const AmdFwdLaunch& l) {
  if (l.m_blocks > 0x7fffffff || l.heads_grid > 65535 || l.batch * l.splits > 65535)
    return "grid too large (heads and batch * splits <= 65535)";
  return "";
}

// The append / rotary pre-pass arguments (l.append or l.rotary_q).
inline AppendArgs amd_append_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  return append_args(p, l.rotary_q ? static_cast<uint16_t*>(workspace) : nullptr, l.q_rot_row_stride);
}

// The kernel arguments of a call: the fields every backend fills alike (kernel_args.hpp), plus
// the split partials. `workspace`: l.ws_bytes bytes (may be null when that is 0); its content on
// entry is anything.
inline FwdArgs amd_fwd_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  char* ws = static_cast<char*>(workspace);
  FwdArgs a = l.rotary_q ? fwd_args(p, reinterpret_cast<const uint16_t*>(ws), q_rot_addr(p, l.q_rot_row_stride),
                                    l.pack, l.splits)
                         : fwd_args(p, static_cast<const uint16_t*>(p.q_ptr), p.q, l.pack, l.splits);
  if (l.splits > 1) {
    a.ws_o = reinterpret_cast<float*>(ws + l.ws_o_offset);
    a.ws_lse = reinterpret_cast<float*>(ws + l.ws_lse_offset);
    a.ws_rows = l.ws_rows;  // ws_counters stays null: the combine kernel merges (no fused epilogue)
  }
  return a;
}

// The split-KV combine of the partials into out / lse (l.splits > 1).
inline MergeArgs amd_combine_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  char* ws = static_cast<char*>(workspace);
  return split_combine_args(p, reinterpret_cast<const float*>(ws + l.ws_o_offset),
                            reinterpret_cast<const float*>(ws + l.ws_lse_offset), l.ws_rows, l.splits);
}

// The public merge op (fp_merge_fwd): "" when the merge kernel runs it; else why not.
inline std::string amd_merge_refusal(const MergeProblem& p) {
  auto ok = [](fp_dtype t) { return t == FP_F32 || t == FP_F16 || t == FP_BF16; };
  if (!ok(p.part_dtype) || !ok(p.out_dtype)) return "merge supports float32/float16/bfloat16 partials and output";
  if (p.lse_dtype != FP_F32) return "merge lse must be float32";
  // Blocks of 4 warps over (row, 32-column chunk) items at wave32: the grid's x limit.
  if (p.batch * p.seqlen * p.heads * ((p.dv + 31) / 32) / 4 >= int64_t(0x7fffffff)) return "merge grid too large";
  return "";
}

inline MergeArgs amd_merge_args(const MergeProblem& p) {
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

FP_TARGET_NS_END
}  // namespace flashport::gpu
