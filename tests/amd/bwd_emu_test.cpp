// The attention backward shared by CUDA and HIP (src/gpu/mma/bwd_kernel.cuh and the preprocess /
// dq conversion / sink-gradient kernels of bwd_aux_kernels.cuh), unchanged, on the AMD tile-MMA
// layer (tile_mma_amd.hpp) and the AMD rows of bwd_launch.hpp's tile table, run on the CPU by the
// workgroup emulation of simt_emu.hpp in one target's register layout (this file is compiled once
// per layout: MFMA wave64, WMMA gfx11 wave32, WMMA gfx12 wave32, and the plain path), against the
// fp64 reference backward. Every workgroup of the three launches the HIP backend makes
// (hip_backend.hip run_bwd: bwd_layout, bwd_launch_args, amd_bwd_grid) runs in launch order over a
// NaN-filled workspace, into poisoned dq/dk/dv/d_sinks with guard bytes. Covers causal (both
// alignments), windows, GQA, varlen, Sq > Sk, head-dim tails, odd strides, softcap, ALiBi, sinks,
// dropout replay and the deterministic mode (bit-identical across runs; its semaphore waits must be
// satisfied by the blocks launched before, or the emulation aborts). A mutation check runs the
// same call with the emulated matrix instruction reading a wrong register layout and requires the
// comparison to fail. Not a run on AMD hardware: timing, the compiler's code for the builtins and
// memory-model effects (one lane runs at a time) are outside what it shows.
#include "gpu/amd/amd_layouts.hpp"
#include "simt_emu.hpp"
// After the emulation header:
#include "gpu/amd/amd_plan.hpp"
#include "gpu/mma/bwd_aux_kernels.cuh"
#include "gpu/mma/bwd_kernel.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/validate.hpp"
#include "test_util.hpp"

