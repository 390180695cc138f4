// GPU test harness: one Case describes a forward call (shapes, layout, every feature). It builds
// random fp16/bf16 inputs on the host, runs the fp64 reference backend on exact fp64 copies, runs
// the CUDA backend on device copies (outputs poisoned, sentinel bytes after every output buffer)
// through the public C API, copies back and compares.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashport/flashport.h"
#include "test_util.hpp"

namespace gputest {

using flashport::test::HostTensor;
using flashport::test::cumsum;
using flashport::test::to_f64;
using flashport::test::test_rng;

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU()                                   \
  do {                                                       \
    if (!::gputest::have_gpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define CUDA_OK(expr)                                                               \
  do {                                                                              \
    cudaError_t _e = (expr);                                                        \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);          \
  } while (0)

inline int64_t rand_int(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(test_rng());
}

// Device 0 is compute capability 9.0 (the sm_90a kernels' target).
inline bool device_is_sm90() {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) return false;
  return major == 9 && minor == 0;
}

// The sm_90a (Hopper) objects are in this build (tests/gpu/CMakeLists.txt defines the macro).
inline bool hopper_built() {
#if defined(FLASHPORT_TEST_HOPPER_BUILT)
  return true;
#else
  return false;
#endif
}

// (seed, offset) as the 32-bit words of fp_attn_params.dropout_rng: seed lo, seed hi, offset lo, hi.
inline std::vector<int32_t> rng_words(uint64_t seed, uint64_t offset) {
  auto w = [](uint64_t x, int hi) { return static_cast<int32_t>(static_cast<uint32_t>(x >> (32 * hi))); };
  return {w(seed, 0), w(seed, 1), w(offset, 0), w(offset, 1)};
}

// fp16 or bf16, at random: the CUDA backend's two dtypes.
inline fp_dtype rand_dtype() { return rand_int(0, 1) ? FP_BF16 : FP_F16; }

// A device copy of a host tensor's storage, followed by sentinel bytes.
struct DevBuf {
  static constexpr size_t kSentinel = 256;
  static constexpr unsigned char kPattern = 0xA5;
  void* ptr = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
  void upload(const HostTensor& t) {
    bytes = t.storage_bytes();
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    if (cudaMalloc(&ptr, bytes + kSentinel) != cudaSuccess) {
      ptr = nullptr;
      return;
    }
    cudaMemset(static_cast<char*>(ptr) + bytes, kPattern, kSentinel);
    if (bytes) cudaMemcpy(ptr, t.storage(), bytes, cudaMemcpyHostToDevice);
    // Both run on the legacy stream and may still be in flight when cudaMemcpy returns (the
    // memset always, a pageable copy's DMA too); the tests' own streams are non-blocking and
    // would not wait for them.
    cudaDeviceSynchronize();
  }
  void download(HostTensor& t) const {
    if (bytes) cudaMemcpy(t.storage(), ptr, bytes, cudaMemcpyDeviceToHost);
  }
  bool sentinel_intact() const {
    std::vector<unsigned char> tail(kSentinel);
    cudaMemcpy(tail.data(), static_cast<char*>(ptr) + bytes, kSentinel, cudaMemcpyDeviceToHost);
    return std::all_of(tail.begin(), tail.end(), [](unsigned char c) { return c == kPattern; });
  }
  fp_tensor view(const HostTensor& t) const { return t.view_at(ptr, FP_DEVICE_CUDA, 0); }
};

struct Case {
  fp_dtype dtype = FP_BF16;
  int64_t batch = 1, hq = 1, hkv = 1, d = 64, dv = 64, sq = 1, sk = 1;
  // varlen: per-sequence lengths (sq/sk become the maxima)
  bool varlen = false;
  std::vector<int64_t> lq, lk;
  bool causal = false, top_left = false;
  int32_t wl = -1, wr = -1;
  float softcap = 0.0f, dropout = 0.0f, scale = NAN;
  bool alibi = false, alibi_per_batch = false, sinks = false, lse = true, strided = false;
  bool strided_aligned = false;  // with strided: out (the backward's dout) rows padded by 8 elements, 16-byte strides
  // Backward: dk, dv in their own layout, rows padded by 2 elements (4-byte, not 16-byte, strides).
  bool grads_unaligned = false;
  int32_t splits = 1;
  // KV cache: contiguous (optionally cache_batch_idx) or paged; seqused_k per sequence; append.
  bool cache = false, paged = false, batch_idx = false;
  int64_t page_size = 16, snew = 0;
  // Paged pools: unused rows after each page (pages not back to back in the pool); with `strided`,
  // also 8 unused elements after each row of k and v.
  int64_t page_gap_rows = 0;
  std::vector<int64_t> seqused;
  std::vector<int64_t> leftpad;  // cache_leftpad per sequence (empty: none)
  int64_t rot_dim = 0;
  bool rot_interleaved = false;
  bool rot_tables_16bit = false;  // cos/sin in q's dtype (else fp32)
  bool odd_rows = false;          // cache call: q, k_new, v_new rows padded by one element (unaligned rows)
  bool rng_on_device = false;  // dropout (seed, offset) as the device tensor dropout_rng
  bool nan_unused_cache = false;  // cache rows no key of the call reads hold NaN
  double input_std = 1.0;

