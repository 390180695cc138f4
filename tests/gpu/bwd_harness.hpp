// Backward test harness shared by the CUDA backward suites (bwd_test.cpp, bwd_hopper_test.cpp):
// a Case's host inputs plus out/lse from the fp64 reference forward and a random dout, the fp64
// reference backward, device copies with poisoned outputs and sentinels, and one check routine.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "gpu_harness.hpp"

namespace gputest {

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

inline BwdOutputs run_reference_bwd(const BwdCall& bc) {
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
    if (c.c.grads_unaligned) {
      auto rows_plus2 = [](const HostTensor& t) {
        std::vector<int64_t> pad(size_t(t.ndim()), 0);
        pad.back() = 2;
        return HostTensor::padded(t.dtype(), t.shape(), pad);
      };
      dk_h = rows_plus2(c.k), dv_h = rows_plus2(c.v);
    }
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
    p.fwd.stream = stream;  // the plan may depend on the stream's SMs (a green context's partition)
    fp_status st = fp_attn_bwd_select(&p, &r.sel);
    if (st == FP_OK) {
      if (r.sel.workspace_bytes > ws.bytes) {
        HostTensor dummy(FP_F32, {static_cast<int64_t>((r.sel.workspace_bytes + 3) / 4)});
        dummy.fill_poison();  // the backward must not rely on a zeroed workspace
        ws.upload(dummy);
      }
      p.fwd.workspace = ws.ptr;
      p.fwd.workspace_bytes = ws.bytes;
      st = fp_attn_bwd(&p);
    }
    // The stream first: a green context's stream is not the primary context's to synchronize.
    cudaError_t e = stream != nullptr ? cudaStreamSynchronize(stream) : cudaSuccess;
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    r.ok = st == FP_OK && e == cudaSuccess;
    if (st != FP_OK) r.error = std::string("cuda bwd: ") + fp_status_name(st) + ": " + fp_last_error();
    else if (e != cudaSuccess) r.error = std::string("cuda runtime: ") + cudaGetErrorString(e);
    r.dq = dq_h, r.dk = dk_h, r.dv = dv_h, r.dsinks = dsinks_h;
    if (r.ok) download_grads(&r);
    return r;
  }

  // The gradients as the device holds them now, into r's dq/dk/dv/dsinks (shaped like dq_h...).
  void download_grads(BwdOutputs* r) const {
    r->dq = dq_h, r->dk = dk_h, r->dv = dv_h, r->dsinks = dsinks_h;
    dq.download(r->dq), dk.download(r->dk), dv.download(r->dv);
    if (!dsinks_h.empty()) dsinks.download(r->dsinks);
  }
};

// A backward call captured into a CUDA graph on its own non-blocking stream; released on scope exit.
struct BwdGraph {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BwdGraph() = default;
  BwdGraph(const BwdGraph&) = delete;
  BwdGraph& operator=(const BwdGraph&) = delete;
  ~BwdGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
};

// After a dev.run that sized the workspace: poisons the gradients again and captures the backward
// into g (use under ASSERT_NO_FATAL_FAILURE). The capture fails if the call allocates,
// synchronizes or reads device memory.
inline void capture_bwd(const BwdCall& bc, DeviceBwd& dev, bool det, BwdGraph* g) {
  dev.dq.upload(dev.dq_h), dev.dk.upload(dev.dk_h), dev.dv.upload(dev.dv_h);
  if (!dev.dsinks_h.empty()) dev.dsinks.upload(dev.dsinks_h);
  fp_attn_bwd_params p = bc.params(dev.views, dev.dout_v, dev.dq.view(dev.dq_h), dev.dk.view(dev.dk_h),
                                   dev.dv.view(dev.dv_h), dev.dsinks.view(dev.dsinks_h), FP_BACKEND_CUDA, det);
  p.fwd.workspace = dev.ws.ptr;
  p.fwd.workspace_bytes = dev.ws.bytes;
  CUDA_OK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
  p.fwd.stream = g->stream;
  CUDA_OK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_bwd(&p);
  CUDA_OK(cudaStreamEndCapture(g->stream, &g->graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  CUDA_OK(cudaGraphInstantiate(&g->exec, g->graph, 0));
}

// Runs the case on the CUDA backend against the fp64 reference backward: values, every element
// written, sentinels after dq/dk/dv/d_sinks and the workspace; `repeats` > 1 also checks that
// repeated runs are bit-identical. `sel_out` receives the selection (which kernel ran); `stream`:
// the caller's stream of the calls (default: the legacy stream).
inline void check_bwd(const Case& cs, bool det = false, int repeats = 1, fp_selection* sel_out = nullptr,
                      cudaStream_t stream = nullptr) {
  SCOPED_TRACE(cs.describe() + (det ? " deterministic" : ""));
  BwdCall bc(cs);
  ASSERT_TRUE(bc.ok) << bc.error;
  const BwdOutputs ref = run_reference_bwd(bc);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceBwd dev(bc);
  const BwdOutputs got = dev.run(bc, det, stream);
  ASSERT_TRUE(got.ok) << got.error;
  SCOPED_TRACE(std::string("kernel ") + got.sel.kernel);
  if (sel_out) *sel_out = got.sel;
  const double tol = flashport::test::grad_tolerance(cs.dtype);
  EXPECT_TRUE(flashport::test::close(got.dq.to_double(), ref.dq.to_double(), tol, "dq"));
  EXPECT_TRUE(flashport::test::close(got.dk.to_double(), ref.dk.to_double(), tol, "dk"));
  EXPECT_TRUE(flashport::test::close(got.dv.to_double(), ref.dv.to_double(), tol, "dv"));
  EXPECT_TRUE(got.dq.all_written());
  EXPECT_TRUE(got.dk.all_written());
  EXPECT_TRUE(got.dv.all_written());
  EXPECT_TRUE(dev.dq.sentinel_intact()) << "write past the end of dq";
  EXPECT_TRUE(dev.dk.sentinel_intact()) << "write past the end of dk";
  EXPECT_TRUE(dev.dv.sentinel_intact()) << "write past the end of dv";
  EXPECT_TRUE(dev.ws.sentinel_intact()) << "write past the end of the workspace";
  if (!ref.dsinks.empty()) {
    EXPECT_TRUE(flashport::test::close(got.dsinks.to_double(), ref.dsinks.to_double(), tol, "d_sinks"));
    EXPECT_TRUE(dev.dsinks.sentinel_intact());
  }
  for (int r = 1; r < repeats; ++r) {
    const BwdOutputs again = dev.run(bc, det, stream);
    ASSERT_TRUE(again.ok) << again.error;
    EXPECT_TRUE(again.dq.bitwise_equal(got.dq)) << "dq differs on repeat " << r;
    EXPECT_TRUE(again.dk.bitwise_equal(got.dk)) << "dk differs on repeat " << r;
    EXPECT_TRUE(again.dv.bitwise_equal(got.dv)) << "dv differs on repeat " << r;
    if (!got.dsinks.empty()) EXPECT_TRUE(again.dsinks.bitwise_equal(got.dsinks)) << "d_sinks differs";
  }
}

}  // namespace gputest
