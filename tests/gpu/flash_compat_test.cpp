// flash_attn semantics on the CUDA backend, against the fp64 reference: causal = 1 intersected with
// a window (any window_right >= -1), left-padded KV caches (cache_leftpad: contiguous with and
// without cache_batch_idx, paged, append, rotary, GQA, split-KV, decode; device-resident pads are
// clamped), and fp_attn_probs (the probs kernel against the reference's probabilities).
#include <cuda_runtime.h>

#include <string>

#include "bwd_harness.hpp"
#include "gpu_harness.hpp"

namespace gputest {
namespace {

struct Window {
  int32_t wl, wr;
};
// The windows flash_attn clients pass with causal = True (transformers: (w - 1, w - 1)).
constexpr Window kCausalWindows[] = {{40, 40}, {40, 0}, {-1, 40}, {40, -1}};

TEST(CudaCausalWindow, Forward) {
  SKIP_WITHOUT_GPU();
  for (const Window w : kCausalWindows)
    for (bool tl : {false, true}) {
      Case c;
      c.dtype = rand_dtype();
      c.causal = true, c.top_left = tl, c.wl = w.wl, c.wr = w.wr;
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = c.dv = 128;  // the sm_90a kernel's shape on an H100
      c.sq = 150, c.sk = 211;
      check_case(c);
      c.sq = 211, c.sk = 97;  // Sq > Sk: rows without keys under bottom-right alignment
      check_case(c);
      Case v = c;  // varlen
      v.d = v.dv = 64;
      v.varlen = true, v.lq = {77, 1, 130}, v.lk = {90, 64, 130};
      check_case(v);
      Case k = c;  // paged decode, split-KV by the heuristic
      k.cache = true, k.paged = true, k.page_size = 16;
      k.batch = 3, k.sq = 1, k.sk = 640, k.hq = 8, k.hkv = 1, k.splits = 0;
      check_case(k);
      Case a = c;  // contiguous cache with cache_batch_idx, append and rotary
      a.cache = true, a.batch_idx = true, a.snew = 3, a.sq = 3, a.sk = 300, a.rot_dim = 32;
      check_case(a);
    }
}

TEST(CudaCausalWindow, Backward) {
  SKIP_WITHOUT_GPU();
  for (const Window w : kCausalWindows)
    for (bool tl : {false, true}) {
      Case c;
      c.dtype = rand_dtype();
      c.causal = true, c.top_left = tl, c.wl = w.wl, c.wr = w.wr;
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = c.dv = 128;  // the sm_90a backward's shape
      c.sq = 130, c.sk = 190;
      check_bwd(c);
      Case v = c;
      v.d = v.dv = 64;
      v.varlen = true, v.lq = {61, 1, 140}, v.lk = {80, 33, 140};
      check_bwd(v);
      Case s = c;  // seqused_k (a cache read) with dq/dk/dv
      s.d = s.dv = 96;
      s.sq = 40, s.sk = 160, s.cache = true, s.seqused = {100, 160};
      check_bwd(s);
    }
}

// ---- cache_leftpad ----------------------------------------------------------------------------

// A cache case with seqused_k and left pads: sequence 0 a pad inside its rows, 1 a pad equal to
// seqused_k (only appended keys, if any), 2 none.
Case leftpad_case(int64_t sk, int64_t snew) {
  Case c;
  c.dtype = rand_dtype();
  c.cache = true;
  c.batch = 3, c.hq = 8, c.hkv = 2, c.d = c.dv = 64;
  c.sq = 5, c.sk = sk, c.snew = snew;
  c.seqused = {sk - snew - 19, sk / 3, sk - snew};
  c.leftpad = {37, sk / 3, 0};
  return c;
}

TEST(CudaLeftpad, ContiguousCache) {
  SKIP_WITHOUT_GPU();
  for (bool batch_idx : {false, true}) {
    Case c = leftpad_case(300, 0);
    c.batch_idx = batch_idx;
    check_case(c);
    c.causal = true;
    check_case(c);
    c.top_left = true, c.wl = 30, c.wr = 30;
    check_case(c);
    Case g = leftpad_case(300, 0);  // features whose distances follow the unpadded keys
    g.batch_idx = batch_idx, g.alibi = true, g.alibi_per_batch = true, g.softcap = 20.0f, g.sinks = true;
    g.causal = true;
    check_case(g);
  }
}

TEST(CudaLeftpad, AppendAndRotary) {
  SKIP_WITHOUT_GPU();
  for (bool paged : {false, true})
    for (bool interleaved : {false, true}) {
      Case c = leftpad_case(256, 4);  // capacity a multiple of the page: rotary tables cover it
      c.paged = paged, c.page_size = 16, c.batch_idx = !paged;
      c.sq = 4, c.causal = true;
      check_case(c);  // append only
      c.rot_dim = 32, c.rot_interleaved = interleaved;
      check_case(c);
      c.causal = false;  // q rotated at seqused_k for every row
      check_case(c);
    }
}

TEST(CudaLeftpad, PagedCache) {
  SKIP_WITHOUT_GPU();
  for (int64_t page : {1, 16, 64, 100}) {
    Case c = leftpad_case(400, 0);
    c.paged = true, c.page_size = page, c.causal = true;
    check_case(c);
    c.wl = 50, c.wr = 0, c.alibi = true;
    check_case(c);
  }
}

TEST(CudaLeftpad, DecodeAndSplitKv) {
  SKIP_WITHOUT_GPU();
  for (bool paged : {false, true})
    for (int32_t splits : {0, 1, 3, 7}) {
      Case c = leftpad_case(1100, 1);
      c.paged = paged, c.page_size = 64, c.batch_idx = !paged;
      c.sq = 1, c.hq = 8, c.hkv = 1, c.splits = splits, c.sinks = true;
      check_case(c);  // GQA packed decode, append of one row
      Case g = c;
      g.hkv = 4, g.sq = 2, g.causal = true, g.snew = 2, g.seqused = {1100 - 2 - 19, 1100 / 3, 1100 - 2};
      check_case(g);
    }
}

// Pads in device memory are not value-checked: the kernels clamp them to [0, seqused_k] (what the
// reference computes with those clamped values), and nothing is read or written out of bounds.
TEST(CudaLeftpad, DeviceResidentPadsAreClamped) {
  SKIP_WITHOUT_GPU();
  for (bool paged : {false, true}) {
    Case c = leftpad_case(300, 2);
    c.paged = paged;
    c.causal = true;
    Call call(c);  // the clamped pads {37, seqused, 0}
    const Outputs ref = run_reference(call);
    ASSERT_TRUE(ref.ok) << ref.error;
    DeviceCall dev(call);
    const HostTensor bad = HostTensor::i32({3}, {37, int32_t(c.seqused[1]) + 1000, -5});
    dev.leftpad.upload(bad);  // same shape: the views stay valid
    dev.views.leftpad = dev.leftpad.view(bad);
    const Outputs got = run_cuda(call, dev);
    ASSERT_TRUE(got.ok) << got.error;
    const double tol = flashport::test::tolerance(c.dtype);
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false), gather_rows(call, ref.out, false), tol,
                                       "out"));
    EXPECT_TRUE(dev.out.sentinel_intact());
    EXPECT_TRUE(dev.k.sentinel_intact());
    EXPECT_TRUE(dev.v.sentinel_intact());
    EXPECT_TRUE(flashport::test::close(got.k.to_double(), ref.k.to_double(), tol, "k cache"));
  }
}