  std::string describe() const {
    std::string s = std::string(dtype == FP_BF16 ? "bf16" : "fp16") + " B=" + std::to_string(batch) +
                    " Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv) + " D=" +
                    std::to_string(d) + " Dv=" + std::to_string(dv) + " Sq=" + std::to_string(sq) +
                    " Sk=" + std::to_string(sk);
    if (varlen) s += " varlen";
    if (causal) s += top_left ? " causal(top-left)" : " causal";
    if (wl >= 0 || wr >= 0) s += " window(" + std::to_string(wl) + "," + std::to_string(wr) + ")";
    if (softcap > 0) s += " softcap=" + std::to_string(softcap);
    if (alibi) s += alibi_per_batch ? " alibi[B,H]" : " alibi";
    if (sinks) s += " sinks";
    if (dropout > 0) s += " dropout=" + std::to_string(dropout) + (rng_on_device ? "(rng on device)" : "");
    if (strided) s += strided_aligned ? " strided(16-byte)" : " strided";
    if (grads_unaligned) s += " dk/dv-rows+2";
    if (splits != 1) s += " splits=" + std::to_string(splits);
    if (cache) s += paged ? " paged(ps=" + std::to_string(page_size) + ")" : " cache";
    if (page_gap_rows > 0) s += " page_gap=" + std::to_string(page_gap_rows);
    if (batch_idx) s += " batch_idx";
    if (snew) s += " snew=" + std::to_string(snew);
    if (!leftpad.empty()) s += " leftpad";
    if (nan_unused_cache) s += " nan-unused-rows";
    if (rot_dim) s += " rotary=" + std::to_string(rot_dim) + (rot_interleaved ? "i" : "h") + (rot_tables_16bit ? "(16-bit tables)" : "");
    if (odd_rows) s += " odd-rows";
    return s;
  }
};

// Host tensors of one call (in the case's dtype), and the same call's parameters.
struct Call {
  Case c;
  HostTensor q, k, v, out, lse, cu_q, cu_k, seqused, block_table, batch_idx, k_new, v_new, cos,
      sin, alibi, sinks, rng, leftpad;
  int64_t max_blocks = 0;
  static constexpr uint64_t kSeed = 0x1234567887654321ull, kOffset = 99;

  explicit Call(const Case& cs) : c(cs) { build(); }

