// CUDA backward against the fp64 reference backward: randomized shapes and every forward feature
// (causal both alignments, windows, softcap, ALiBi, sinks with d_sinks, dropout replay, varlen,
// strided tensors, KV cache with seqused_k, GQA, Dq != Dv, odd head dims), poisoned outputs,
// sentinels after every output buffer, NaN checks, and bit-identical repeats in deterministic
// mode. Both backends get the same inputs: out and lse are the reference forward's, rounded to
// the call's dtype (out) and float32 (lse). Skipped without a CUDA device.
#include <cuda_runtime.h>

#include "gpu_harness.hpp"

namespace gputest {
namespace {

using flashport::test::close;

fp_dtype rand_dtype() { return rand_int(0, 1) ? FP_BF16 : FP_F16; }

struct BwdOutputs {
  HostTensor dq, dk, dv, dsinks;
  bool ok = false;
  std::string error;
  fp_selection sel{};
};

// Host inputs of one backward call (the forward's tensors plus out, lse and dout).
struct BwdCall {
  Call call;
  HostTensor out, lse, dout;  // out in the call's dtype, lse float32

  explicit BwdCall(const Case& c) : call(c) {
    const Outputs ref = run_reference(call);
    ok = ref.ok;
    error = ref.error;
    out = call.out;
    lse = call.lse;
    if (ok) {
      out.from_double(ref.out.to_double());
      lse.from_double(ref.lse.to_double());
    }
    dout = call.out;
    dout.fill_normal();
  }
  bool ok = false;
  std::string error;

  fp_attn_bwd_params params(const Call::Views& w, fp_tensor dout_v, fp_tensor dq, fp_tensor dk,
                            fp_tensor dv, fp_tensor dsinks, fp_backend backend, bool det) const {
    fp_attn_bwd_params p;
    fp_attn_bwd_params_init(&p);
    p.fwd = call.params(w, backend);
    p.fwd.lse = w.lse;  // required by the backward even when the case's forward had none
    p.fwd.num_splits = 0;
    p.dout = dout_v, p.dq = dq, p.dk = dk, p.dv = dv;
    if (!call.sinks.empty()) p.d_sinks = dsinks;
    p.deterministic = det ? 1 : 0;
    return p;
  }
};

BwdOutputs run_reference_bwd(const BwdCall& bc) {
  BwdOutputs r;
  const Call& call = bc.call;
  HostTensor q = to_f64(call.q), k = to_f64(call.k), v = to_f64(call.v), out = to_f64(bc.out),
             lse = to_f64(bc.lse), dout = to_f64(bc.dout);
  r.dq = HostTensor(FP_F64, call.q.shape());
  r.dk = HostTensor(FP_F64, call.k.shape());
  r.dv = HostTensor(FP_F64, call.v.shape());
  r.dq.fill_poison(), r.dk.fill_poison(), r.dv.fill_poison();
  if (!call.sinks.empty()) {
    r.dsinks = HostTensor(FP_F32, {call.c.hq});
    r.dsinks.fill_poison();
  }
  Call::Views w{};
  w.q = q.view(), w.k = k.view(), w.v = v.view(), w.out = out.view(), w.lse = lse.view();
  if (!call.cu_q.empty()) w.cu_q = call.cu_q.view(), w.cu_k = call.cu_k.view();
  if (!call.seqused.empty()) w.seqused = call.seqused.view();
  if (!call.alibi.empty()) w.alibi = call.alibi.view();
  if (!call.sinks.empty()) w.sinks = call.sinks.view();
  fp_attn_bwd_params p = bc.params(w, dout.view(), r.dq.view(), r.dk.view(), r.dv.view(),
                                   r.dsinks.empty() ? fp_tensor{} : r.dsinks.view(),
                                   FP_BACKEND_REFERENCE, false);
  const fp_status st = fp_attn_bwd(&p);
  r.ok = st == FP_OK;
  if (!r.ok) r.error = std::string("reference bwd: ") + fp_status_name(st) + ": " + fp_last_error();
  return r;
}

// Device copies of one backward call; run() can be repeated (deterministic checks).
struct DeviceBwd {
  DevBuf q, k, v, out, lse, dout, cu_q, cu_k, seqused, alibi, sinks, rng, dq, dk, dv, dsinks, ws;
  Call::Views views{};
  fp_tensor dout_v{}, dq_v{}, dk_v{}, dv_v{}, dsinks_v{};
  HostTensor dq_h, dk_h, dv_h, dsinks_h;

