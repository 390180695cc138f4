// The HIP backend's plans, host side: whether the shared forward main loop (fwd_kernel.cuh), the
// aux kernels (aux_kernels.cu: split-KV combine / merge, KV-cache append + rotary) and the shared
// backward (bwd_kernel.cuh + bwd_aux_kernels.cuh) can run a validated call on AMD (or the reason
// not), which tile row, split count, workspace layout and launch shape it takes, and the kernel
// arguments of each launch. Read by the HIP backend
// (hip_backend.hip) and by the CPU emulation tests (tests/amd), so what is tested is what is
// launched. AMD rows of tile_config.hpp only (HIP host pass or the emulation).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/heuristics.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu/mma/bwd_launch.hpp"

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
  FwdWorkspace ws;          // the layout every GPU backend uses (common/fwd_plan.hpp)
  size_t ws_bytes = 0;      // ws.total
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

// Same packing rule as the CUDA plan: the query heads of a GQA group become rows of one block
// when the call is decode-shaped (Sq * group <= 128), so K/V are read once per group. Split count:
// the caller's num_splits (>= 2 forced, 1 off), or with 0 the pure heuristic of
// core/heuristics.hpp over the device's `compute_units` (one workgroup of the prefill tile per CU
// counted as the wave; AMD runs the prefill tiles only). amd_fwd_shape: the launch of a decided
// (tile, pack, splits), which run_fwd rebuilds from the plan without deciding again.
inline AmdFwdLaunch amd_fwd_shape(const Problem& p, TileId tile, int pack, int splits) {
  AmdFwdLaunch l;
  l.tile = tile;
  l.pack = pack;
  const TileConfig& c = kTileConfigs[l.tile];
  l.m_blocks = (p.seq.sq * l.pack + c.block_m - 1) / c.block_m;
  l.heads_grid = l.pack > 1 ? p.hkv : p.hq;
  l.work_tiles = l.m_blocks * l.heads_grid * p.seq.batch;
  l.key_blocks = std::max<int64_t>(1, (max_kv_rows(p) + c.block_n - 1) / c.block_n);
  l.splits = splits;
  l.batch = p.seq.batch;
  l.append = p.seq.snew > 0;
  l.rotary_q = p.rotary_dim > 0;
  l.ws = fwd_workspace(p, l.splits);
  l.ws_bytes = l.ws.total;
  return l;
}
inline AmdFwdLaunch amd_fwd_launch(const Problem& p, int64_t compute_units) {
  const TileId tile = tile_id_for(std::max(p.d, p.dv), false);
  const int pack = gqa_pack(p);
  const AmdFwdLaunch one = amd_fwd_shape(p, tile, pack, 1);
  return amd_fwd_shape(p, tile, pack,
                       resolve_num_splits(p.num_splits, one.work_tiles, one.key_blocks, compute_units, kMaxSplits));
}

// "" when the grid fits the launch limits; else why not.
inline std::string amd_grid_refusal(const AmdFwdLaunch& l) {
  if (l.m_blocks > 0x7fffffff || l.heads_grid > 65535 || l.batch * l.splits > 65535)
    return "grid too large (heads and batch * splits <= 65535)";
  return "";
}

// The append / rotary pre-pass arguments (l.append or l.rotary_q).
inline AppendArgs amd_append_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  return append_args_in(p, l.ws, workspace);
}

// The kernel arguments of a call over `workspace` (l.ws_bytes bytes, content anything on entry).
inline FwdArgs amd_fwd_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  return fwd_args_in(p, l.ws, l.pack, l.splits, workspace);
}

// The split-KV combine of the partials into out / lse (l.splits > 1).
inline MergeArgs amd_combine_args(const Problem& p, const AmdFwdLaunch& l, void* workspace) {
  return split_combine_args_in(p, amd_fwd_args(p, l, workspace));
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

// ---- the attention backward ---------------------------------------------------------------
// The shared mma.sync backward on the AMD rows of bwd_launch.hpp's tile table: the launch shape
// (tile, key blocks x kv heads x batch, query blocks), the workspace (bwd_workspace: lse2, dsum,
// fp32 dq accumulator, deterministic-mode semaphores) and the arguments are the CUDA plan's
// functions (bwd_layout, bwd_launch_args), read here with the AMD rows.
// "" when the backward runs the call on AMD; else why not (the CUDA plan's rules, by name).
inline std::string amd_bwd_refusal(const BwdProblem& bp) {
  const Problem& p = bp.fwd;
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "backward dtype must be float16 or bfloat16";
  if (!p.has_lse) return "lse: required by the backward";
  if (std::string why = bwd_shape_refusal(p); !why.empty()) return why;
  return bwd_grid_refusal(p, bwd_layout(bp).key_blocks);
}

// The plan's kernel string: "hip:<tile row>:<dtype>:<matrix unit>:<gfx arch>:<dQ mode>".
inline std::string amd_bwd_plan_name(const BwdProblem& bp, const BwdLayout& l, const char* unit, const char* arch) {
  return std::string("hip:") + kBwdTiles[l.tile].name + (bp.fwd.dtype == FP_BF16 ? ":bf16:" : ":fp16:") + unit + ":" +
         arch + (bp.deterministic ? ":deterministic" : ":atomic-dq");
}

// Grid of the main loop: key blocks x kv heads x batch (blocks of kBwdTiles[l.tile].threads(wave)).
struct AmdBwdGrid {
  unsigned x = 0, y = 0, z = 0;
};
inline AmdBwdGrid amd_bwd_grid(const BwdProblem& bp, const BwdLayout& l) {
  return {unsigned(l.key_blocks), unsigned(bp.fwd.hkv), unsigned(bp.fwd.seq.batch)};
}

FP_TARGET_NS_END
}  // namespace flashport::gpu