  void build() {
    const fp_dtype t = c.dtype;
    if (c.varlen) {
      c.batch = static_cast<int64_t>(c.lq.size());
      c.sq = *std::max_element(c.lq.begin(), c.lq.end());
      c.sk = *std::max_element(c.lk.begin(), c.lk.end());
      const auto cq = cumsum(c.lq), ck = cumsum(c.lk);
      q = HostTensor(t, {cq.back(), c.hq, c.d});
      k = HostTensor(t, {ck.back(), c.hkv, c.d});
      v = HostTensor(t, {ck.back(), c.hkv, c.dv});
      out = HostTensor(t, {cq.back(), c.hq, c.dv});
      lse = HostTensor(FP_F32, {c.hq, cq.back()});
      cu_q = HostTensor::i32({c.batch + 1}, cq);
      cu_k = HostTensor::i32({c.batch + 1}, ck);
    } else if (c.cache) {
      if (c.seqused.empty()) {
        for (int64_t b = 0; b < c.batch; ++b) c.seqused.push_back(rand_int(0, c.sk - c.snew));
      }
      std::vector<int32_t> su(c.seqused.begin(), c.seqused.end());
      seqused = HostTensor::i32({c.batch}, su);
      if (!c.leftpad.empty()) leftpad = HostTensor::i32({c.batch}, std::vector<int32_t>(c.leftpad.begin(), c.leftpad.end()));
      if (c.paged) {
        max_blocks = (c.sk + c.page_size - 1) / c.page_size;
        const int64_t pool = c.batch * max_blocks + 3;
        std::vector<int32_t> ids(pool);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), test_rng());
        ids.resize(c.batch * max_blocks);
        block_table = HostTensor::i32({c.batch, max_blocks}, ids);
        const std::vector<int64_t> pool_pad{0, c.page_gap_rows, 0, c.strided ? 8 : 0};
        k = HostTensor::padded(t, {pool, c.page_size, c.hkv, c.d}, pool_pad);
        v = HostTensor::padded(t, {pool, c.page_size, c.hkv, c.dv}, pool_pad);
      } else {
        const int64_t rows = c.batch_idx ? c.batch + 2 : c.batch;
        if (c.batch_idx) {
          std::vector<int32_t> perm(rows);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), test_rng());
          perm.resize(c.batch);
          batch_idx = HostTensor::i32({c.batch}, perm);
        }
        k = HostTensor(t, {rows, c.sk, c.hkv, c.d});
        v = HostTensor(t, {rows, c.sk, c.hkv, c.dv});
      }
      const std::vector<int64_t> row_pad{0, 0, 0, c.odd_rows ? 1 : 0};
      q = HostTensor::padded(t, {c.batch, c.sq, c.hq, c.d}, row_pad);
      out = HostTensor(t, {c.batch, c.sq, c.hq, c.dv});
      lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
      if (c.snew > 0) {
        k_new = HostTensor::padded(t, {c.batch, c.snew, c.hkv, c.d}, row_pad);
        v_new = HostTensor::padded(t, {c.batch, c.snew, c.hkv, c.dv}, row_pad);
        k_new.fill_normal(0.0, c.input_std);
        v_new.fill_normal();
      }
      if (c.rot_dim > 0) {
        const int64_t rows = c.sk + c.sq + 1;
        const fp_dtype table = c.rot_tables_16bit ? t : FP_F32;
        cos = HostTensor(table, {rows, c.rot_dim / 2});
        sin = HostTensor(table, {rows, c.rot_dim / 2});
        std::vector<double> cv, sv;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < c.rot_dim / 2; ++j) {
            const double ang = r * std::pow(10000.0, -2.0 * j / c.rot_dim);
            cv.push_back(std::cos(ang));
            sv.push_back(std::sin(ang));
          }
        cos.from_double(cv);
        sin.from_double(sv);
      }
    } else if (c.strided) {
      q = HostTensor::permuted(t, {c.batch, c.sq, c.hq, c.d}, {0, 2, 1, 3});
      k = HostTensor::padded(t, {c.batch, c.sk, c.hkv, c.d}, {0, 1, 0, 8});
      v = HostTensor::padded(t, {c.batch, c.sk, c.hkv, c.dv}, {1, 0, 8, 0});
      out = HostTensor::padded(t, {c.batch, c.sq, c.hq, c.dv}, {0, 0, 1, c.strided_aligned ? 8 : 2});
      lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
    } else {
      q = HostTensor(t, {c.batch, c.sq, c.hq, c.d});
      k = HostTensor(t, {c.batch, c.sk, c.hkv, c.d});
      v = HostTensor(t, {c.batch, c.sk, c.hkv, c.dv});
      out = HostTensor(t, {c.batch, c.sq, c.hq, c.dv});
      lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
    }
    q.fill_normal(0.0, c.input_std);
    k.fill_normal(0.0, c.input_std);
    v.fill_normal();
    out.fill_poison();
    lse.fill_poison();
    if (c.cache && c.nan_unused_cache) poison_unused_cache_rows();
    if (c.alibi) {
      alibi = c.alibi_per_batch ? HostTensor(FP_F32, {c.batch, c.hq}) : HostTensor(FP_F32, {c.hq});
      alibi.fill_uniform(0.01, 0.3);
    }
    if (c.sinks) {
      sinks = HostTensor(FP_F32, {c.hq});
      sinks.fill_uniform(-2.0, 3.0);
    }
    if (c.rng_on_device) rng = HostTensor::i32({4}, rng_words(kSeed, kOffset));
  }

  // NaN in every cache row no key of the call reads: before the left pad, past seqused + snew,
  // cache entries or pages the call does not reference. A kernel must never let them into P V
  // (0 x NaN = NaN), as serving engines leave such rows uninitialised.
  void poison_unused_cache_rows() {
    const int64_t rows_per_entry = c.paged ? c.page_size : c.sk, entries = k.dim(0);
    std::vector<char> used(size_t(entries * rows_per_entry), 0);
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t lo = c.leftpad.empty() ? 0 : c.leftpad[b], hi = c.seqused[b] + c.snew;
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t e = c.paged ? int64_t(block_table.at_linear(b * max_blocks + r / c.page_size))
                          : c.batch_idx ? int64_t(batch_idx.at_linear(b)) : b;
        used[size_t(e * rows_per_entry + (c.paged ? r % c.page_size : r))] = 1;
      }
    }
    for (int64_t e = 0; e < entries; ++e)
      for (int64_t r = 0; r < rows_per_entry; ++r) {
        if (used[size_t(e * rows_per_entry + r)]) continue;
        for (int64_t h = 0; h < c.hkv; ++h) {
          for (int64_t x = 0; x < c.d; ++x) k.set({e, r, h, x}, NAN);
          for (int64_t x = 0; x < c.dv; ++x) v.set({e, r, h, x}, NAN);
        }
      }
  }

  // Parameters over the given views (host fp64 copies for the reference, device copies for CUDA).
  struct Views {
    fp_tensor q, k, v, out, lse, cu_q, cu_k, seqused, block_table, batch_idx, k_new, v_new, cos,
        sin, alibi, sinks, rng, leftpad;
  };
  fp_attn_params params(const Views& w, fp_backend backend) const {
    fp_attn_params p;
    fp_attn_params_init(&p);
    p.backend = backend;
    p.q = w.q, p.k = w.k, p.v = w.v, p.out = w.out;
    if (c.lse) p.lse = w.lse;
    if (c.varlen) {
      p.cu_seqlens_q = w.cu_q, p.cu_seqlens_k = w.cu_k;
      p.max_seqlen_q = c.sq, p.max_seqlen_k = c.sk;
    }
    if (c.cache) {
      p.seqused_k = w.seqused;
      if (c.paged) p.block_table = w.block_table;
      if (c.batch_idx) p.cache_batch_idx = w.batch_idx;
      if (!c.leftpad.empty()) p.cache_leftpad = w.leftpad;
      if (c.snew > 0) p.k_new = w.k_new, p.v_new = w.v_new;
      if (c.rot_dim > 0) {
        p.rotary_cos = w.cos, p.rotary_sin = w.sin;
        p.rotary_interleaved = c.rot_interleaved;
      }
    }
    p.softmax_scale = c.scale;
    p.causal = c.causal;
    p.causal_align = c.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
    p.window_left = c.wl;
    p.window_right = c.wr;  // with causal: intersected (flash_attn)
    p.softcap = c.softcap;
    if (c.alibi) p.alibi_slopes = w.alibi;
    if (c.sinks) p.sinks = w.sinks;
    p.dropout_p = c.dropout;
    if (c.rng_on_device && w.rng.data) {
      p.dropout_rng = w.rng;  // the same (seed, offset), read by the kernels
    } else {
      p.dropout_seed = kSeed;
      p.dropout_offset = kOffset;
    }
    p.num_splits = c.splits;
    return p;
  }
};

