// CUDA float32 (src/gpu/f32: SIMT FFMA forward and backward) against the fp64 reference: every
// feature the 16-bit kernels take (batched/varlen, GQA/MQA, causal both alignments, windows,
// softcap, ALiBi, sinks, LSE, dropout, split-KV, KV cache contiguous/paged/cache_batch_idx/
// cache_leftpad/seqused_k, append + rotary, head dims 1..256, Dq != Dv), forward and backward,
// through the shared harnesses (fresh random inputs, poisoned outputs, sentinels, NaN checks) with
// the fp32 tolerances of test_util; and the error measured against an fp32 computation on the CPU
// (the fp32-rounding claim). Skipped without a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "bwd_harness.hpp"

namespace gputest {
namespace {

Case f32_case() {
  Case c;
  c.dtype = FP_F32;
  return c;
}

void check_f32(const Case& c) {
  SCOPED_TRACE("fp32");
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_NE(std::string(sel.kernel).find("f32_simt"), std::string::npos) << sel.kernel;
}

void check_f32_bwd(const Case& c, bool det = false, int repeats = 1) {
  SCOPED_TRACE("fp32");
  fp_selection sel{};
  check_bwd(c, det, repeats, &sel);
  EXPECT_NE(std::string(sel.kernel).find("f32_simt_bwd"), std::string::npos) << sel.kernel;
}

// ---- forward ---------------------------------------------------------------------------------

TEST(CudaF32Fwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 1, 8, 32, 40, 96, 160, 200, 255}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {200, 77}}) {
      Case c = f32_case();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, DqDifferentFromDvAndGqa) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{64, 32}, {128, 64}, {40, 200}, {192, 128}, {256, 8}, {3, 77}}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 100, c.sk = 300;
    c.causal = rand_int(0, 1);
    check_f32(c);
  }
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}, {12, 3}}) {
    Case c = f32_case();
    c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = 128, c.dv = 128, c.sq = rand_int(1, 300), c.sk = 517;
    c.causal = rand_int(0, 1);
    check_f32(c);
  }
}

TEST(CudaF32Fwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for (bool top_left : {false, true}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{300, 300}, {100, 400}, {400, 100}, {1, 64}, {65, 1}}) {
      Case c = f32_case();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = sq, c.sk = sk;
      c.causal = true, c.top_left = top_left;
      check_f32(c);
      c.wl = static_cast<int32_t>(rand_int(0, 70));  // causal ∧ window
      check_f32(c);
      c.causal = false;
      c.wr = static_cast<int32_t>(rand_int(-1, 40));
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case base = f32_case();
    base.batch = 2, base.hq = 4, base.hkv = 2, base.d = d, base.dv = d, base.sq = 150, base.sk = 333;
    Case c = base;
    c.softcap = 30.0f, c.input_std = 3.0;
    check_f32(c);
    c = base;
    c.alibi = true, c.causal = true;
    check_f32(c);
    c = base;
    c.alibi = true, c.alibi_per_batch = true;
    check_f32(c);
    c = base;
    c.sinks = true;
    check_f32(c);
    c = base;
    c.sinks = true, c.causal = true, c.sq = 400, c.sk = 100;  // rows with no key: sink only
    check_f32(c);
    c = base;
    c.scale = 0.3f;
    c.softcap = 5.0f, c.alibi = true, c.sinks = true, c.causal = true, c.wl = 50;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, RowsWithoutKeysGetZeroAndMinusInf) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.hq = 2, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 200, c.sk = 50;
  c.causal = true;  // bottom-right: the first 150 rows see nothing
  check_f32(c);
}

