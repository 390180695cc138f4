// The forward main loop shared by CUDA and HIP (src/gpu/mma/fwd_kernel.cuh), unchanged, on the AMD
// tile-MMA layer (src/gpu/amd/tile_mma_amd.hpp) and the AMD tile rows (tile_config.hpp), run on the
// CPU by the workgroup emulation of simt_emu.hpp in one target's register layout (this file is
// compiled once per layout: MFMA wave64, WMMA gfx11 wave32, WMMA gfx12 wave32, and the plain path
// of other gfx targets in wave64 and wave32), against the fp64 reference backend. Every
// workgroup of the launch the HIP backend would make (amd_plan.hpp: tile row, packed GQA rows,
// grid, kernel arguments) runs in turn. Proves the loop and its use of the AMD layer: padded
// shared tiles, the K/V loaders and the plain-copy schedule, transposed products, accumulator ->
// operand, the row ownership and cross-lane reductions, the warp vote, masks, softcap, ALiBi,
// dropout, sinks, packed GQA rows, inactive waves, the epilogue's stores; and the HIP plan's
// other launches with the aux kernels shared with CUDA (aux_kernels.cu): split-KV partials in a
// NaN-filled workspace + the combine, KV-cache append + rotary before the loop (caches checked
// too), the public merge op and its backward, and the plan's split count, workspace and refusals. The matrix instruction
// is emulated from the layouts that layout_test.cpp checks against AMD's documentation (the
// plain path runs its own shuffle code). It is not a run on AMD hardware: what it can't show is
// timing, the compiler's code for the builtins and fences, and memory-model effects (one lane
// runs at a time).
#include "gpu/amd/amd_layouts.hpp"
#include "simt_emu.hpp"
// After the emulation header:
#include "gpu/amd/amd_plan.hpp"
#include "gpu/mma/fwd_kernel.cuh"
#include "gpu/common/aux_kernels.cu"  // the aux kernels (split combine / merge, append + rotary), as built for HIP

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/validate.hpp"
#include "test_util.hpp"

namespace {

using flashport::Problem;
using flashport::test::HostTensor;
using flashport::test::cumsum;
using flashport::test::to_f64;
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
  int32_t num_splits = 1;    // as the caller asks (0 auto: the heuristic over compute_units)
  int64_t compute_units = 0; // the device's CU count the plan sees
  bool cache = false;        // KV cache [B, Sk, Hkv, *] with seqused_k (paged: block table)
  int64_t snew = 0;          // rows appended to the cache
  int64_t rot_dim = 0;       // rotary on q and the appended k
  bool rot_interleaved = false;
};