namespace {

using flashport::BwdProblem;
using flashport::test::HostTensor;
using flashport::test::cumsum;
using flashport::test::to_f64;
namespace gpu = flashport::gpu;

struct Case {
  fp_dtype dtype = FP_F16;
  int64_t batch = 2, hq = 2, hkv = 1, d = 64, dv = 64, sq = 1, sk = 1;
  std::vector<int64_t> lq, lk;  // varlen when given
  bool causal = false, top_left = false;
  int32_t wl = -1, wr = -1;
  float softcap = 0.0f, dropout = 0.0f;
  bool alibi = false, sinks = false, odd_strides = false;
};

// Inputs of one backward call: q, k, v, out and lse of the fp64 forward (out rounded to the dtype,
// lse to fp32), a random dout; poisoned gradients.
struct Tensors {
  HostTensor q, k, v, out, lse, dout, dq, dk, dv, dsinks, cu_q, cu_k, alibi, sinks;
};

HostTensor make(const Case& c, fp_dtype dt, std::vector<int64_t> shape) {
  if (c.odd_strides) {
    std::vector<int64_t> pad(shape.size(), 0);
    pad.back() = 1;  // rows padded by one element: no 16-byte copies, no pair stores
    return HostTensor::padded(dt, shape, pad);
  }
  return HostTensor(dt, shape);
}

fp_attn_params fwd_params(const Case& c, const Tensors& t, fp_backend backend) {
  fp_attn_params p;
  fp_attn_params_init(&p);
  p.backend = backend;
  p.q = t.q.view(), p.k = t.k.view(), p.v = t.v.view(), p.out = t.out.view(), p.lse = t.lse.view();
  if (!c.lq.empty()) {
    p.cu_seqlens_q = t.cu_q.view(), p.cu_seqlens_k = t.cu_k.view();
    p.max_seqlen_q = c.sq, p.max_seqlen_k = c.sk;
  }
  p.causal = c.causal;
  p.causal_align = c.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.softcap = c.softcap;
  if (c.alibi) p.alibi_slopes = t.alibi.view();
  if (c.sinks) p.sinks = t.sinks.view();
  p.dropout_p = c.dropout;
  p.dropout_seed = 0x0123456789abcdefull;
  p.dropout_offset = 7;
  return p;
}

fp_attn_bwd_params bwd_params(const Case& c, const Tensors& t, fp_backend backend, bool det) {
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  p.fwd = fwd_params(c, t, backend);
  p.dout = t.dout.view(), p.dq = t.dq.view(), p.dk = t.dk.view(), p.dv = t.dv.view();
  if (c.sinks) p.d_sinks = t.dsinks.view();
  p.deterministic = det ? 1 : 0;
  return p;
}

// Builds the call (q, k, v random; out/lse from the fp64 reference forward) and its fp64 mirror.
void build(Case& c, Tensors* t, Tensors* r) {
  const fp_dtype dt = c.dtype;
  std::vector<int64_t> qs, ks, vs, os, ls;
  if (!c.lq.empty()) {
    c.batch = static_cast<int64_t>(c.lq.size());
    c.sq = *std::max_element(c.lq.begin(), c.lq.end());
    c.sk = *std::max_element(c.lk.begin(), c.lk.end());
    const auto cq = cumsum(c.lq), ck = cumsum(c.lk);
    qs = {cq.back(), c.hq, c.d}, ks = {ck.back(), c.hkv, c.d}, vs = {ck.back(), c.hkv, c.dv};
    os = {cq.back(), c.hq, c.dv}, ls = {c.hq, cq.back()};
    t->cu_q = HostTensor::i32({c.batch + 1}, cq);
    t->cu_k = HostTensor::i32({c.batch + 1}, ck);
  } else {
    qs = {c.batch, c.sq, c.hq, c.d}, ks = {c.batch, c.sk, c.hkv, c.d}, vs = {c.batch, c.sk, c.hkv, c.dv};
    os = {c.batch, c.sq, c.hq, c.dv}, ls = {c.batch, c.hq, c.sq};
  }
  t->q = make(c, dt, qs), t->k = make(c, dt, ks), t->v = make(c, dt, vs);
  t->out = make(c, dt, os), t->dout = make(c, dt, os);
  t->lse = HostTensor(FP_F32, ls);
  t->q.fill_normal(), t->k.fill_normal(), t->v.fill_normal(), t->dout.fill_normal();
  if (c.alibi) {
    t->alibi = HostTensor(FP_F32, {c.hq});
    t->alibi.fill_uniform(0.01, 0.3);
  }
  if (c.sinks) {
    t->sinks = HostTensor(FP_F32, {c.hq});
    t->sinks.fill_uniform(-2.0, 3.0);
  }
  // The forward in fp64 on the dtype-rounded inputs; out and lse as the caller would hold them.
  r->q = to_f64(t->q), r->k = to_f64(t->k), r->v = to_f64(t->v), r->dout = to_f64(t->dout);
  r->out = HostTensor(FP_F64, os), r->lse = HostTensor(FP_F64, ls);
  r->cu_q = t->cu_q, r->cu_k = t->cu_k, r->alibi = t->alibi, r->sinks = t->sinks;
  fp_attn_params fp = fwd_params(c, *r, FP_BACKEND_REFERENCE);
  ASSERT_EQ(fp_attn_fwd(&fp), FP_OK) << fp_last_error();
  t->out.from_double(r->out.to_double());
  t->lse.from_double(r->lse.to_double());
  r->out = to_f64(t->out), r->lse = to_f64(t->lse);
  // Gradients: poisoned on the emulated side, fp64 on the reference side.
  t->dq = make(c, dt, qs), t->dk = make(c, dt, ks), t->dv = make(c, dt, vs);
  r->dq = HostTensor(FP_F64, qs), r->dk = HostTensor(FP_F64, ks), r->dv = HostTensor(FP_F64, vs);
  if (c.sinks) {
    t->dsinks = HostTensor(FP_F32, {c.hq});
    r->dsinks = HostTensor(FP_F32, {c.hq});
  }
  fp_attn_bwd_params rb = bwd_params(c, *r, FP_BACKEND_REFERENCE, false);
  ASSERT_EQ(fp_attn_bwd(&rb), FP_OK) << fp_last_error();
}

template <int kTile>
void run_tile(bool bf16, const gpu::BwdArgs& a) {
  if (bf16) gpu::bwd_kernel<kTile, gpu::BFloat16>(a);
  else gpu::bwd_kernel<kTile, gpu::Half>(a);
}

// Every workgroup of the HIP backend's three launches (hip_backend.hip run_bwd), in stream and
// launch order, over a workspace of NaN bytes; the gradients are poisoned first.
void run_emulated(const BwdProblem& bp, Tensors* t) {
  t->dq.fill_poison(), t->dk.fill_poison(), t->dv.fill_poison();
  if (!t->dsinks.empty()) t->dsinks.fill_poison();
  ASSERT_EQ(gpu::amd_bwd_refusal(bp), "");
  const gpu::BwdLayout l = gpu::bwd_layout(bp);
  std::vector<unsigned char> workspace(l.ws.total, 0xff);
  const gpu::BwdArgs a = gpu::bwd_launch_args(bp, l, workspace.data());
  const unsigned aux_blocks = gpu::bwd_aux_blocks(a), aux_threads = unsigned(gpu::kAuxWarps * kWarpSize);
  for (unsigned x = 0; x < aux_blocks; ++x)
    simt::run_block(aux_threads, kWarpSize, {x, 0, 0}, {aux_blocks, 1, 1}, 0, [&] { gpu::bwd_preprocess_kernel(a); });
  const gpu::AmdBwdGrid g = gpu::amd_bwd_grid(bp, l);
  const gpu::BwdTile& c = gpu::kBwdTiles[l.tile];
  const bool bf16 = a.bf16;
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x)
        simt::run_block(unsigned(c.threads(kWarpSize)), kWarpSize, {x, y, z}, {g.x, g.y, g.z}, size_t(c.smem_bytes()),
                        [&] {
                          switch (l.tile) {
                            case gpu::kBwd64: return run_tile<gpu::kBwd64>(bf16, a);
                            case gpu::kBwd128: return run_tile<gpu::kBwd128>(bf16, a);
                            case gpu::kBwd256: return run_tile<gpu::kBwd256>(bf16, a);
                            default: FAIL() << "tile " << l.tile << " is not an AMD instance";
                          }
                        });
  for (unsigned x = 0; x < aux_blocks; ++x)
    simt::run_block(aux_threads, kWarpSize, {x, 0, 0}, {aux_blocks, 1, 1}, 0, [&] { gpu::bwd_convert_kernel(a); });
  if (a.d_sinks != nullptr && a.rules.sinks != nullptr)
    for (unsigned h = 0; h < unsigned(a.hq); ++h)
      simt::run_block(unsigned(gpu::kSinkThreads), kWarpSize, {h, 0, 0}, {unsigned(a.hq), 1, 1}, 0,
                      [&] { gpu::bwd_sink_kernel(a); });
}