TEST(CudaF32Fwd, Dropout) {
  SKIP_WITHOUT_GPU();
  for (float p : {0.1f, 0.5f}) {
    for (int64_t d : {64, 128, 256}) {
      Case c = f32_case();
      c.batch = 2, c.hq = 4, c.hkv = 1, c.d = d, c.dv = d, c.sq = 131, c.sk = 257, c.dropout = p;
      c.causal = d == 128;
      check_f32(c);
      c.sq = 1;
      c.rng_on_device = true;
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, NoLseAndStridedTensors) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 90, c.sk = 200;
  c.lse = false;
  check_f32(c);
  c.lse = true;
  c.strided = true;
  check_f32(c);
  c.d = 40, c.dv = 40;
  check_f32(c);
}

TEST(CudaF32Fwd, VarlenAndSplitKv) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 4; ++rep) {
    Case c = f32_case();
    c.varlen = true;
    const int64_t nb = rand_int(1, 5);
    for (int64_t b = 0; b < nb; ++b) {
      c.lq.push_back(rand_int(1, 300));
      c.lk.push_back(rand_int(1, 400));
    }
    c.hq = 4, c.hkv = rep % 2 ? 1 : 4, c.d = rep < 2 ? 64 : 128, c.dv = c.d;
    c.causal = rep & 1;
    c.sinks = rep == 3;
    c.alibi = rep == 2;
    check_f32(c);
    c.splits = 3;
    check_f32(c);
  }
  for (int32_t s : {0, 2, 7, 64}) {
    Case c = f32_case();
    c.batch = 1, c.hq = 4, c.hkv = 4, c.d = 64, c.dv = 64, c.sq = 70, c.sk = 3000, c.splits = s;
    c.causal = s == 7;
    c.sinks = s == 7;
    c.dropout = s == 2 ? 0.2f : 0.0f;
    fp_selection sel{};
    check_case(c, &sel);
    if (s >= 2) EXPECT_GT(sel.num_splits, 1) << sel.kernel;
  }
  // Decode shape: one query row, auto splits.
  Case c = f32_case();
  c.batch = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 8192, c.splits = 0;
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_GT(sel.num_splits, 1) << sel.kernel;
}

TEST(CudaF32Fwd, KvCacheContiguousPagedLeftPad) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 4; ++rep) {
    Case c = f32_case();
    c.cache = true;
    c.batch = 3, c.hq = 8, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = rep < 2 ? 1 : 33, c.sk = 700;
    c.batch_idx = rep % 2;
    c.causal = rep >= 2;
    c.nan_unused_cache = true;
    check_f32(c);
  }
  for (int64_t ps : {1, 7, 16, 64, 256}) {
    Case c = f32_case();
    c.cache = true, c.paged = true, c.page_size = ps;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = ps == 7 ? 20 : 1, c.sk = 600;
    c.causal = true;
    c.nan_unused_cache = true;
    check_f32(c);
  }
  for (bool paged : {false, true}) {
    Case c = f32_case();
    c.cache = true, c.paged = paged, c.page_size = 16;
    c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 5, c.sk = 300;
    c.seqused = {120, 300, 17};
    c.leftpad = {10, 0, 17};  // the last sequence: no keys left
    c.causal = true;
    c.nan_unused_cache = true;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, AppendThenAttendWithRotary) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 6; ++rep) {
    Case c = f32_case();
    c.cache = true;
    c.paged = rep >= 3;
    c.page_size = 16;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sk = 400;
    c.snew = rep % 3 == 0 ? 1 : 5;
    c.sq = c.snew;
    c.causal = rep % 2 == 0;
    c.rot_dim = rep == 0 ? 0 : (rep % 2 ? 64 : 32);
    c.rot_interleaved = rep % 3 == 1;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 24; ++rep) {
    Case c = f32_case();
    const int64_t groups[] = {1, 2, 4, 8};
    c.hkv = rand_int(1, 3);
    c.hq = c.hkv * groups[rand_int(0, 3)];
    c.batch = rand_int(1, 3);
    c.d = rand_int(1, 256);
    c.dv = rand_int(0, 1) ? c.d : rand_int(1, 256);
    c.sq = rand_int(0, 1) ? rand_int(1, 8) : rand_int(1, 600);
    c.sk = rand_int(1, 900);
    c.causal = rand_int(0, 2) == 0;
    c.top_left = rand_int(0, 1);
    if (rand_int(0, 3) == 0) c.wl = static_cast<int32_t>(rand_int(0, 100));
    if (rand_int(0, 4) == 0) c.softcap = 20.0f;
    c.alibi = rand_int(0, 4) == 0;
    c.sinks = rand_int(0, 4) == 0;
    if (rand_int(0, 4) == 0) c.dropout = 0.25f;
    c.lse = rand_int(0, 5) != 0;
    c.splits = rand_int(0, 3) == 0 ? 0 : 1;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, GraphCaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.batch = 1, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 4000, c.splits = 0;
  Call call(c);
  DeviceCall dev(call);
  const Outputs got = run_cuda(call, dev);
  ASSERT_TRUE(got.ok) << got.error;
  expect_graph_replay_equals(call, got, /*garbage_workspace=*/true);
}