struct Tensors {
  HostTensor q, k, v, out, lse, cu_q, cu_k, seqused, block_table, alibi, sinks, k_new, v_new, cos, sin;
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
  if (c.paged || c.cache) p.seqused_k = t.seqused.view();
  if (c.paged) p.block_table = t.block_table.view();
  if (c.snew > 0) p.k_new = t.k_new.view(), p.v_new = t.v_new.view();
  if (c.rot_dim > 0) {
    p.rotary_cos = t.cos.view(), p.rotary_sin = t.sin.view();
    p.rotary_interleaved = c.rot_interleaved;
  }
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
  p.num_splits = c.num_splits;
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
      used.push_back(static_cast<int32_t>(std::uniform_int_distribution<int64_t>(c.snew > 0 ? 0 : 1, c.sk - c.snew)(test_rng())));
    t.block_table = HostTensor::i32({c.batch, max_blocks}, ids);
    t.seqused = HostTensor::i32({c.batch}, used);
    t.q = HostTensor(dt, {c.batch, c.sq, c.hq, c.d});
    t.k = HostTensor(dt, {pool, c.page_size, c.hkv, c.d});
    t.v = HostTensor(dt, {pool, c.page_size, c.hkv, c.dv});
    t.out = HostTensor(dt, {c.batch, c.sq, c.hq, c.dv});
    t.lse = HostTensor(FP_F32, {c.batch, c.hq, c.sq});
  } else if (c.cache) {
    std::vector<int32_t> used;
    for (int64_t b = 0; b < c.batch; ++b)
      used.push_back(static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, c.sk - c.snew)(test_rng())));
    t.seqused = HostTensor::i32({c.batch}, used);
    t.q = HostTensor(dt, {c.batch, c.sq, c.hq, c.d});
    t.k = HostTensor(dt, {c.batch, c.sk, c.hkv, c.d});
    t.v = HostTensor(dt, {c.batch, c.sk, c.hkv, c.dv});
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
  if (c.snew > 0) {
    t.k_new = HostTensor(dt, {c.batch, c.snew, c.hkv, c.d});
    t.v_new = HostTensor(dt, {c.batch, c.snew, c.hkv, c.dv});
    t.k_new.fill_normal();
    t.v_new.fill_normal();
  }
  if (c.rot_dim > 0) {  // cos/sin fp32 [Sk + Sq + 1, rot_dim / 2]
    const int64_t rows = c.sk + c.sq + 1;
    t.cos = HostTensor(FP_F32, {rows, c.rot_dim / 2});
    t.sin = HostTensor(FP_F32, {rows, c.rot_dim / 2});
    std::vector<double> cv, sv;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < c.rot_dim / 2; ++j) {
        const double ang = double(r) * std::pow(10000.0, -2.0 * double(j) / double(c.rot_dim));
        cv.push_back(std::cos(ang));
        sv.push_back(std::sin(ang));
      }
    t.cos.from_double(cv);
    t.sin.from_double(sv);
  }
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

// Every workgroup of the merge kernel's launch (aux_kernels.cu launch_merge_w at this wave size).
void run_merge_emulated(const gpu::MergeArgs& m) {
  const gpu::AuxLaunch l = gpu::merge_launch(m, kWarpSize);
  for (unsigned x = 0; x < l.blocks; ++x)
    simt::run_block(l.threads, kWarpSize, {x, 0, 0}, {l.blocks, 1, 1}, 0, [&] { gpu::merge_kernel(m); });
}

template <int kTile>
void run_tile(bool bf16, const gpu::FwdArgs& a) {
  if (bf16) gpu::fwd_kernel<kTile, gpu::BFloat16>(a);
  else gpu::fwd_kernel<kTile, gpu::Half>(a);
}

// Every workgroup of the launches the HIP backend would make (hip_backend.hip run_fwd, in stream
// order): append + rotary pre-pass, main loop over (row blocks, heads, batch x splits), split
// combine; the workspace starts as NaN bytes (its content on entry is anything).
void run_emulated(const Problem& p, int expect_pack, int64_t compute_units, int expect_splits) {
  ASSERT_EQ(gpu::amd_fwd_refusal(p), "");
  const gpu::AmdFwdLaunch l = gpu::amd_fwd_launch(p, compute_units);
  ASSERT_EQ(gpu::amd_grid_refusal(l), "");
  if (expect_pack > 0) {
    ASSERT_EQ(l.pack, expect_pack);
  }
  if (expect_splits > 0) {
    ASSERT_EQ(l.splits, expect_splits);
  } else if (expect_splits < 0) {
    ASSERT_GT(l.splits, 1);
  }
  std::vector<unsigned char> workspace(l.ws_bytes, 0xff);
  void* ws = workspace.empty() ? nullptr : workspace.data();
  const bool bf16 = p.dtype == FP_BF16;
  if (l.append || l.rotary_q) {
    const gpu::AppendArgs ap = gpu::amd_append_args(p, l, ws);
    auto run_grid = [&](const gpu::AuxLaunch& g, auto&& kernel) {
      for (unsigned x = 0; x < g.blocks; ++x)
        simt::run_block(g.threads, kWarpSize, {x, 0, 0}, {g.blocks, 1, 1}, 0, kernel);
    };
    run_grid(gpu::append_rotate_launch(ap, 2, kWarpSize), [&] {
      if (bf16) gpu::append_rotate_kernel<gpu::BFloat16>(ap);
      else gpu::append_rotate_kernel<gpu::Half>(ap);
    });
  }
  const gpu::FwdArgs a = gpu::amd_fwd_args(p, l, ws);
  const gpu::TileConfig& c = gpu::kTileConfigs[l.tile];
  const simt::Idx3 grid{unsigned(l.m_blocks), unsigned(l.heads_grid), unsigned(l.batch * l.splits)};
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
  if (l.splits > 1) run_merge_emulated(gpu::amd_combine_args(p, l, ws));
}

