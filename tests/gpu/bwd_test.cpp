// CUDA backward against the fp64 reference backward: randomized shapes and every forward feature
// (causal both alignments, windows, softcap, ALiBi, sinks with d_sinks, dropout replay, varlen,
// strided tensors, KV cache with seqused_k, GQA, Dq != Dv, odd head dims), poisoned outputs,
// sentinels after every output buffer, NaN checks, and bit-identical repeats in deterministic
// mode. Both backends get the same inputs: out and lse are the reference forward's, rounded to
// the call's dtype (out) and float32 (lse). Skipped without a CUDA device.
#include <cuda_runtime.h>

#include "bwd_harness.hpp"
#include "scenarios.hpp"

namespace gputest {
namespace {

TEST(CudaBwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 32, 40, 96, 160, 200, 8}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {200, 77}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1;
      c.d = d, c.dv = d;
      c.sq = sq, c.sk = sk;
      check_bwd(c);
    }
  }
}

TEST(CudaBwd, ScalarPathForUnalignedHeadDims) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {3, 17, 250}) {
    Case c;
    c.dtype = rand_dtype();
    c.hq = 3, c.hkv = 3, c.d = d, c.dv = d, c.sq = 70, c.sk = 133;
    check_bwd(c);
  }
}

TEST(CudaBwd, DqDifferentFromDv) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : kDqDvPairs) {
    Case c = rand_dtype_case();
    set_dq_dv_case(c, d, dv);
    check_bwd(c);
  }
}

TEST(CudaBwd, GqaRatios) {
  SKIP_WITHOUT_GPU();
  for_each_gqa_case(rand_dtype_case, [](const Case& c) { check_bwd(c); });
}

TEST(CudaBwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for_each_causal_window_case(rand_dtype_case, [](const Case& c) { check_bwd(c); });
}

TEST(CudaBwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for_each_score_feature_case(rand_dtype_case, [](const Case& c) { check_bwd(c); });
}

TEST(CudaBwd, RowsWithoutKeys) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.hq = 2, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 200, c.sk = 50;
  c.causal = true;  // bottom-right: the first 150 rows see nothing (lse = -inf, dq = 0)
  check_bwd(c);
}

TEST(CudaBwd, DropoutReplayFromDeviceRngState) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 97, c.sk = 150;
  c.dropout = 0.3f, c.rng_on_device = true, c.causal = true;
  check_bwd(c);
}

TEST(CudaBwd, DropoutReplay) {
  SKIP_WITHOUT_GPU();
  for (float p : kDropoutRates) {
    for (int64_t d : {64, 128, 256}) {  // 256: the mma.sync tile's 2 query tiles a warp
      Case c = rand_dtype_case();
      set_dropout_bwd_case(c, d, p);
      check_bwd(c);
    }
  }
}

TEST(CudaBwd, StridedTensors) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 77, c.sk = 150;
  c.strided = true;
  check_bwd(c);
}

TEST(CudaBwd, Varlen) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 3; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.varlen = true;
    const int64_t nb = rand_int(1, 4);
    for (int64_t b = 0; b < nb; ++b) {
      c.lq.push_back(rand_int(0, 300));
      c.lk.push_back(rand_int(1, 300));
    }
    c.hq = 4, c.hkv = rand_int(0, 1) ? 4 : 1;
    c.d = rep == 2 ? 256 : 64 * (rep + 1), c.dv = c.d;
    c.causal = rand_int(0, 1), c.top_left = rand_int(0, 1);
    c.sinks = rand_int(0, 1);
    check_bwd(c);
  }
}

TEST(CudaBwd, KvCacheSeqused) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 20, c.sk = 300;
  c.cache = true;
  c.causal = true;  // rows past seqused_k[b] must get dk = dv = 0
  check_bwd(c);
}