// ---- fp_attn_probs -------------------------------------------------------------------------------

// The CUDA probs of a call (after its CUDA forward, with that forward's LSE) against the reference's
// probs on fp64 copies of the same inputs and the same LSE.
void check_probs(const Case& cs, fp_dtype probs_dtype) {
  SCOPED_TRACE(cs.describe() + (probs_dtype == FP_F32 ? " probs fp32" : " probs in q's dtype"));
  ASSERT_EQ(cs.snew, 0) << "probs read the cache after the forward: no append in these cases";
  Call call(cs);
  DeviceCall dev(call);
  const Outputs fwd = run_cuda(call, dev);
  ASSERT_TRUE(fwd.ok) << fwd.error;
  const Case& c = call.c;
  const int64_t sk_max = c.paged ? call.max_blocks * c.page_size : c.sk;  // the cache capacity
  HostTensor probs(probs_dtype, {c.batch, c.hq, c.sq, sk_max});
  probs.fill_poison();
  DevBuf dprobs;
  dprobs.upload(probs);
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  p.out = fp_tensor{};  // not read
  const fp_status st = fp_attn_probs(&p, dprobs.view(probs));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  HostTensor got = probs;
  dprobs.download(got);
  EXPECT_TRUE(got.all_written());
  EXPECT_TRUE(dprobs.sentinel_intact()) << "write past the end of probs";

  // Reference: fp64 copies of q/k/v, the CUDA forward's fp32 LSE.
  HostTensor q = to_f64(call.q), k = to_f64(call.k), v = to_f64(call.v);
  Call::Views w{};
  w.q = q.view(), w.k = k.view(), w.v = v.view(), w.lse = fwd.lse.view();
  if (!call.cu_q.empty()) w.cu_q = call.cu_q.view(), w.cu_k = call.cu_k.view();
  if (!call.seqused.empty()) w.seqused = call.seqused.view();
  if (!call.block_table.empty()) w.block_table = call.block_table.view();
  if (!call.batch_idx.empty()) w.batch_idx = call.batch_idx.view();
  if (!call.leftpad.empty()) w.leftpad = call.leftpad.view();
  if (!call.alibi.empty()) w.alibi = call.alibi.view();
  if (!call.sinks.empty()) w.sinks = call.sinks.view();
  fp_attn_params pr = call.params(w, FP_BACKEND_REFERENCE);
  pr.out = fp_tensor{};
  HostTensor want(FP_F64, {c.batch, c.hq, c.sq, sk_max});
  want.fill_poison();
  ASSERT_EQ(fp_attn_probs(&pr, want.view()), FP_OK) << fp_last_error();

  const double tol = probs_dtype == FP_F32 ? 2e-4 : flashport::test::tolerance(probs_dtype);
  EXPECT_TRUE(flashport::test::close(got.to_double(), want.to_double(), tol, "probs"));
  // Dropped elements carry the sign exactly (the Philox rule is integer arithmetic).
  const auto g = got.to_double(), e = want.to_double();
  int64_t sign_mismatch = 0, negative = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    negative += e[i] < 0.0;
    if (std::fabs(e[i]) > 1e-6 && (g[i] < 0.0) != (e[i] < 0.0)) ++sign_mismatch;
  }
  EXPECT_EQ(sign_mismatch, 0);
  if (c.dropout > 0) EXPECT_GT(negative, 0);
}