BwdProblem resolved(const Case& c, const Tensors& t, bool det) {
  const fp_attn_bwd_params p = bwd_params(c, t, FP_BACKEND_AUTO, det);
  BwdProblem bp;
  const flashport::Status st = flashport::resolve_bwd(p, &bp);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return bp;
}

::testing::AssertionResult grads_close(const Case& c, const Tensors& t, const Tensors& r) {
  const double tol = flashport::test::grad_tolerance(c.dtype);
  if (auto res = flashport::test::close(t.dq, r.dq, tol, "dq"); !res) return res;
  if (auto res = flashport::test::close(t.dk, r.dk, tol, "dk"); !res) return res;
  if (auto res = flashport::test::close(t.dv, r.dv, tol, "dv"); !res) return res;
  if (c.sinks) {
    if (auto res = flashport::test::close(t.dsinks, r.dsinks, flashport::test::tolerance(FP_F32) * 100, "d_sinks"); !res)
      return res;
  }
  return ::testing::AssertionSuccess();
}

// The case on the emulated AMD backward against the fp64 reference: values, every element written,
// guard bytes intact; deterministic mode twice, bit-identical.
void check(Case c, bool det = false) {
  Tensors t, r;
  ASSERT_NO_FATAL_FAILURE(build(c, &t, &r));
  const BwdProblem bp = resolved(c, t, det);
  ASSERT_NO_FATAL_FAILURE(run_emulated(bp, &t));
  for (const HostTensor* g : {&t.dq, &t.dk, &t.dv}) {
    EXPECT_TRUE(g->guards_intact());
    EXPECT_TRUE(g->all_written());
  }
  if (c.sinks) {
    EXPECT_TRUE(t.dsinks.guards_intact());
    EXPECT_TRUE(t.dsinks.all_written());
  }
  EXPECT_TRUE(grads_close(c, t, r));
  if (det) {
    const HostTensor dq = t.dq, dk = t.dk, dv = t.dv;
    ASSERT_NO_FATAL_FAILURE(run_emulated(bp, &t));
    EXPECT_TRUE(t.dq.bitwise_equal(dq));
    EXPECT_TRUE(t.dk.bitwise_equal(dk));
    EXPECT_TRUE(t.dv.bitwise_equal(dv));
  }
}