  explicit DeviceBwd(const BwdCall& bc) {
    const Call& c = bc.call;
    auto up = [](DevBuf& d, const HostTensor& t, fp_tensor& view) {
      if (t.empty()) return;
      d.upload(t);
      view = d.view(t);
    };
    up(q, c.q, views.q), up(k, c.k, views.k), up(v, c.v, views.v), up(out, bc.out, views.out);
    up(lse, bc.lse, views.lse), up(cu_q, c.cu_q, views.cu_q), up(cu_k, c.cu_k, views.cu_k);
    up(seqused, c.seqused, views.seqused), up(alibi, c.alibi, views.alibi);
    up(sinks, c.sinks, views.sinks), up(rng, c.rng, views.rng);
    up(dout, bc.dout, dout_v);
    dq_h = c.q, dk_h = c.k, dv_h = c.v;
    dq_h.fill_poison(), dk_h.fill_poison(), dv_h.fill_poison();
    up(dq, dq_h, dq_v), up(dk, dk_h, dk_v), up(dv, dv_h, dv_v);
    if (!c.sinks.empty()) {
      dsinks_h = HostTensor(FP_F32, {c.c.hq});
      dsinks_h.fill_poison();
      up(dsinks, dsinks_h, dsinks_v);
    }
  }

  BwdOutputs run(const BwdCall& bc, bool det, cudaStream_t stream = nullptr) {
    BwdOutputs r;
    // Poison the outputs again, so a repeat proves every element is rewritten.
    dq.upload(dq_h), dk.upload(dk_h), dv.upload(dv_h);
    if (!dsinks_h.empty()) dsinks.upload(dsinks_h);
    dq_v = dq.view(dq_h), dk_v = dk.view(dk_h), dv_v = dv.view(dv_h);
    if (!dsinks_h.empty()) dsinks_v = dsinks.view(dsinks_h);
    fp_attn_bwd_params p = bc.params(views, dout_v, dq_v, dk_v, dv_v, dsinks_v, FP_BACKEND_CUDA, det);
    fp_status st = fp_attn_bwd_select(&p, &r.sel);
    if (st == FP_OK) {
      if (r.sel.workspace_bytes > ws.bytes) {
        HostTensor dummy(FP_F32, {static_cast<int64_t>((r.sel.workspace_bytes + 3) / 4)});
        dummy.fill_poison();  // the backward must not rely on a zeroed workspace
        ws.upload(dummy);
      }
      p.fwd.workspace = ws.ptr;
      p.fwd.workspace_bytes = ws.bytes;
      p.fwd.stream = stream;
      st = fp_attn_bwd(&p);
    }
    const cudaError_t e = cudaDeviceSynchronize();
    r.ok = st == FP_OK && e == cudaSuccess;
    if (st != FP_OK) r.error = std::string("cuda bwd: ") + fp_status_name(st) + ": " + fp_last_error();
    else if (e != cudaSuccess) r.error = std::string("cuda runtime: ") + cudaGetErrorString(e);
    r.dq = dq_h, r.dk = dk_h, r.dv = dv_h, r.dsinks = dsinks_h;
    if (r.ok) {
      dq.download(r.dq), dk.download(r.dk), dv.download(r.dv);
      if (!dsinks_h.empty()) dsinks.download(r.dsinks);
    }
    return r;
  }
};

void check_bwd(const Case& cs, bool det = false, int repeats = 1) {
  SCOPED_TRACE(cs.describe() + (det ? " deterministic" : ""));
  BwdCall bc(cs);
  ASSERT_TRUE(bc.ok) << bc.error;
  const BwdOutputs ref = run_reference_bwd(bc);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceBwd dev(bc);
  const BwdOutputs got = dev.run(bc, det);
  ASSERT_TRUE(got.ok) << got.error;
  SCOPED_TRACE(std::string("kernel ") + got.sel.kernel);
  const double tol = flashport::test::grad_tolerance(cs.dtype);
  EXPECT_TRUE(close(got.dq.to_double(), ref.dq.to_double(), tol, "dq"));
  EXPECT_TRUE(close(got.dk.to_double(), ref.dk.to_double(), tol, "dk"));
  EXPECT_TRUE(close(got.dv.to_double(), ref.dv.to_double(), tol, "dv"));
  EXPECT_TRUE(got.dq.all_written());
  EXPECT_TRUE(got.dk.all_written());
  EXPECT_TRUE(got.dv.all_written());
  EXPECT_TRUE(dev.dq.sentinel_intact()) << "write past the end of dq";
  EXPECT_TRUE(dev.dk.sentinel_intact()) << "write past the end of dk";
  EXPECT_TRUE(dev.dv.sentinel_intact()) << "write past the end of dv";
  EXPECT_TRUE(dev.ws.sentinel_intact()) << "write past the end of the workspace";
  if (!ref.dsinks.empty()) {
    EXPECT_TRUE(close(got.dsinks.to_double(), ref.dsinks.to_double(), tol, "d_sinks"));
    EXPECT_TRUE(dev.dsinks.sentinel_intact());
  }
  for (int r = 1; r < repeats; ++r) {
    const BwdOutputs again = dev.run(bc, det);
    ASSERT_TRUE(again.ok) << again.error;
    EXPECT_TRUE(again.dq.bitwise_equal(got.dq)) << "dq differs on repeat " << r;
    EXPECT_TRUE(again.dk.bitwise_equal(got.dk)) << "dk differs on repeat " << r;
    EXPECT_TRUE(again.dv.bitwise_equal(got.dv)) << "dv differs on repeat " << r;
    if (!got.dsinks.empty()) EXPECT_TRUE(again.dsinks.bitwise_equal(got.dsinks)) << "d_sinks differs";
  }
}

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
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{64, 32}, {128, 64}, {40, 200}, {192, 128}, {256, 8}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 100, c.sk = 300;
    c.causal = rand_int(0, 1);
    check_bwd(c);
  }
}

