// The fp_attn_probs kernel (see probs_kernel.hpp): probs[b, h, i, j] = exp(s_ij - lse_i) over the
// visible keys, negated where dropout drops the element, 0 elsewhere. A testing aid: one thread per
// element (consecutive threads walk j), fp32 dot products; one instance (dtypes are runtime
// branches).
#include "gpu/common/probs_kernel.hpp"

#include "core/philox.hpp"
#include "gpu/common/tile_mma.hpp"

namespace flashport::gpu {
namespace {

constexpr int kProbsThreads = 256;

__device__ __forceinline__ float load_elem(const void* p, bool bf16, bool f32, int64_t i) {
  if (f32) return static_cast<const float*>(p)[i];
  return bf16 ? BFloat16::to_float(static_cast<const BFloat16::T*>(p)[i])
              : Half::to_float(static_cast<const Half::T*>(p)[i]);
}

__global__ void __launch_bounds__(kProbsThreads) probs_kernel(const FP_GRID_CONSTANT ProbsArgs a) {
  const SeqInfo& seq = a.seq;
  const ScoreRules& R = a.rules;
  const int64_t total = probs_elements(a);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % seq.sk;
    int64_t t = idx / seq.sk;
    const int64_t i = t % seq.sq;
    t /= seq.sq;
    const int64_t h = t % a.hq, b = t / a.hq;
    float val = 0.0f;
    int64_t lq = seq.q_len(b);
    if (lq > seq.sq) lq = seq.sq;  // clamp device-side lengths, don't fault
    int64_t lk = seq.k_len(b);
    if (a.k_rows_cap > 0 && lk > a.k_rows_cap - seq.k_pad(b)) lk = a.k_rows_cap - seq.k_pad(b);
    if (i < lq && j < lk) {
      // The forward's rules in natural-log units (lse is natural-log).
      const SeqScoreRules<int64_t, float> S(R, lq, lk, R.scale, a.softcap_in, a.softcap_out);
      if (j >= S.vis_lo(i) && j < S.vis_hi(i)) {
        const int64_t q0 = seq.q_start(b);
        const float lse = a.lse[a.lse_addr.at(b, q0, h, i)];
        if (lse != -INFINITY) {
          const int64_t qo = a.q_addr.at(b, q0, i, h);
          const int64_t ko = kv_key_offset(seq, a.k_addr, a.num_pages, b, j, h / a.group);
          float s = 0.0f;
          for (int x = 0; x < a.d; ++x) s += load_elem(a.q, a.bf16, a.f32, qo + x) * load_elem(a.k, a.bf16, a.f32, ko + x);
          s = S.score(s);
          if (S.alibi()) s += S.alibi_bias(-R.alibi_slope(b, h), i, j);
          val = expf(s - lse);
          if (R.has_dropout() &&
              !dropout_keep(R.rng_seed(), R.rng_offset(), R.dropout_threshold, b, a.hq, h, i, j))
            val = -val;
        }
      }
    }
    const int64_t o = b * a.probs_stride[0] + h * a.probs_stride[1] + i * a.probs_stride[2] +
                      j * a.probs_stride[3];
    if (a.probs_f32) static_cast<float*>(a.probs)[o] = val;
    else if (a.bf16) static_cast<BFloat16::T*>(a.probs)[o] = BFloat16::from_float(val);
    else static_cast<Half::T*>(a.probs)[o] = Half::from_float(val);
  }
}

}  // namespace

gpuError_t launch_probs(const ProbsArgs& a, gpuStream_t stream) {
  const int64_t total = probs_elements(a);
  if (total <= 0) return gpuSuccess;
  const int64_t blocks = (total + kProbsThreads - 1) / kProbsThreads;
  const unsigned grid = unsigned(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));  // grid-stride beyond
  probs_kernel<<<grid, kProbsThreads, 0, stream>>>(a);
  return gpuGetLastError();
}

}  // namespace flashport::gpu
