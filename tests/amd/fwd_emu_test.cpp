// The forward main loop shared by CUDA and HIP (src/gpu/fwd_kernel.cuh), unchanged, on the AMD
// tile-MMA layer (src/gpu/tile_mma_amd.hpp) and the AMD tile rows (tile_config.hpp), run on the
// CPU by the workgroup emulation of simt_emu.hpp in one target's register layout (this file is
// compiled once per layout: MFMA wave64, WMMA gfx11 wave32, WMMA gfx12 wave32, and the plain path
// of other gfx targets in wave64 and wave32), against the fp64 reference backend. Every
// workgroup of the launch the HIP backend would make (amd_plan.hpp: tile row, packed GQA rows,
// grid, kernel arguments) runs in turn. Proves the loop and its use of the AMD layer: padded
// shared tiles, the K/V loaders and the plain-copy schedule, transposed products, accumulator ->
// operand, the row ownership and cross-lane reductions, the warp vote, masks, softcap, ALiBi,
// dropout, sinks, packed GQA rows, inactive waves, the epilogue's stores. The matrix instruction
// is emulated from the layouts that layout_test.cpp checks against AMD's documentation (the
// plain path runs its own shuffle code). It is not a run on AMD hardware: what it can't show is
// timing, the compiler's code for the builtins and fences, and memory-model effects (one lane
// runs at a time).
#include "gpu/amd_layouts.hpp"
#include "simt_emu.hpp"
// After the emulation header:
#include "gpu/amd_plan.hpp"
#include "gpu/fwd_kernel.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/validate.hpp"
#include "test_util.hpp"

namespace {

using flashport::Problem;
using flashport::test::HostTensor;
using flashport::test::test_rng;
namespace gpu = flashport::gpu;

struct Case {
  fp_dtype dtype = FP_F16;
  int64_t batch = 1, hq = 1, hkv = 1, d = 64, dv = 64, sq = 1, sk = 1;
  std::vector<int64_t> lq, lk;  // varlen when given
  bool causal = false, top_left = false;
  int32_t wl = -1, wr = -1;
  float softcap = 0.0f, dropout = 0.0f;
  bool alibi = false, sinks = false, paged = false;
  int64_t page_size = 16;
  bool odd_strides = false;  // rows padded by one element: scalar loads (no 16-byte copies) and stores
};

HostTensor to_f64(const HostTensor& t) {
  if (t.empty()) return {};
  HostTensor r(FP_F64, t.shape());
  r.from_double(t.to_double());
  return r;
}

std::vector<int32_t> cumsum(const std::vector<int64_t>& v) {
  std::vector<int32_t> r{0};
  for (int64_t x : v) r.push_back(r.back() + static_cast<int32_t>(x));
  return r;
}

struct Tensors {
  HostTensor q, k, v, out, lse, cu_q, cu_k, seqused, block_table, alibi, sinks;
};

fp_attn_params params_of(const Case& c, const Tensors& t, fp_backend backend) {
  fp_attn_params p;
  fp_attn_params_init(&p);
  p.backend = backend;
  p.q = t.q.view(), p.k = t.k.view(), p.v = t.v.view(), p.out = t.out.view(), p.lse = t.lse.view();
  if (!c.lq.empty()) {
    p.cu_seqlens_q = t.cu_q.view(), p.cu_seqlens_k = t.cu_k.view();
    p.max_seqlen_q = c.sq, p.max_seqlen_k = c.sk;
  }
  if (c.paged) p.seqused_k = t.seqused.view(), p.block_table = t.block_table.view();
  p.causal = c.causal;
  p.causal_align = c.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.softcap = c.softcap;
  if (c.alibi) p.alibi_slopes = t.alibi.view();
  if (c.sinks) p.sinks = t.sinks.view();
  p.dropout_p = c.dropout;
  p.dropout_seed = 0x1234567887654321ull;
  p.dropout_offset = 99;
  p.num_splits = 1;
  return p;
}

Tensors build(Case& c) {
  Tensors t;
  const fp_dtype dt = c.dtype;
  if (!c.lq.empty()) {
    c.batch = static_cast<int64_t>(c.lq.size());
    c.sq = *std::max_element(c.lq.begin(), c.lq.end());
    c.sk = *std::max_element(c.lk.begin(), c.lk.end());
    const auto cq = cumsum(c.lq), ck = cumsum(c.lk);
    t.q = HostTensor(dt, {cq.back(), c.hq, c.d});
    t.k = HostTensor(dt, {ck.back(), c.hkv, c.d});
    t.v = HostTensor(dt, {ck.back(), c.hkv, c.dv});
    t.out = HostTensor(dt, {cq.back(), c.hq, c.dv});
    t.lse = HostTensor(FP_F32, {c.hq, cq.back()});
    t.cu_q = HostTensor::i32({c.batch + 1}, cq);
    t.cu_k = HostTensor::i32({c.batch + 1}, ck);
  } else if (c.paged) {
    const int64_t max_blocks = (c.sk + c.page_size - 1) / c.page_size, pool = c.batch * max_blocks + 3;
    std::vector<int32_t> ids(pool), used;
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), test_rng());
    ids.resize(c.batch * max_blocks);
    for (int64_t b = 0; b < c.batch; ++b)
      used.push_back(static_cast<int32_t>(std::uniform_int_distribution<int64_t>(1, c.sk)(test_rng())));
    t.block_table = HostTensor::i32({c.batch, max_blocks}, ids);
    t.seqused = HostTensor::i32({c.batch}, used);
    t.q = HostTensor(dt, {c.batch, c.sq, c.hq, c.d});
    t.k = HostTensor(dt, {pool, c.page_size, c.hkv, c.d});
    t.v = HostTensor(dt, {pool, c.page_size, c.hkv, c.dv});
    t.out = HostTensor(dt, {c.batch, c.sq, c.hq, c.dv});
    t.lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
  } else if (c.odd_strides) {
    const std::vector<int64_t> pad{0, 0, 0, 1};
    t.q = HostTensor::padded(dt, {c.batch, c.sq, c.hq, c.d}, pad);
    t.k = HostTensor::padded(dt, {c.batch, c.sk, c.hkv, c.d}, pad);
    t.v = HostTensor::padded(dt, {c.batch, c.sk, c.hkv, c.dv}, pad);
    t.out = HostTensor::padded(dt, {c.batch, c.sq, c.hq, c.dv}, pad);
    t.lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
  } else {
    t.q = HostTensor(dt, {c.batch, c.sq, c.hq, c.d});
    t.k = HostTensor(dt, {c.batch, c.sk, c.hkv, c.d});
    t.v = HostTensor(dt, {c.batch, c.sk, c.hkv, c.dv});
    t.out = HostTensor(dt, {c.batch, c.sq, c.hq, c.dv});
    t.lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
  }
  t.q.fill_normal();
  t.k.fill_normal();
  t.v.fill_normal();
  t.out.fill_poison();
  t.lse.fill_poison();
  if (c.alibi) {
    t.alibi = HostTensor(FP_F32, {c.hq});
    t.alibi.fill_uniform(0.01, 0.3);
  }
  if (c.sinks) {
    t.sinks = HostTensor(FP_F32, {c.hq});
    t.sinks.fill_uniform(-2.0, 3.0);
  }
  return t;
}