struct Outputs {
  HostTensor out, lse, k, v;  // k/v: the cache after an append
  bool ok = false;
  std::string error;
  fp_selection sel{};
};

inline Outputs run_reference(const Call& call) {
  Outputs r;
  HostTensor q = to_f64(call.q), k = to_f64(call.k), v = to_f64(call.v), kn = to_f64(call.k_new),
             vn = to_f64(call.v_new);
  HostTensor out(FP_F64, call.out.shape()), lse(FP_F64, call.lse.shape());
  out.fill_poison();
  lse.fill_poison();
  Call::Views w{};
  w.q = q.view(), w.k = k.view(), w.v = v.view(), w.out = out.view(), w.lse = lse.view();
  if (!call.cu_q.empty()) w.cu_q = call.cu_q.view(), w.cu_k = call.cu_k.view();
  if (!call.seqused.empty()) w.seqused = call.seqused.view();
  if (!call.block_table.empty()) w.block_table = call.block_table.view();
  if (!call.batch_idx.empty()) w.batch_idx = call.batch_idx.view();
  if (!call.leftpad.empty()) w.leftpad = call.leftpad.view();
  if (!kn.empty()) w.k_new = kn.view(), w.v_new = vn.view();
  // 16-bit tables as exact fp64 copies (the reference takes fp32 tables or q's dtype).
  HostTensor cos = call.cos.dtype() == FP_F32 || call.cos.empty() ? call.cos : to_f64(call.cos),
             sin = call.sin.dtype() == FP_F32 || call.sin.empty() ? call.sin : to_f64(call.sin);
  if (!cos.empty()) w.cos = cos.view(), w.sin = sin.view();
  if (!call.alibi.empty()) w.alibi = call.alibi.view();
  if (!call.sinks.empty()) w.sinks = call.sinks.view();
  fp_attn_params p = call.params(w, FP_BACKEND_REFERENCE);
  p.num_splits = 0;
  const fp_status st = fp_attn_fwd(&p);
  r.ok = st == FP_OK;
  if (!r.ok) r.error = std::string("reference: ") + fp_status_name(st) + ": " + fp_last_error();
  r.out = std::move(out), r.lse = std::move(lse), r.k = std::move(k), r.v = std::move(v);
  return r;
}