// The error is that of an fp32 computation: the GPU's relative error against the fp64 reference is
// within 8x the CPU backend's fp32 error on the same inputs, or below 4e-7 (~3 ulp of fp32; a
// single-pass TF32 product would be ~1e-4, fp16 ~1e-3). Both errors are printed.
TEST(CudaF32Fwd, ErrorIsFp32Rounding) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 1500;
    c.causal = d == 128;
    c.softcap = d == 256 ? 30.0f : 0.0f;
    SCOPED_TRACE(c.describe());
    Call call(c);
    const Outputs ref = run_reference(call);
    ASSERT_TRUE(ref.ok) << ref.error;
    DeviceCall dev(call);
    const Outputs got = run_cuda(call, dev);
    ASSERT_TRUE(got.ok) << got.error;
    // The CPU backend's fp32 result on the same host inputs.
    HostTensor cpu_out = call.out, cpu_lse = call.lse;
    Call::Views w{};
    w.q = call.q.view(), w.k = call.k.view(), w.v = call.v.view(), w.out = cpu_out.view(), w.lse = cpu_lse.view();
    if (!call.sinks.empty()) w.sinks = call.sinks.view();
    fp_attn_params p = call.params(w, FP_BACKEND_CPU);
    ASSERT_EQ(fp_attn_fwd(&p), FP_OK) << fp_last_error();
    const auto want = gather_rows(call, ref.out, false);
    const double gpu_err = flashport::test::compare(gather_rows(call, got.out, false), want).rel_err;
    const double cpu_err = flashport::test::compare(gather_rows(call, cpu_out, false), want).rel_err;
    std::printf("fp32 D=%lld: relative error vs fp64: cuda %.3g, cpu fp32 %.3g\n", static_cast<long long>(d),
                gpu_err, cpu_err);
    EXPECT_LE(gpu_err, std::max(8.0 * cpu_err, 4e-7)) << "cuda " << gpu_err << " vs cpu fp32 " << cpu_err;
  }
}

TEST(CudaF32Plan, Float64DeclinedWithReason) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_F64;
  Call call(c);
  DeviceCall dev(call);
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd_select(&p, &sel), FP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(fp_last_error()).find("float64"), std::string::npos) << fp_last_error();
}

// ---- backward --------------------------------------------------------------------------------

TEST(CudaF32Bwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 1, 8, 40, 96, 200}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}}) {
      Case c = f32_case();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
      check_f32_bwd(c);
    }
  }
}

TEST(CudaF32Bwd, DqDifferentFromDvAndGqa) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{64, 32}, {128, 64}, {40, 200}, {192, 128}, {256, 8}}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 100, c.sk = 300;
    c.causal = rand_int(0, 1);
    check_f32_bwd(c);
  }
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}, {12, 3}}) {
    Case c = f32_case();
    c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = 128, c.dv = 128, c.sq = rand_int(1, 300), c.sk = 517;
    c.causal = rand_int(0, 1);
    check_f32_bwd(c);
  }
}