// expect_pack > 0: the plan must pack that many query heads per block (the rule is the HIP
// plan's; several cases below pack 2 heads by it too). expect_splits > 0: that split count;
// < 0: more than one.
void check(Case c, int expect_pack = 0, int expect_splits = 0) {
  Tensors t = build(c);
  // fp64 reference on exact fp64 copies of the inputs.
  Tensors r;
  r.q = to_f64(t.q), r.k = to_f64(t.k), r.v = to_f64(t.v);
  r.out = HostTensor(FP_F64, t.out.shape()), r.lse = HostTensor(FP_F64, t.lse.shape());
  r.cu_q = t.cu_q, r.cu_k = t.cu_k, r.seqused = t.seqused, r.block_table = t.block_table;
  r.k_new = to_f64(t.k_new), r.v_new = to_f64(t.v_new), r.cos = t.cos, r.sin = t.sin;
  r.alibi = t.alibi, r.sinks = t.sinks;
  fp_attn_params rp = params_of(c, r, FP_BACKEND_REFERENCE);
  ASSERT_EQ(fp_attn_fwd(&rp), FP_OK) << fp_last_error();

  const fp_attn_params p = params_of(c, t, FP_BACKEND_AUTO);
  Problem prob;
  const flashport::Status st = flashport::resolve_fwd(p, &prob);
  ASSERT_TRUE(st.is_ok()) << st.message();
  run_emulated(prob, expect_pack, c.compute_units, expect_splits);

  EXPECT_TRUE(t.out.guards_intact());
  EXPECT_TRUE(t.lse.guards_intact());
  EXPECT_TRUE(t.out.all_written());
  EXPECT_TRUE(t.lse.all_written());
  EXPECT_TRUE(flashport::test::close(t.out, r.out, flashport::test::tolerance(c.dtype), "out"));
  // With rotary the rotated q and k are stored in the 16-bit dtype (the fp64 oracle keeps them
  // exact), so scores differ by that rounding.
  const double lse_tol = c.rot_dim > 0 ? flashport::test::tolerance(c.dtype) / 4 : flashport::test::tolerance(FP_F32) * 20;
  EXPECT_TRUE(flashport::test::close(t.lse, r.lse, lse_tol, "lse"));
  if (c.snew > 0) {  // the caches after the append (untouched rows must be unchanged)
    EXPECT_TRUE(flashport::test::close(t.k, r.k, flashport::test::tolerance(c.dtype), "k cache"));
    EXPECT_TRUE(flashport::test::close(t.v, r.v, flashport::test::tolerance(c.dtype), "v cache"));
    EXPECT_TRUE(t.k.guards_intact());
    EXPECT_TRUE(t.v.guards_intact());
  }
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

// Split-KV on AMD: the main loop over key ranges writing fp32 partials to the workspace (NaN on
// entry), then the combine kernel. Forced counts (one that leaves a split empty for short rows)
// and the heuristic over a device's CU count.
TEST(AmdTileEmulated, SplitKvForcedAndAuto) {
  Case c = base(FP_F16, 64, 5, 333);  // 6 key blocks of 64
  c.causal = true, c.num_splits = 3, c.sinks = true;
  check(c, 0, 3);
  Case d = base(FP_BF16, 128, 1, 1025);  // decode-shaped, packed GQA rows, odd key count
  d.hq = 4, d.hkv = 2, d.num_splits = 0, d.compute_units = 104, d.softcap = 20.0f;
  check(d, 2, -1);  // more than one split: 4 tiles on 104 CUs
  Case v = base(FP_F16, 64, 0, 0);  // varlen: packed out/lse through cu_q in the combine
  v.lq = {3, 1, 40}, v.lk = {200, 7, 130}, v.num_splits = 4, v.wl = 50;
  check(v, 0, 4);
}

// KV-cache append (+ rotary on the appended k and on q, half-split and interleaved) before the
// main loop, with and without split-KV: caches and outputs against the fp64 oracle.
TEST(AmdTileEmulated, KvCacheAppendRotary) {
  Case c = base(FP_F16, 64, 3, 90);
  c.cache = true, c.snew = 3, c.causal = true, c.rot_dim = 32;
  check(c);
  Case d = base(FP_BF16, 128, 2, 200);
  d.hq = 4, d.hkv = 2, d.cache = true, d.snew = 2, d.rot_dim = 128, d.rot_interleaved = true, d.num_splits = 2;
  check(d, 0, 2);
  Case e = base(FP_F16, 64, 1, 70);  // paged cache, append only (no rotary)
  e.paged = true, e.page_size = 16, e.snew = 1;
  check(e);
}

// The pre-pass's two row shapes (aux_kernels.cu row_units): 16-byte units (dims and rotary pairs
// in whole chunks, rows aligned) and the element-wise fallback, each with half-split and
// interleaved pairs, more heads than one thread moves (kAppendHeads) and a ragged last group.
TEST(AmdTileEmulated, KvCacheAppendRotaryVectorAndScalarRows) {
  struct R { int64_t d, rot; bool interleaved, paged; };
  for (R r : {R{72, 40, false, false},   // half 20: pairs straddle chunks -> element-wise q and k, 16-byte v
              R{72, 40, true, true},     // interleaved, 40 a multiple of 8: 16-byte units, paged (page 7)
              R{36, 16, true, false},    // 36 not a multiple of 8: element-wise everything
              R{128, 64, false, true}}) {  // the serving shape: half-split 16-byte pairs of chunks
    SCOPED_TRACE("d " + std::to_string(r.d) + " rot " + std::to_string(r.rot) + (r.interleaved ? " interleaved" : ""));
    Case c = base(FP_BF16, r.d, 4, 60);
    c.hq = 10, c.hkv = 5, c.cache = !r.paged, c.paged = r.paged, c.page_size = 7, c.snew = 4, c.causal = true;
    c.rot_dim = r.rot, c.rot_interleaved = r.interleaved;
    check(c);
  }
}

// ---- the public merge op (fp_merge_fwd) and its backward on AMD: the aux kernels as the HIP
// backend launches them (amd_merge_args), against the fp64 oracle --------------------------------
namespace {

struct MergeCase {
  fp_dtype part = FP_F32, out = FP_F16;
  int64_t splits = 3, batch = 2, seqlen = 5, heads = 3, dv = 75;
};

struct MergeTensors {
  HostTensor part, lse_part, out, lse;
};

// Random partials; about one lse partial in five is -inf (its partial NaN on the emulated side:
// an empty split contributes nothing whatever it holds), and row (0, 0, 0) is empty in every split.
void build_merge(const MergeCase& c, MergeTensors* t, MergeTensors* r) {
  t->part = HostTensor(c.part, {c.splits, c.batch, c.seqlen, c.heads, c.dv});
  t->lse_part = HostTensor(FP_F32, {c.splits, c.batch, c.heads, c.seqlen});
  t->part.fill_normal();
  t->lse_part.fill_uniform(-3.0, 3.0);
  std::vector<double> lp = t->lse_part.to_double(), pv = t->part.to_double();
  std::vector<double> pv_ref = pv;
  std::uniform_int_distribution<int> pick(0, 4);
  for (int64_t sp = 0; sp < c.splits; ++sp)
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.heads; ++h)
        for (int64_t s = 0; s < c.seqlen; ++s) {
          const bool empty = (b == 0 && h == 0 && s == 0) || pick(test_rng()) == 0;
          if (!empty) continue;
          lp[((sp * c.batch + b) * c.heads + h) * c.seqlen + s] = -INFINITY;
          for (int64_t d = 0; d < c.dv; ++d)
            pv[(((sp * c.batch + b) * c.seqlen + s) * c.heads + h) * c.dv + d] = NAN;
        }
  t->lse_part.from_double(lp);
  t->part.from_double(pv);
  t->out = HostTensor(c.out, {c.batch, c.seqlen, c.heads, c.dv});
  t->lse = HostTensor(FP_F32, {c.batch, c.heads, c.seqlen});
  t->out.fill_poison();
  t->lse.fill_poison();
  r->part = HostTensor(FP_F64, t->part.shape());
  HostTensor rounded(c.part, t->part.shape());  // the reference sees the dtype-rounded values
  rounded.from_double(pv_ref);
  r->part.from_double(rounded.to_double());
  r->lse_part = to_f64(t->lse_part);
  r->out = HostTensor(FP_F64, t->out.shape());
  r->lse = HostTensor(FP_F64, t->lse.shape());
}

fp_merge_params merge_params(const MergeTensors& t, fp_backend backend) {
  fp_merge_params p;
  fp_merge_params_init(&p);
  p.out_partials = t.part.view(), p.lse_partials = t.lse_part.view();
  p.out = t.out.view(), p.lse = t.lse.view();
  p.backend = backend;
  return p;
}

void check_merge(const MergeCase& c) {
  MergeTensors t, r;
  build_merge(c, &t, &r);
  fp_merge_params rp = merge_params(r, FP_BACKEND_REFERENCE);
  ASSERT_EQ(fp_merge_fwd(&rp), FP_OK) << fp_last_error();
  const fp_merge_params p = merge_params(t, FP_BACKEND_AUTO);
  flashport::MergeProblem prob;
  const flashport::Status st = flashport::resolve_merge(p, &prob);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(gpu::amd_merge_refusal(prob), "");
  run_merge_emulated(gpu::merge_args(prob));
  EXPECT_TRUE(t.out.guards_intact());
  EXPECT_TRUE(t.lse.guards_intact());
  EXPECT_TRUE(t.out.all_written());
  EXPECT_TRUE(t.lse.all_written());
  const double tol = std::max(flashport::test::tolerance(c.out), flashport::test::tolerance(c.part));
  EXPECT_TRUE(flashport::test::close(t.out, r.out, tol, "merged out"));
  EXPECT_TRUE(flashport::test::close(t.lse, r.lse, flashport::test::tolerance(FP_F32) * 20, "merged lse"));
}

}  // namespace

