// Test harness of the reference suite: builds calls through the public C API with
// backend = FP_BACKEND_REFERENCE from a refdense::Spec, with poisoned outputs, and exposes
// the tensors to the naive dense implementation.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "dense.hpp"
#include "flashport/flashport.h"
#include "test_util.hpp"

namespace reftest {

using flashport::test::HostTensor;
using flashport::test::test_rng;

inline fp_attn_params ref_params() {
  fp_attn_params p;
  fp_attn_params_init(&p);
  p.backend = FP_BACKEND_REFERENCE;
  return p;
}

inline ::testing::AssertionResult call_ok(fp_status st, const char* what) {
  if (st == FP_OK) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " failed: " << fp_status_name(st) << ": "
                                       << fp_last_error();
}

#define FWD_OK(p) call_ok(fp_attn_fwd(&(p)), "fp_attn_fwd")
#define BWD_OK(p) call_ok(fp_attn_bwd(&(p)), "fp_attn_bwd")

// Getter over a batched [B, S, H, D] tensor.
inline refdense::Getter batched_getter(const HostTensor& t) {
  return [&t](int64_t b, int64_t r, int64_t h, int64_t d) { return t.get({b, r, h, d}); };
}
// Getter over a packed [T, H, D] tensor with cu_seqlens starts.
inline refdense::Getter packed_getter(const HostTensor& t, std::vector<int64_t> starts) {
  return [&t, starts](int64_t b, int64_t r, int64_t h, int64_t d) {
    return t.get({starts[b] + r, h, d});
  };
}

// The scale a NaN softmax_scale resolves to: 1/sqrt(D) as a float (the C struct's scalar type).
inline double default_scale_of(int64_t d) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
}

inline int64_t rand_int(int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(test_rng());
}
inline double rand_uniform(double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(test_rng());
}

// A batched forward call described by a Spec (lq/lk all equal to sq/sk).
struct BatchedCall {
  refdense::Spec spec;
  fp_dtype dtype = FP_F64;
  fp_dtype lse_dtype = FP_F64;
  int32_t num_splits = 1;
  bool default_scale = false;  // pass NaN, expect 1/sqrt(D)
  bool strided = false;        // q as a [B,H,S,D]-memory view, k/v/out with padded rows
  int64_t sq = 1, sk = 1;
  HostTensor q, k, v, out, lse, alibi, sinks;

  // Sizes and modifiers must be set in spec (batch, hq, hkv, d, dv, score rules) first.
  void make(int64_t sq_, int64_t sk_, double input_std = 1.0) {
    sq = sq_;
    sk = sk_;
    refdense::Spec& s = spec;
    s.lq.assign(s.batch, sq);
    s.lk.assign(s.batch, sk);
    if (strided) {
      q = HostTensor::permuted(dtype, {s.batch, sq, s.hq, s.d}, {0, 2, 1, 3});
      k = HostTensor::padded(dtype, {s.batch, sk, s.hkv, s.d}, {0, 1, 0, 3});
      v = HostTensor::padded(dtype, {s.batch, sk, s.hkv, s.dv}, {1, 0, 2, 0});
      out = HostTensor::padded(dtype, {s.batch, sq, s.hq, s.dv}, {0, 0, 1, 2});
    } else {
      q = HostTensor(dtype, {s.batch, sq, s.hq, s.d});
      k = HostTensor(dtype, {s.batch, sk, s.hkv, s.d});
      v = HostTensor(dtype, {s.batch, sk, s.hkv, s.dv});
      out = HostTensor(dtype, {s.batch, sq, s.hq, s.dv});
    }
    q.fill_normal(0.0, input_std);
    k.fill_normal(0.0, input_std);
    v.fill_normal();
    out.fill_poison();
    lse = HostTensor(lse_dtype, {s.batch, s.hq, sq});
    lse.fill_poison();
    // Scalars pass through float in the C struct; the Spec holds the float values.
    if (default_scale) s.scale = default_scale_of(s.d);
    else s.scale = static_cast<float>(s.scale);
    s.softcap = static_cast<float>(s.softcap);
    if (!s.alibi.empty()) {
      alibi = s.alibi_per_batch ? HostTensor(FP_F32, {s.batch, s.hq}) : HostTensor(FP_F32, {s.hq});
      alibi.from_double(s.alibi);
      s.alibi = alibi.to_double();
    }
    if (!s.sinks.empty()) {
      sinks = HostTensor(FP_F32, {s.hq});
      sinks.from_double(s.sinks);
      s.sinks = sinks.to_double();
    }
  }

  fp_attn_params params() const {
    fp_attn_params p = ref_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.softmax_scale = default_scale ? NAN : static_cast<float>(spec.scale);
    p.causal = spec.causal ? 1 : 0;
    p.causal_align = spec.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
    p.window_left = static_cast<int32_t>(spec.window_left);
    p.window_right = static_cast<int32_t>(spec.window_right);  // with causal: intersected
    p.softcap = static_cast<float>(spec.softcap);
    if (!alibi.empty()) p.alibi_slopes = alibi.view();
    if (!sinks.empty()) p.sinks = sinks.view();
    p.dropout_p = spec.dropout_p;
    p.dropout_seed = spec.seed;
    p.dropout_offset = spec.offset;
    p.num_splits = num_splits;
    return p;
  }

  refdense::Result dense() const {
    return refdense::forward(spec, batched_getter(q), batched_getter(k), batched_getter(v));
  }
};

// Random positive slopes / sink logits.
inline std::vector<double> random_vec(int64_t n, double lo, double hi) {
  std::vector<double> r(n);
  for (double& x : r) x = rand_uniform(lo, hi);
  return r;
}

}  // namespace reftest