TEST(CudaProbs, EqualsReference) {
  SKIP_WITHOUT_GPU();
  for (fp_dtype pd : {FP_F32, FP_BF16}) {
    Case c;
    c.dtype = pd == FP_F32 ? rand_dtype() : FP_BF16;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = c.dv = 64, c.sq = 70, c.sk = 133;
    c.causal = true, c.wl = 50, c.wr = 50, c.dropout = 0.25f, c.alibi = true, c.softcap = 15.0f;
    check_probs(c, pd);
    c.rng_on_device = true;  // (seed, offset) read by the kernel from dropout_rng
    check_probs(c, pd);
    Case s = c;
    s.rng_on_device = false, s.sinks = true, s.dropout = 0.0f, s.top_left = true, s.sq = 140, s.sk = 60;
    check_probs(s, pd);
    Case v;
    v.dtype = c.dtype, v.hq = 4, v.hkv = 1, v.d = v.dv = 80;
    v.varlen = true, v.lq = {33, 0, 70}, v.lk = {50, 20, 90}, v.causal = true, v.dropout = 0.1f;
    check_probs(v, pd);
    Case k = leftpad_case(200, 0);
    k.dtype = c.dtype, k.batch_idx = true, k.causal = true, k.wl = 20;
    check_probs(k, pd);
    k.batch_idx = false, k.paged = true, k.page_size = 16;
    check_probs(k, pd);
  }
}

}  // namespace
}  // namespace gputest