TEST(CudaF32Bwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for (bool top_left : {false, true}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{300, 300}, {100, 400}, {400, 100}, {1, 64}, {65, 1}}) {
      Case c = f32_case();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = sq, c.sk = sk;
      c.causal = true, c.top_left = top_left;
      check_f32_bwd(c);
      c.causal = false;
      c.wl = static_cast<int32_t>(rand_int(0, 70)), c.wr = static_cast<int32_t>(rand_int(-1, 40));
      check_f32_bwd(c);
      c.wr = 0;
      check_f32_bwd(c);
    }
  }
}

TEST(CudaF32Bwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case base = f32_case();
    base.batch = 2, base.hq = 4, base.hkv = 2, base.d = d, base.dv = d, base.sq = 150, base.sk = 333;
    Case c = base;
    c.softcap = 30.0f, c.input_std = 3.0;
    check_f32_bwd(c);
    c = base;
    c.alibi = true, c.causal = true;
    check_f32_bwd(c);
    c = base;
    c.alibi = true, c.alibi_per_batch = true;
    check_f32_bwd(c);
    c = base;
    c.sinks = true;
    check_f32_bwd(c);
    c = base;
    c.sinks = true, c.causal = true, c.sq = 400, c.sk = 100;  // rows with no key
    check_f32_bwd(c);
    c = base;
    c.scale = 0.3f;
    c.softcap = 5.0f, c.alibi = true, c.sinks = true, c.causal = true, c.wl = 50;
    check_f32_bwd(c);
  }
}

TEST(CudaF32Bwd, DropoutReplay) {
  SKIP_WITHOUT_GPU();
  for (float p : {0.1f, 0.5f}) {
    for (int64_t d : {64, 128, 256}) {
      Case c = f32_case();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 130, c.sk = 260;
      c.dropout = p;
      c.causal = rand_int(0, 1);
      c.rng_on_device = d == 128;
      check_f32_bwd(c);
    }
  }
}

TEST(CudaF32Bwd, StridedVarlenAndKvCache) {
  SKIP_WITHOUT_GPU();
  {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 77, c.sk = 150;
    c.strided = true;
    check_f32_bwd(c);
  }
  for (int rep = 0; rep < 3; ++rep) {
    Case c = f32_case();
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
    check_f32_bwd(c);
  }
  {
    Case c = f32_case();
    c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 20, c.sk = 300;
    c.cache = true;
    c.causal = true;  // rows past seqused_k[b] get dk = dv = 0
    check_f32_bwd(c);
  }
}

TEST(CudaF32Bwd, DeterministicIsBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 700, c.sk = 900;
    c.causal = d == 128;
    c.sinks = true;
    check_f32_bwd(c, /*det=*/true, /*repeats=*/3);
    c.causal = false, c.wl = 200, c.wr = 30;
    check_f32_bwd(c, true, 2);
  }
}

TEST(CudaF32Bwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 12; ++rep) {
    Case c = f32_case();
    c.batch = rand_int(1, 3);
    const int64_t ratios[] = {1, 2, 4};
    c.hkv = rand_int(1, 2);
    c.hq = c.hkv * ratios[rand_int(0, 2)];
    c.d = rand_int(1, 256);
    c.dv = rand_int(0, 1) ? c.d : rand_int(1, 256);
    c.sq = rand_int(1, 400);
    c.sk = rand_int(1, 500);
    c.causal = rand_int(0, 1);
    c.top_left = rand_int(0, 1);
    if (rand_int(0, 3) == 0) c.wl = static_cast<int32_t>(rand_int(0, 100));
    if (rand_int(0, 4) == 0) c.softcap = 20.0f;
    c.alibi = rand_int(0, 4) == 0;
    c.sinks = rand_int(0, 4) == 0;
    if (rand_int(0, 4) == 0) c.dropout = 0.25f;
    check_f32_bwd(c, /*det=*/rand_int(0, 3) == 0);
  }
}

}  // namespace
}  // namespace gputest
