// The HIP backend's forward plan, host side: whether the shared forward main loop
// (fwd_kernel.cuh) can run a validated call on AMD with the hooks this backend has (or the reason
// not), which tile row and launch shape it takes, and its kernel arguments. Read by the HIP backend
// (hip_backend.hip) and by the CPU emulation test (tests/amd), so what is tested is what is
// launched. AMD rows of tile_config.hpp only (HIP host pass or the emulation).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "gpu_target.hpp"
#include "kernel_args.hpp"
#include "tile_config.hpp"

#if !defined(FP_TARGET_AMD)
#error "amd_plan.hpp is for the HIP build and the AMD emulation (AMD tile rows)"
#endif

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

// The launch of one call: tile row, packed GQA rows, grid (row blocks, heads, batch).
struct AmdFwdLaunch {
  TileId tile = kPrefill64;
  int pack = 1;            // query heads of a GQA group packed into the rows of a block
  int64_t m_blocks = 0;    // grid x
  int64_t heads_grid = 0;  // grid y: query heads, or kv heads when packed
  int64_t batch = 0;       // grid z (no split-KV on AMD)
};

// "" when the main loop runs the call on AMD; else why not. The features that need other kernels
// (the split-KV combine, the KV-cache append and rotary pre-pass: aux_kernels.cu) are not built
// for HIP yet, so calls that need them are declined rather than run without them.
inline std::string amd_fwd_refusal(const Problem& p) {
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "dtype must be float16 or bfloat16";
  if (p.has_lse && p.lse_dtype != FP_F32) return "lse must be float32";
  if (std::max(p.d, p.dv) > 256) return "head dim > 256";
  if (p.num_splits >= 2)
    return "split-KV needs the combine kernel, which is not built for HIP yet (num_splits must be 0 or 1)";
  if (p.seq.snew > 0 || p.rotary_dim > 0)
    return "KV-cache append / rotary needs the append kernel, which is not built for HIP yet";
  return "";
}

// Same packing rule as the CUDA plan: the query heads of a GQA group become rows of one block
// when the call is decode-shaped (Sq * group <= 128), so K/V are read once per group.
inline AmdFwdLaunch amd_fwd_launch(const Problem& p) {
  AmdFwdLaunch l;
  l.tile = tile_id_for(std::max(p.d, p.dv), false);
  l.pack = (p.group > 1 && p.seq.sq * p.group <= 128) ? static_cast<int>(p.group) : 1;
  const TileConfig& c = kTileConfigs[l.tile];
  l.m_blocks = (p.seq.sq * l.pack + c.block_m - 1) / c.block_m;
  l.heads_grid = l.pack > 1 ? p.hkv : p.hq;
  l.batch = p.seq.batch;
  return l;
}

// "" when the grid fits the launch limits; else why not.
inline std::string amd_grid_refusal(const AmdFwdLaunch& l) {
  if (l.m_blocks > 0x7fffffff || l.heads_grid > 65535 || l.batch > 65535)
    return "grid too large (heads and batch <= 65535)";
  return "";
}

// The kernel arguments of a call (the CUDA backend builds the same fields in run_fwd).
inline FwdArgs amd_fwd_args(const Problem& p, const AmdFwdLaunch& l) {
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto mult8 = [](int64_t x) { return (x & 7) == 0; };
  FwdArgs a;
  a.q = static_cast<const uint16_t*>(p.q_ptr);
  a.k = static_cast<const uint16_t*>(p.k_ptr);
  a.v = static_cast<const uint16_t*>(p.v_ptr);
  a.out = p.out_ptr;
  a.lse = p.has_lse ? static_cast<float*>(p.lse_ptr) : nullptr;
  a.seq = p.seq;
  a.q_addr = p.q;
  a.out_addr = p.out;
  a.k_addr = p.k;
  a.v_addr = p.v;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.k_rows_cap = p.seq.kv_layout == KvLayout::Batched ? p.seq.sk
                 : p.seq.kv_layout == KvLayout::Paged ? p.seq.max_blocks * p.seq.page_size : 0;
  a.num_pages = p.seq.kv_layout == KvLayout::Paged ? p.raw->k.shape[0] : 0;
  a.hq = int32_t(p.hq), a.hkv = int32_t(p.hkv), a.d = int32_t(p.d), a.dv = int32_t(p.dv);
  a.group = int32_t(p.group);
  a.pack = l.pack;
  a.splits = 1;
  a.scale_log2 = p.rules.scale * 1.4426950408889634f;
  if (p.rules.softcap > 0.0f) {
    a.softcap_in = p.rules.scale / p.rules.softcap;
    a.softcap_out = p.rules.softcap * 1.4426950408889634f;
  }
  a.vec_ok = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && mult8(p.q.row_stride) &&
             mult8(p.q.head_stride) && mult8(p.q.batch_stride) && mult8(p.k.s0) && mult8(p.k.s1) &&
             mult8(p.k.s2) && mult8(p.v.s0) && mult8(p.v.s1) && mult8(p.v.s2);
  a.out_vec_ok = (reinterpret_cast<uintptr_t>(a.out) & 3) == 0 && (p.out.row_stride & 1) == 0 &&
                 (p.out.head_stride & 1) == 0 && (p.out.batch_stride & 1) == 0;
  return a;
}

FP_TARGET_NS_END
}  // namespace flashport::gpu