TEST(AmdAuxEmulated, MergeOpDtypesAndOddSizes) {
  check_merge({FP_F32, FP_F16, 3, 2, 5, 3, 75});   // dv 75: a partial chunk of lanes
  check_merge({FP_F16, FP_BF16, 1, 1, 3, 2, 130});  // one split; dv over two 64-lane chunks
  check_merge({FP_BF16, FP_F32, 70, 1, 2, 1, 33});  // more splits than lanes (lane loop + unroll tail)
  // Rows of 4-column vectors (dv a multiple of 4, aligned): one vector access per split and lane.
  check_merge({FP_F32, FP_F32, 32, 1, 1, 4, 128});  // the decode combine: one batch of 32 splits
  check_merge({FP_F32, FP_BF16, 45, 2, 3, 2, 64});  // two batches, a ragged second one
  check_merge({FP_F16, FP_F16, 3, 1, 2, 3, 260});   // 16-bit partials, dv past one chunk of lanes
}

TEST(AmdAuxEmulated, MergeBackward) {
  MergeCase c{FP_F32, FP_F32, 5, 2, 3, 2, 67};
  MergeTensors t, r;
  build_merge(c, &t, &r);
  // The forward on the reference (fp64) gives out/lse for both sides.
  fp_merge_params rp = merge_params(r, FP_BACKEND_REFERENCE);
  ASSERT_EQ(fp_merge_fwd(&rp), FP_OK) << fp_last_error();
  // Empty splits' partials: the backward reads them for the dot product only with weight 0.
  t.out.from_double(r.out.to_double());
  t.lse.from_double(r.lse.to_double());
  HostTensor dout(FP_F32, t.out.shape()), dlse(FP_F32, t.lse.shape());
  dout.fill_normal();
  dlse.fill_normal();
  HostTensor d_part(FP_F32, t.part.shape()), d_lse_part(FP_F32, t.lse_part.shape());
  d_part.fill_poison();
  d_lse_part.fill_poison();
  HostTensor rd_part(FP_F64, t.part.shape()), rd_lse_part(FP_F64, t.lse_part.shape());
  HostTensor rdout = to_f64(dout), rdlse = to_f64(dlse);
  fp_merge_bwd_params rb;
  fp_merge_bwd_params_init(&rb);
  rb.fwd = rp;
  rb.dout = rdout.view(), rb.dlse = rdlse.view();
  rb.d_out_partials = rd_part.view(), rb.d_lse_partials = rd_lse_part.view();
  ASSERT_EQ(fp_merge_bwd(&rb), FP_OK) << fp_last_error();

  fp_merge_bwd_params b;
  fp_merge_bwd_params_init(&b);
  b.fwd = merge_params(t, FP_BACKEND_AUTO);
  b.dout = dout.view(), b.dlse = dlse.view();
  b.d_out_partials = d_part.view(), b.d_lse_partials = d_lse_part.view();
  flashport::MergeBwdProblem prob;
  const flashport::Status st = flashport::resolve_merge_bwd(b, &prob);
  ASSERT_TRUE(st.is_ok()) << st.message();
  gpu::MergeBwdArgs g;
  g.fwd = gpu::merge_args(prob.fwd);
  g.dout = dout.storage(), g.dlse = static_cast<const float*>(dlse.storage());
  g.d_part = d_part.storage(), g.d_lse_part = static_cast<float*>(d_lse_part.storage());
  std::memcpy(g.dout_stride, prob.dout_stride, sizeof(g.dout_stride));
  std::memcpy(g.dlse_stride, prob.dlse_stride, sizeof(g.dlse_stride));
  std::memcpy(g.d_part_stride, prob.d_part_stride, sizeof(g.d_part_stride));
  std::memcpy(g.d_lse_part_stride, prob.d_lse_part_stride, sizeof(g.d_lse_part_stride));
  const unsigned blocks = unsigned((gpu::merge_bwd_items(g) + gpu::kMergeWarps - 1) / gpu::kMergeWarps);
  for (unsigned x = 0; x < blocks; ++x)
    simt::run_block(unsigned(gpu::kMergeWarps * kWarpSize), kWarpSize, {x, 0, 0}, {blocks, 1, 1}, 0,
                    [&] { gpu::merge_bwd_kernel(g); });
  EXPECT_TRUE(d_part.guards_intact());
  EXPECT_TRUE(d_lse_part.guards_intact());
  EXPECT_TRUE(d_part.all_written());
  EXPECT_TRUE(d_lse_part.all_written());
  EXPECT_TRUE(flashport::test::close(d_part, rd_part, flashport::test::tolerance(FP_F32), "d partials"));
  EXPECT_TRUE(flashport::test::close(d_lse_part, rd_lse_part, flashport::test::tolerance(FP_F32) * 20, "d lse partials"));
}