TEST(CudaBwd, DeterministicIsBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 700, c.sk = 900;
    c.causal = d == 128;
    c.sinks = true;
    check_bwd(c, /*det=*/true, /*repeats=*/3);
    c.causal = false, c.wl = 200, c.wr = 30;  // windows: key blocks start at different q-blocks
    check_bwd(c, true, 2);
  }
}

TEST(CudaBwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 12; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = rand_int(1, 3);
    const int64_t ratios[] = {1, 2, 4};
    c.hkv = rand_int(1, 2);
    c.hq = c.hkv * ratios[rand_int(0, 2)];
    const int64_t dims[] = {16, 64, 80, 128, 192, 256};
    c.d = dims[rand_int(0, 5)];
    c.dv = rand_int(0, 3) == 0 ? dims[rand_int(0, 5)] : c.d;
    c.sq = rand_int(1, 400), c.sk = rand_int(1, 400);
    c.causal = rand_int(0, 1), c.top_left = rand_int(0, 1);
    if (!c.causal && rand_int(0, 2) == 0) c.wl = int32_t(rand_int(0, 100)), c.wr = int32_t(rand_int(0, 100));
    if (rand_int(0, 3) == 0) c.softcap = 20.0f;
    if (rand_int(0, 3) == 0) c.alibi = true;
    if (rand_int(0, 3) == 0) c.sinks = true;
    if (rand_int(0, 3) == 0) c.dropout = 0.2f;
    check_bwd(c, rand_int(0, 1) == 1);
  }
}

// The backward captured into a CUDA graph on the caller's non-blocking stream (no allocation, no
// sync, no host read inside the call) and replayed twice: bit-identical to a direct
// deterministic call (which also proves every output is rewritten by each replay's kernels).
TEST(CudaBwd, GraphCaptureOnCallerStream) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 300, c.sk = 300;
  c.causal = true, c.sinks = true;
  BwdCall bc(c);
  ASSERT_TRUE(bc.ok) << bc.error;
  DeviceBwd dev(bc);
  const BwdOutputs want = dev.run(bc, /*det=*/true);
  ASSERT_TRUE(want.ok) << want.error;
  BwdGraph g;
  ASSERT_NO_FATAL_FAILURE(capture_bwd(bc, dev, /*det=*/true, &g));
  for (int r = 0; r < 2; ++r) CUDA_OK(cudaGraphLaunch(g.exec, g.stream));
  CUDA_OK(cudaStreamSynchronize(g.stream));
  BwdOutputs got;
  dev.download_grads(&got);
  EXPECT_TRUE(got.dq.bitwise_equal(want.dq)) << "dq: graph replay differs from a direct call";
  EXPECT_TRUE(got.dk.bitwise_equal(want.dk)) << "dk: graph replay differs from a direct call";
  EXPECT_TRUE(got.dv.bitwise_equal(want.dv)) << "dv: graph replay differs from a direct call";
  EXPECT_TRUE(got.dsinks.bitwise_equal(want.dsinks)) << "d_sinks: graph replay differs from a direct call";
}

TEST(CudaBwd, PlanDeclinesWithReasons) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.hq = 2, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 8, c.sk = 8;
  BwdCall bc(c);
  ASSERT_TRUE(bc.ok);
  DeviceBwd dev(bc);
  fp_attn_bwd_params p = bc.params(dev.views, dev.dout_v, dev.dq_v, dev.dk_v, dev.dv_v, fp_tensor{},
                                   FP_BACKEND_CUDA, false);
  fp_selection sel{};
  ASSERT_EQ(fp_attn_bwd_select(&p, &sel), FP_OK) << fp_last_error();
  EXPECT_EQ(sel.backend, FP_BACKEND_CUDA);
  EXPECT_NE(std::string(sel.kernel).find("bwd_d64"), std::string::npos) << sel.kernel;
  EXPECT_GT(sel.workspace_bytes, 0u);
  p.fwd.workspace = nullptr, p.fwd.workspace_bytes = 0;
  EXPECT_EQ(fp_attn_bwd(&p), FP_ERR_WORKSPACE);
}

}  // namespace
}  // namespace gputest