Case base(fp_dtype dt, int64_t d, int64_t sq, int64_t sk) {
  Case c;
  c.dtype = dt, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
  return c;
}

}  // namespace

TEST(AmdBwdEmulated, PlainFp16D64) { check(base(FP_F16, 64, 70, 130)); }

// Small enough for the plain path (cross-lane shuffles, ~30x slower to emulate).
TEST(AmdBwdEmulated, SmallCausalGqa) {
  Case c = base(FP_F16, 64, 20, 33);
  c.hq = 2, c.hkv = 1, c.causal = true, c.batch = 1;
  check(c);
}

TEST(AmdBwdEmulated, Bf16D128TailsAndDvSmaller) {
  Case c = base(FP_BF16, 113, 37, 75);  // head dim 113 in the 128 bucket, masked columns
  c.dv = 100;
  check(c);
}

TEST(AmdBwdEmulated, CausalGqaSqGreaterThanSk) {
  Case c = base(FP_F16, 64, 90, 40);  // rows that see no key: P = 0 there
  c.hq = 4, c.hkv = 2, c.causal = true;
  check(c);
}

TEST(AmdBwdEmulated, TopLeftWindowSoftcapAlibiSinks) {
  Case c = base(FP_BF16, 64, 77, 150);
  c.top_left = true, c.wl = 20, c.wr = 5, c.softcap = 30.0f, c.alibi = true, c.sinks = true;
  check(c);
}

TEST(AmdBwdEmulated, Dropout) {
  Case c = base(FP_F16, 64, 33, 97);
  c.dropout = 0.25f, c.causal = true, c.hq = 2, c.hkv = 2;
  check(c);
}

TEST(AmdBwdEmulated, HeadDim256Causal) {
  Case c = base(FP_BF16, 256, 45, 70);  // 4 waves, 2 of them compute the scores; dQ in 2 passes
  c.dv = 200, c.causal = true, c.softcap = 20.0f, c.batch = 1;
  check(c);
}

TEST(AmdBwdEmulated, Varlen) {
  Case c = base(FP_F16, 128, 0, 0);
  c.lq = {1, 66, 17}, c.lk = {129, 3, 40}, c.hq = 3, c.hkv = 1, c.wl = 30;
  check(c);
}

TEST(AmdBwdEmulated, OddStridesTakeScalarPaths) {
  Case c = base(FP_BF16, 64, 19, 45);  // row strides d + 1: no 16-byte copies, no pair stores
  c.odd_strides = true, c.causal = true, c.softcap = 15.0f;
  check(c);
}

// Deterministic mode: key blocks add their dQ parts in a fixed order (per-(b, h, query block)
// semaphores); two runs are bit-identical, and every wait is satisfied by the blocks launched
// before it (descending key blocks), else the emulation aborts.
TEST(AmdBwdEmulated, DeterministicGqaCausalDropout) {
  Case c = base(FP_F16, 64, 80, 150);
  c.hq = 4, c.hkv = 2, c.causal = true, c.dropout = 0.1f;
  check(c, /*det=*/true);
  Case v = base(FP_BF16, 128, 0, 0);
  v.lq = {40, 3}, v.lk = {70, 90}, v.wl = 25, v.wr = 10, v.alibi = true;
  check(v, /*det=*/true);
  Case w = base(FP_F16, 256, 33, 50);
  w.batch = 1, w.causal = true, w.top_left = true;
  check(w, /*det=*/true);
}