template <int kTile>
void run_tile(bool bf16, const gpu::FwdArgs& a) {
  if (bf16) gpu::fwd_kernel<kTile, gpu::BFloat16>(a);
  else gpu::fwd_kernel<kTile, gpu::Half>(a);
}

// Every workgroup of the launch the HIP backend would make, one after another.
void run_emulated(const Problem& p, int expect_pack) {
  ASSERT_EQ(gpu::amd_fwd_refusal(p), "");
  const gpu::AmdFwdLaunch l = gpu::amd_fwd_launch(p);
  ASSERT_EQ(gpu::amd_grid_refusal(l), "");
  if (expect_pack > 0) {
    ASSERT_EQ(l.pack, expect_pack);
  }
  const gpu::FwdArgs a = gpu::amd_fwd_args(p, l);
  const gpu::TileConfig& c = gpu::kTileConfigs[l.tile];
  const bool bf16 = p.dtype == FP_BF16;
  const simt::Idx3 grid{unsigned(l.m_blocks), unsigned(l.heads_grid), unsigned(l.batch)};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        simt::run_block(unsigned(c.threads(kWarpSize)), kWarpSize, {x, y, z}, grid, size_t(c.smem_bytes()), [&] {
          switch (l.tile) {
            case gpu::kPrefill64: return run_tile<gpu::kPrefill64>(bf16, a);
            case gpu::kPrefill128: return run_tile<gpu::kPrefill128>(bf16, a);
            case gpu::kPrefill256: return run_tile<gpu::kPrefill256>(bf16, a);
            default: FAIL() << "tile " << int(l.tile) << " is not an AMD instance";
          }
        });
}

