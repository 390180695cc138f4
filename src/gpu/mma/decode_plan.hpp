// The decode kernel's planning rules (mma/decode_kernel.cuh), host-only and device-free so the
// CPU tests check them (tests/gpu/decode_plan_test.cpp): which calls it takes (or why not), its
// launch grid, work tiles and key tiles, the split count, the split counters it needs.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/heuristics.hpp"
#include "core/problem.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/common/tile_config.hpp"

namespace flashport::gpu {

#if defined(FP_TARGET_NVIDIA)
// The decode kernel's shape of a call: blocks (split, head, sequence), `heads` block heads (kv
// heads when GQA heads are packed, else query heads).
struct DecodeKernelShape {
  int pack = 1;
  int64_t heads = 0;       // blocks per sequence and split
  int64_t work_tiles = 0;  // (sequence, head) pairs: the blocks without splits, the split counters
  int64_t key_blocks = 0;  // key tiles of the longest sequence a call may address
};

inline DecodeKernelShape decode_kernel_shape(const Problem& p) {
  DecodeKernelShape s;
  s.pack = gqa_pack(p);
  s.heads = s.pack > 1 ? p.hkv : p.hq;
  s.work_tiles = s.heads * p.seq.batch;
  s.key_blocks = std::max<int64_t>(1, (max_kv_rows(p) + kDecodeTile.block_n - 1) / kDecodeTile.block_n);
  return s;
}

// Why the decode kernel does not take the call (the mma.sync tiles then do); empty: it does.
inline std::string decode_kernel_decline(const Problem& p) {
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "decode kernel: float16/bfloat16 only";
  if (p.d <= 64 || p.d > kDecodeTile.head_dim || p.dv <= 64 || p.dv > kDecodeTile.head_dim || p.d % 8 != 0 ||
      p.dv % 8 != 0)
    return "decode kernel: head dims 72..128 in multiples of 8 (its D128 instance; others run the mma.sync "
           "decode tiles)";
  const DecodeKernelShape s = decode_kernel_shape(p);
  if (p.seq.sq * s.pack > kDecodeTile.rows)
    return "decode kernel: Sq x packed GQA heads > " + std::to_string(kDecodeTile.rows) + " rows";
  if (p.rules.dropout_p > 0.0f)
    return "decode kernel: dropout (no decode use; the mma.sync decode tile runs it)";
  if (p.seq.batch > 65535 || s.heads > 65535) return "decode kernel: grid too large (batch, heads <= 65535)";
  return std::string();
}

// The split count on a device with `slots` resident blocks (SMs x blocks per SM): the decode
// rule of core/heuristics.hpp (choose_decode_splits) with no split below the ring's tiles in
// flight; a forced count at most kMaxSplits (the merge's partials).
inline int decode_kernel_splits(const Problem& p, int64_t slots) {
  const DecodeKernelShape s = decode_kernel_shape(p);
  return std::min(resolve_num_splits(p.num_splits, s.work_tiles, s.key_blocks, slots, kMaxSplits, true,
                                     kDecodeTile.stages - 1),
                  kMaxSplits);
}

// The workspace of a decode-kernel plan: rotated q, partials and one split counter per
// (sequence, head) when split.
inline FwdWorkspace decode_kernel_workspace(const Problem& p, int splits) {
  return fwd_workspace(p, splits, false, splits > 1 ? decode_kernel_shape(p).work_tiles : 0);
}
// The kernel stores and loads its partials 16 bytes at a time, and a caller's workspace has no
// alignment rule: the plan asks for 15 bytes more and the layout starts at the first 16-byte
// boundary of the caller's workspace.
inline constexpr size_t kDecodeWorkspaceAlign = 16;
inline size_t decode_kernel_workspace_bytes(const FwdWorkspace& w) {
  return w.total > 0 ? w.total + kDecodeWorkspaceAlign - 1 : 0;
}
inline void* decode_kernel_workspace_base(void* caller_workspace) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(caller_workspace);
  return reinterpret_cast<void*>((x + kDecodeWorkspaceAlign - 1) & ~uintptr_t(kDecodeWorkspaceAlign - 1));
}
#endif

}  // namespace flashport::gpu