// The comparisons can fail: the same call with the emulated matrix instruction reading its B
// operand in a wrong register layout (k rows swapped) gives gradients the check rejects.
TEST(AmdBwdEmulated, WrongLayoutIsCaught) {
#if defined(FP_AMD_EMULATION_PLAIN)
  GTEST_SKIP() << "the plain path has no emulated matrix instruction to mutate";
#else
  Case c = base(FP_F16, 64, 40, 70);
  Tensors t, r;
  ASSERT_NO_FATAL_FAILURE(build(c, &t, &r));
  const BwdProblem bp = resolved(c, t, false);
  simt::g_mutate_layout = true;
  run_emulated(bp, &t);
  simt::g_mutate_layout = false;
  EXPECT_FALSE(grads_close(c, t, r));
  ASSERT_NO_FATAL_FAILURE(run_emulated(bp, &t));  // and the unmutated run passes
  EXPECT_TRUE(grads_close(c, t, r));
#endif
}

// ---- the HIP plan of the backward (amd_plan.hpp + bwd_launch.hpp): tile rows, workspace, refusals
TEST(AmdBwdPlan, TileWorkspaceAndRefusals) {
  Case c = base(FP_F16, 100, 50, 90);
  c.hq = 4, c.hkv = 2;
  Tensors t, r;
  ASSERT_NO_FATAL_FAILURE(build(c, &t, &r));
  BwdProblem bp = resolved(c, t, false);
  EXPECT_EQ(gpu::amd_bwd_refusal(bp), "");
  gpu::BwdLayout l = gpu::bwd_layout(bp);
  EXPECT_EQ(l.tile, gpu::kBwd128);
  const gpu::BwdTile& tile = gpu::kBwdTiles[l.tile];
  EXPECT_LE(tile.smem_bytes(), 64 * 1024);  // a workgroup's LDS without opt-in
  EXPECT_EQ(l.key_blocks, (90 + tile.block_n - 1) / tile.block_n);
  EXPECT_EQ(l.ws.dacc, 104);  // d rounded up to 8
  EXPECT_EQ(l.ws.sema_count, 0);
  const size_t rows = size_t(c.hq) * size_t(c.batch * c.sq);
  EXPECT_GE(l.ws.total, rows * 4 * 2 + rows * 104 * 4);
  EXPECT_EQ(l.ws.total % 256, 0u);
  EXPECT_EQ(gpu::amd_bwd_plan_name(bp, l, "mfma", "gfx942:sramecc+:xnack-"),
            std::string("hip:") + tile.name + ":fp16:mfma:gfx942:sramecc+:xnack-:atomic-dq");
  std::printf("plan hip:%s:fp16:<unit>:<arch>:atomic-dq, workspace %zu bytes (B=%lld Sq=%lld Hq=%lld d=%lld)\n",
              tile.name, l.ws.total, (long long)c.batch, (long long)c.sq, (long long)c.hq, (long long)c.d);
  bp = resolved(c, t, true);  // deterministic: one semaphore per (b, h, query block)
  l = gpu::bwd_layout(bp);
  EXPECT_NE(gpu::amd_bwd_plan_name(bp, l, "wmma", "gfx1100").find(":deterministic"), std::string::npos);
  std::printf("plan hip:%s:fp16:<unit>:<arch>:deterministic, workspace %zu bytes (%lld semaphores)\n", tile.name,
              l.ws.total, (long long)l.ws.sema_count);
  EXPECT_EQ(l.ws.sema_count, c.batch * c.hq * ((c.sq + tile.block_m - 1) / tile.block_m));
  EXPECT_GE(l.ws.total, l.ws.sema_off + size_t(l.ws.sema_count) * 4);
  // Refused by name: fp32, head dims past 256, append-then-attend.
  BwdProblem f32 = bp;
  f32.fwd.dtype = FP_F32;
  EXPECT_NE(gpu::amd_bwd_refusal(f32).find("dtype"), std::string::npos);
  BwdProblem wide = bp;
  wide.fwd.dv = 300;
  EXPECT_NE(gpu::amd_bwd_refusal(wide).find("head dim"), std::string::npos);
  BwdProblem append = bp;
  append.fwd.seq.snew = 2;
  EXPECT_NE(gpu::amd_bwd_refusal(append).find("k_new"), std::string::npos);
  BwdProblem nolse = bp;
  nolse.fwd.has_lse = false;
  EXPECT_NE(gpu::amd_bwd_refusal(nolse).find("lse"), std::string::npos);
}