// Device copies of every tensor of a call.
struct DeviceCall {
  DevBuf q, k, v, out, lse, cu_q, cu_k, seqused, block_table, batch_idx, k_new, v_new, cos, sin,
      alibi, sinks, rng, leftpad, workspace;
  Call::Views views{};
  size_t workspace_offset = 0;  // the call's workspace starts this many bytes into `workspace`

  explicit DeviceCall(const Call& c) {
    auto up = [](DevBuf& d, const HostTensor& t, fp_tensor& view) {
      if (t.empty()) return;
      d.upload(t);
      view = d.view(t);
    };
    up(q, c.q, views.q), up(k, c.k, views.k), up(v, c.v, views.v), up(out, c.out, views.out);
    up(lse, c.lse, views.lse), up(cu_q, c.cu_q, views.cu_q), up(cu_k, c.cu_k, views.cu_k);
    up(seqused, c.seqused, views.seqused), up(block_table, c.block_table, views.block_table);
    up(batch_idx, c.batch_idx, views.batch_idx), up(k_new, c.k_new, views.k_new);
    up(v_new, c.v_new, views.v_new), up(cos, c.cos, views.cos), up(sin, c.sin, views.sin);
    up(alibi, c.alibi, views.alibi), up(sinks, c.sinks, views.sinks), up(rng, c.rng, views.rng);
    up(leftpad, c.leftpad, views.leftpad);
  }

  // Selects, sizes the workspace (allocated here, outside the call) and runs on `stream`.
  fp_status run(const Call& c, fp_attn_params* p_out, cudaStream_t stream, fp_selection* sel) {
    fp_attn_params p = c.params(views, FP_BACKEND_CUDA);
    fp_status st = fp_attn_fwd_select(&p, sel);
    if (st != FP_OK) return st;
    if (sel->workspace_bytes + workspace_offset > workspace.bytes) {
      HostTensor dummy(FP_F32, {static_cast<int64_t>((sel->workspace_bytes + workspace_offset + 3) / 4)});
      workspace.upload(dummy);
    }
    p.workspace = static_cast<char*>(workspace.ptr) + workspace_offset;
    p.workspace_bytes = workspace.bytes - workspace_offset;
    p.stream = stream;
    if (p_out) *p_out = p;
    return fp_attn_fwd(&p);
  }
};

inline Outputs run_cuda(const Call& call, DeviceCall& dev) {
  Outputs r;
  const fp_status st = dev.run(call, nullptr, nullptr, &r.sel);
  const cudaError_t e = cudaDeviceSynchronize();
  r.ok = st == FP_OK && e == cudaSuccess;
  if (st != FP_OK) r.error = std::string("cuda: ") + fp_status_name(st) + ": " + fp_last_error();
  else if (e != cudaSuccess) r.error = std::string("cuda runtime: ") + cudaGetErrorString(e);
  r.out = call.out, r.lse = call.lse, r.k = call.k, r.v = call.v;
  if (r.ok) {
    dev.out.download(r.out);
    if (call.c.lse) dev.lse.download(r.lse);
    dev.k.download(r.k);
    dev.v.download(r.v);
  }
  return r;
}