// ---- the HIP plan (amd_plan.hpp): what it now takes, its split count and workspace, and what it
// still refuses ----------------------------------------------------------------------------------
namespace {
Problem resolved(Case& c, Tensors* t) {
  *t = build(c);
  const fp_attn_params p = params_of(c, *t, FP_BACKEND_AUTO);
  Problem prob;
  const flashport::Status st = flashport::resolve_fwd(p, &prob);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return prob;
}
}  // namespace

TEST(AmdPlan, SplitCountAndWorkspace) {
  Tensors t;
  Case c = base(FP_F16, 64, 1, 4096);  // 2 x 2 tiles, 64 key blocks
  c.num_splits = 0;
  Problem p = resolved(c, &t);
  EXPECT_EQ(gpu::amd_fwd_refusal(p), "");
  EXPECT_EQ(gpu::amd_fwd_launch(p, 0).splits, 1);        // no device facts: no split
  const gpu::AmdFwdLaunch many = gpu::amd_fwd_launch(p, 304);
  EXPECT_EQ(many.splits, flashport::resolve_num_splits(0, many.work_tiles, many.key_blocks, 304, gpu::kMaxSplits));
  EXPECT_GT(many.splits, 1);
  EXPECT_EQ(many.ws.o_offset, 0u);
  EXPECT_EQ(many.ws.lse_offset % 256, 0u);
  EXPECT_GE(many.ws.lse_offset, size_t(many.splits) * size_t(many.ws.rows) * size_t(p.dv) * 4);
  EXPECT_GE(many.ws_bytes, many.ws.lse_offset + size_t(many.splits) * size_t(many.ws.rows) * 4);
  EXPECT_EQ(many.ws.rows, p.seq.batch * p.hq * p.seq.sq);
  c.num_splits = 1;  // off, whatever the device
  p = resolved(c, &t);
  EXPECT_EQ(gpu::amd_fwd_launch(p, 304).splits, 1);
  EXPECT_EQ(gpu::amd_fwd_launch(p, 304).ws_bytes, 0u);
  c.num_splits = 100000;  // forced beyond the key blocks: clamped to them
  p = resolved(c, &t);
  const gpu::AmdFwdLaunch clamped = gpu::amd_fwd_launch(p, 304);
  EXPECT_EQ(clamped.splits, clamped.key_blocks);
  c.num_splits = 64;  // batch x splits over the grid's z limit (the plan reads shapes only)
  p = resolved(c, &t);
  EXPECT_EQ(gpu::amd_grid_refusal(gpu::amd_fwd_launch(p, 304)), "");
  p.seq.batch = 1100;
  EXPECT_NE(gpu::amd_grid_refusal(gpu::amd_fwd_launch(p, 304)), "");
}