// expect_pack > 0: the plan must pack that many query heads per block (the rule is the HIP
// plan's; several cases below pack 2 heads by it too).
void check(Case c, int expect_pack = 0) {
  Tensors t = build(c);
  // fp64 reference on exact fp64 copies of the inputs.
  Tensors r;
  r.q = to_f64(t.q), r.k = to_f64(t.k), r.v = to_f64(t.v);
  r.out = HostTensor(FP_F64, t.out.shape()), r.lse = HostTensor(FP_F64, t.lse.shape());
  r.cu_q = t.cu_q, r.cu_k = t.cu_k, r.seqused = t.seqused, r.block_table = t.block_table;
  r.alibi = t.alibi, r.sinks = t.sinks;
  fp_attn_params rp = params_of(c, r, FP_BACKEND_REFERENCE);
  ASSERT_EQ(fp_attn_fwd(&rp), FP_OK) << fp_last_error();

  const fp_attn_params p = params_of(c, t, FP_BACKEND_AUTO);
  Problem prob;
  const flashport::Status st = flashport::resolve_fwd(p, &prob);
  ASSERT_TRUE(st.is_ok()) << st.message();
  run_emulated(prob, expect_pack);

  EXPECT_TRUE(t.out.guards_intact());
  EXPECT_TRUE(t.lse.guards_intact());
  EXPECT_TRUE(t.out.all_written());
  EXPECT_TRUE(t.lse.all_written());
  EXPECT_TRUE(flashport::test::close(t.out, r.out, flashport::test::tolerance(c.dtype), "out"));
  EXPECT_TRUE(flashport::test::close(t.lse, r.lse, flashport::test::tolerance(FP_F32) * 20, "lse"));
}

Case base(fp_dtype dt, int64_t d, int64_t sq, int64_t sk) {
  Case c;
  c.dtype = dt, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
  c.batch = 2, c.hq = 2, c.hkv = 1;
  return c;
}

}  // namespace

TEST(AmdTileEmulated, PlainFp16D64) { check(base(FP_F16, 64, 70, 130)); }

TEST(AmdTileEmulated, Bf16D128Tails) {
  Case c = base(FP_BF16, 113, 3, 75);  // head dim 113 runs in the 128 bucket, masked columns
  c.dv = 100;
  check(c);
}

TEST(AmdTileEmulated, CausalGqaSqGreaterThanSk) {
  Case c = base(FP_F16, 64, 90, 40);  // rows that see no key: out 0, lse -inf
  c.hq = 4, c.hkv = 2, c.causal = true;
  check(c);
}

TEST(AmdTileEmulated, TopLeftWindowSoftcapAlibiSinks) {
  Case c = base(FP_BF16, 64, 77, 150);
  c.top_left = true, c.wl = 20, c.wr = 5, c.softcap = 30.0f, c.alibi = true, c.sinks = true;
  check(c);
}

TEST(AmdTileEmulated, Dropout) {
  Case c = base(FP_F16, 64, 33, 97);
  c.dropout = 0.25f, c.causal = true;
  check(c);
}

TEST(AmdTileEmulated, HeadDim256AndDvSmaller) {
  Case c = base(FP_BF16, 256, 45, 70);  // the 256 bucket: 2 waves, 32 keys a step
  c.dv = 200, c.causal = true, c.softcap = 20.0f;
  check(c);
}

TEST(AmdTileEmulated, VarlenAndPaged) {
  Case v = base(FP_F16, 128, 0, 0);
  v.lq = {1, 66, 17}, v.lk = {129, 3, 40}, v.hq = 3, v.hkv = 3;
  check(v);
  Case p = base(FP_BF16, 64, 20, 100);
  p.paged = true, p.page_size = 7, p.causal = true;
  check(p);
}

TEST(AmdTileEmulated, PackedGqaDecodeRows) {
  // Decode-shaped GQA (Sq * group <= 128): the query heads of a group are rows of one block.
  Case c = base(FP_F16, 128, 3, 77);
  c.hq = 8, c.hkv = 2, c.causal = true, c.sinks = true;
  check(c, /*expect_pack=*/4);
  Case d = base(FP_BF16, 64, 1, 200);  // one query row: 3 of 4 waves have no rows (inactive)
  d.hq = 4, d.hkv = 1, d.alibi = true;
  check(d, /*expect_pack=*/4);
}

TEST(AmdTileEmulated, OddStridesTakeScalarPaths) {
  Case c = base(FP_BF16, 64, 19, 45);  // row strides d + 1: no 16-byte copies, no pair stores
  c.odd_strides = true, c.causal = true, c.softcap = 15.0f;
  check(c);
}