// Captures the call into a CUDA graph on a fresh non-blocking stream, replays it twice and expects
// `want` (a direct call's output) bit for bit. The capture fails if the call allocates, synchronizes
// or reads device memory. garbage_workspace: the workspace holds 0xFF bytes before the capture (a
// call must not depend on what an earlier one left there).
inline void expect_graph_replay_equals(const Call& call, const Outputs& want, bool garbage_workspace) {
  DeviceCall dev(call);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fp_selection sel{};
  // Select once outside the capture to size the workspace, then capture the call itself.
  fp_attn_params p;
  ASSERT_EQ(dev.run(call, &p, stream, &sel), FP_OK) << fp_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  if (garbage_workspace) CUDA_OK(cudaMemset(dev.workspace.ptr, 0xFF, dev.workspace.bytes));
  dev.out.upload(call.out);  // poison again (synchronises)
  p.out = dev.out.view(call.out);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_fwd(&p);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  // Two replays, the output poisoned again before the second: a replay must redo every write (a
  // counter or flag the first one left behind must not make the second skip work).
  for (int r = 0; r < 2; ++r) {
    if (r > 0) {
      CUDA_OK(cudaStreamSynchronize(stream));
      dev.out.upload(call.out);
    }
    CUDA_OK(cudaGraphLaunch(exec, stream));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor got = call.out;
  dev.out.download(got);
  EXPECT_TRUE(got.bitwise_equal(want.out)) << "graph replay differs from a direct call";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Every element of out / lse that belongs to a query row, in logical order.
inline std::vector<double> gather_rows(const Call& c, const HostTensor& t, bool is_lse) {
  std::vector<double> r;
  const Case& cs = c.c;
  const auto cq = cs.varlen ? cumsum(cs.lq) : std::vector<int32_t>();
  for (int64_t b = 0; b < cs.batch; ++b) {
    const int64_t lq = cs.varlen ? cs.lq[b] : cs.sq;
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t h = 0; h < cs.hq; ++h) {
        if (is_lse) {
          r.push_back(cs.varlen ? t.get({h, cq[b] + i}) : t.get({b, h, i}));
        } else {
          for (int64_t d = 0; d < cs.dv; ++d)
            r.push_back(cs.varlen ? t.get({cq[b] + i, h, d}) : t.get({b, i, h, d}));
        }
      }
  }
  return r;
}

// Runs the case on both backends and checks: CUDA succeeded, every output element written and
// close to the reference, no NaN, sentinels after device outputs intact, cache rows appended.
inline void check_case(const Case& cs, fp_selection* sel_out = nullptr) {
  SCOPED_TRACE(cs.describe());
  Call call(cs);
  const Outputs ref = run_reference(call);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceCall dev(call);
  const Outputs got = run_cuda(call, dev);
  ASSERT_TRUE(got.ok) << got.error;
  SCOPED_TRACE(std::string("kernel ") + got.sel.kernel);
  if (sel_out) *sel_out = got.sel;
  const double tol = flashport::test::tolerance(cs.dtype);
  EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false),
                                     gather_rows(call, ref.out, false), tol, "out"));
  EXPECT_TRUE(got.out.all_written());
  EXPECT_TRUE(dev.out.sentinel_intact()) << "write past the end of out";
  if (cs.lse) {
    // With rotary the GPU stores the rotated k (and q) in the storage dtype, as any cache must;
    // the fp64 oracle keeps them exact, so scores differ by that rounding.
    const double lse_tol = cs.rot_dim > 0 ? tol / 4 : 1e-4;
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.lse, true),
                                       gather_rows(call, ref.lse, true), lse_tol, "lse"));
    EXPECT_TRUE(got.lse.all_written());
    EXPECT_TRUE(dev.lse.sentinel_intact()) << "write past the end of lse";
  }
  if (cs.snew > 0) {
    // A poisoned cache (nan_unused_cache) keeps NaN in the rows no key reads: the call must leave
    // them as they are (NaN in both), and close() counts NaN against NaN as a mismatch, so those
    // pairs compare as equal zeros here; a NaN on one side only still fails.
    auto check_cache = [&](const HostTensor& g, const HostTensor& r, const char* what) {
      std::vector<double> x = g.to_double(), y = r.to_double();
      if (cs.nan_unused_cache)
        for (size_t i = 0; i < x.size(); ++i)
          if (std::isnan(x[i]) && std::isnan(y[i])) x[i] = y[i] = 0.0;
      EXPECT_TRUE(flashport::test::close(x, y, tol, what));
    };
    check_cache(got.k, ref.k, "k cache");
    check_cache(got.v, ref.v, "v cache");
    EXPECT_TRUE(dev.k.sentinel_intact());
    EXPECT_TRUE(dev.v.sentinel_intact());
  }
}

}  // namespace gputest
