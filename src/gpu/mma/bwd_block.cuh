// The work of one backward block, device side: every backward kernel (mma.sync on CUDA and HIP,
// fp32, Hopper) is launched as (key block, kv head, batch) and walks the same steps.
#pragma once
#include "gpu/mma/bwd_launch.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

// The query blocks [m_lo, m_lo + nm) a key block walks, once per query head of the GQA group:
// steps = nm * group; step s is query head kvh group + s / nm, query block m_lo + s % nm.
struct BwdWalk {
  int m_lo = 0, nm = 0, steps = 0;
};

// This block's key block n_blk, whose keys are [n0, n0 + bn) (deterministic mode walks the key
// blocks in reverse launch order, so a block only waits for blocks launched before it: no deadlock
// whatever the residency), its kv head, its sequence (BwdSeq) and the sequence's score rules.
struct BwdBlock {
  int n_blk, kvh, b, n0;
  BwdSeq seq;
  KernelScoreRules rules;
  __device__ __forceinline__ BwdBlock(const BwdArgs& a, int bn)
      : n_blk(a.deterministic ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x)), kvh(blockIdx.y),
        b(blockIdx.z), n0(n_blk * bn), seq(a, b),
        rules(a.rules, seq.lq, seq.lk, a.scale_log2, a.softcap_in, a.softcap_out) {}
  // Whether a key of the block is inside the sequence and the sequence has a query: else the
  // block walks nothing.
  __device__ __forceinline__ bool has_walk() const { return n0 < seq.lk && seq.lq > 0; }
  // The query blocks (bm rows each) with a row that sees a key of the block (when has_walk()).
  // Kernels call both where their walk starts (computed in the constructor, they changed the
  // mma.sync kernel's schedule).
  __device__ __forceinline__ BwdWalk walk(const BwdArgs& a, int bn, int bm) const {
    const auto blocks = rules.query_blocks(n0, bn, bm);
    return {blocks.first, blocks.count, blocks.count * a.group};
  }
};

FP_TARGET_NS_END
}  // namespace flashport::gpu