TEST(CudaBwd, GqaRatios) {
  SKIP_WITHOUT_GPU();
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}, {12, 3}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = 128, c.dv = 128, c.sq = rand_int(1, 300), c.sk = 517;
    c.causal = rand_int(0, 1);
    check_bwd(c);
  }
}

TEST(CudaBwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for (bool top_left : {false, true}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{300, 300}, {100, 400}, {400, 100}, {1, 64}, {65, 1}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = sq, c.sk = sk;
      c.causal = true, c.top_left = top_left;
      check_bwd(c);
      c.causal = false;
      c.wl = static_cast<int32_t>(rand_int(0, 70)), c.wr = static_cast<int32_t>(rand_int(-1, 40));
      check_bwd(c);
      c.wr = 0;
      check_bwd(c);
    }
  }
}

TEST(CudaBwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case base;
    base.dtype = rand_dtype();
    base.batch = 2, base.hq = 4, base.hkv = 2, base.d = d, base.dv = d, base.sq = 150, base.sk = 333;
    Case c = base;
    c.softcap = 30.0f, c.input_std = 3.0;
    check_bwd(c);
    c = base;
    c.alibi = true, c.causal = true;
    check_bwd(c);
    c = base;
    c.alibi = true, c.alibi_per_batch = true;
    check_bwd(c);
    c = base;
    c.sinks = true;
    check_bwd(c);
    c = base;
    c.sinks = true, c.causal = true, c.sq = 400, c.sk = 100;  // rows with no key: sink only
    check_bwd(c);
    c = base;
    c.scale = 0.3f;
    c.softcap = 5.0f, c.alibi = true, c.sinks = true, c.causal = true, c.wl = 50;
    check_bwd(c);
  }
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
  for (float p : {0.1f, 0.5f}) {
    for (int64_t d : {64, 128}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 130, c.sk = 260;
      c.dropout = p;
      c.causal = rand_int(0, 1);
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
  dev.dq.upload(dev.dq_h), dev.dk.upload(dev.dk_h), dev.dv.upload(dev.dv_h);  // poison again
  dev.dsinks.upload(dev.dsinks_h);
  fp_attn_bwd_params p = bc.params(dev.views, dev.dout_v, dev.dq.view(dev.dq_h), dev.dk.view(dev.dk_h),
                                   dev.dv.view(dev.dv_h), dev.dsinks.view(dev.dsinks_h), FP_BACKEND_CUDA, true);
  p.fwd.workspace = dev.ws.ptr;
  p.fwd.workspace_bytes = dev.ws.bytes;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  p.fwd.stream = stream;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_bwd(&p);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 2; ++r) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor dq = dev.dq_h, dk = dev.dk_h, dv = dev.dv_h, ds = dev.dsinks_h;
  dev.dq.download(dq), dev.dk.download(dk), dev.dv.download(dv), dev.dsinks.download(ds);
  EXPECT_TRUE(dq.bitwise_equal(want.dq)) << "dq: graph replay differs from a direct call";
  EXPECT_TRUE(dk.bitwise_equal(want.dk)) << "dk: graph replay differs from a direct call";
  EXPECT_TRUE(dv.bitwise_equal(want.dv)) << "dv: graph replay differs from a direct call";
  EXPECT_TRUE(ds.bitwise_equal(want.dsinks)) << "d_sinks: graph replay differs from a direct call";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
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