TEST(AmdPlan, AppendRotaryWorkspaceAndRefusals) {
  Tensors t;
  Case c = base(FP_BF16, 100, 3, 50);
  c.cache = true, c.snew = 2, c.rot_dim = 64;
  Problem p = resolved(c, &t);
  EXPECT_EQ(gpu::amd_fwd_refusal(p), "");
  const gpu::AmdFwdLaunch l = gpu::amd_fwd_launch(p, 0);
  EXPECT_TRUE(l.append);
  EXPECT_TRUE(l.rotary_q);
  EXPECT_EQ(l.ws.q_rot_row_stride, p.hq * 104);  // head dim rounded to 8 elements
  EXPECT_EQ(l.ws_bytes, (size_t(p.total_q_rows) * size_t(l.ws.q_rot_row_stride) * 2 + 255) / 256 * 256);
  // rotary tables in a third dtype: refused by name
  Tensors t2;
  Case d = c;
  Problem q = resolved(d, &t2);
  q.rotary_dtype = FP_F16;  // q is bf16
  EXPECT_NE(gpu::amd_fwd_refusal(q).find("rotary"), std::string::npos);
  q.rotary_dtype = FP_F32;
  q.dtype = FP_F32;
  EXPECT_NE(gpu::amd_fwd_refusal(q).find("dtype"), std::string::npos);
}

TEST(AmdPlan, MergeRefusals) {
  MergeCase c{FP_F32, FP_F32, 2, 1, 2, 1, 8};
  MergeTensors t, r;
  build_merge(c, &t, &r);
  fp_merge_params p = merge_params(t, FP_BACKEND_AUTO);
  flashport::MergeProblem prob;
  ASSERT_TRUE(flashport::resolve_merge(p, &prob).is_ok());
  EXPECT_EQ(gpu::amd_merge_refusal(prob), "");
  fp_merge_params p64 = merge_params(r, FP_BACKEND_AUTO);  // fp64 partials and lse
  flashport::MergeProblem prob64;
  ASSERT_TRUE(flashport::resolve_merge(p64, &prob64).is_ok());
  EXPECT_NE(gpu::amd_merge_refusal(prob64), "");
}
