// CUDA forward against the fp64 reference: randomized shapes and every feature, poisoned
// outputs, sentinels, NaN checks, odd lengths, GQA, varlen, KV cache (contiguous and paged),
// append + rotary, split-KV, the merge op, CUDA-graph capture. Skipped without a CUDA device.
#include <cuda_runtime.h>

#include <cstdlib>

#include "core/heuristics.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu_harness.hpp"
#include "scenarios.hpp"

namespace gputest {
namespace {

using flashport::test::close;

TEST(CudaFwd, BackendAvailableAndNamed) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(fp_backend_available(FP_BACKEND_CUDA), 1);
}

TEST(CudaFwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 32, 40, 96, 160, 200, 8}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {1025, 77}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1;
      c.d = d, c.dv = d;
      c.sq = sq, c.sk = sk;
      check_case(c);
    }
  }
}

TEST(CudaFwd, ScalarPathForUnalignedHeadDims) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {3, 5, 17, 250}) {
    Case c;
    c.dtype = rand_dtype();
    c.hq = 3, c.hkv = 3, c.d = d, c.dv = d;
    c.sq = 70, c.sk = 133;
    check_case(c);
  }
}

TEST(CudaFwd, DqDifferentFromDv) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : kDqDvPairs) {
    Case c = rand_dtype_case();
    set_dq_dv_case(c, d, dv);
    check_case(c);
  }
}

TEST(CudaFwd, GqaRatiosPrefillAndDecode) {
  SKIP_WITHOUT_GPU();
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 4}, {8, 2}, {8, 1}, {12, 3}, {32, 8}}) {
    for (int64_t sq : {1, 2, 7, 200}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = 128, c.dv = 128, c.sq = sq, c.sk = 517;
      c.causal = sq > 1 && rand_int(0, 1);
      check_case(c);
    }
  }
}

TEST(CudaFwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for_each_causal_window_case(rand_dtype_case, [](const Case& c) { check_case(c); });
}

TEST(CudaFwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for_each_score_feature_case(rand_dtype_case, [](const Case& c) { check_case(c); });
}

TEST(CudaFwd, RowsWithoutKeysGetZeroAndMinusInf) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.hq = 2, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 200, c.sk = 50;
  c.causal = true;  // bottom-right: the first 150 rows see nothing
  check_case(c);
}

TEST(CudaFwd, Dropout) {
  SKIP_WITHOUT_GPU();
  for (float p : kDropoutRates) {
    for (int64_t d : {64, 128, 256}) {
      Case c = rand_dtype_case();
      set_dropout_fwd_case(c, d, p);
      check_case(c);
      c.sq = 1;  // decode tile, packed GQA rows
      check_case(c);
    }
  }
}

TEST(CudaFwd, NoLseAndStridedTensors) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 90, c.sk = 200;
  c.lse = false;
  check_case(c);
  c.lse = true;
  c.strided = true;
  check_case(c);
  c.d = 40, c.dv = 40;  // strides not multiples of 8 -> scalar loads
  check_case(c);
}

TEST(CudaFwd, Varlen) {
  SKIP_WITHOUT_GPU();
  for_each_random_varlen_case(rand_dtype_case, [](const Case& c) { check_case(c); });
}

TEST(CudaFwd, SplitKvForcedAndAuto) {
  SKIP_WITHOUT_GPU();
  for (int32_t s : {0, 2, 3, 7, 64}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 1, c.hq = 4, c.hkv = 4, c.d = 64, c.dv = 64, c.sq = 70, c.sk = 3000, c.splits = s;
    c.causal = s == 3;
    c.sinks = s == 7;
    c.dropout = s == 2 ? 0.2f : 0.0f;
    fp_selection sel{};
    check_case(c, &sel);
    // Forced counts are clamped to the key blocks of the tile that runs.
    const int64_t bn = flashport::gpu::kTileConfigs[flashport::gpu::tile_id_for(64, false)].block_n;
    if (s >= 2) EXPECT_EQ(sel.num_splits, std::min<int64_t>(s, (c.sk + bn - 1) / bn));
    if (s == 0) EXPECT_GT(sel.num_splits, 1) << "4 tiles on a whole GPU should split";
  }
  // Decode shape: auto split over 32 query heads packed into 8 kv heads.
  Case c;
  c.dtype = FP_BF16;
  c.batch = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 8192, c.splits = 0;
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_GT(sel.num_splits, 1);
}

TEST(CudaFwd, KvCacheContiguous) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 4; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true;
    c.batch = 3, c.hq = 8, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = rep < 2 ? 1 : 33, c.sk = 700;
    c.batch_idx = rep % 2;
    c.causal = rep >= 2;
    check_case(c);
  }
}

TEST(CudaFwd, KvCachePagedAnyPageSize) {
  SKIP_WITHOUT_GPU();
  for (int64_t ps : {1, 7, 16, 64, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.paged = true, c.page_size = ps;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = ps == 7 ? 20 : 1, c.sk = 600;
    c.causal = true;
    check_case(c);
  }
}

// Page ids in a device-resident block table are not validated: an id below 0 reads page 0 and one
// past the pool the pool's last page (kernel_args.hpp clamp_page_id), never a fault. The fp64
// reference runs the same call with those ids clamped on the host. Decode-shaped calls (5 query
// rows: the mma.sync decode tile) and prefill chunks (300 rows: on sm_90 the Hopper kernel, pages
// of 8 rows by its kv_rows producer, of 16 and 64 by one TMA box per page), and the fp32 kernel.
TEST(CudaFwd, KvCachePagedDeviceIdsAreClamped) {
  SKIP_WITHOUT_GPU();
  for (fp_dtype dtype : {rand_dtype(), FP_F32})
  for (int64_t page : {8, 16, 64})
  for (int64_t sq : {5, 300}) {
    Case c;
    c.dtype = dtype;
    c.cache = true, c.paged = true, c.page_size = page;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = sq, c.sk = 200;
    c.seqused = {200, 150};
    c.causal = true;
    SCOPED_TRACE(c.describe());
    Call call(c);
    DeviceCall dev(call);
    const int32_t pool = static_cast<int32_t>(call.k.dim(0));
    std::vector<int32_t> ids = call.block_table.to_i32();
    ids[1] = -7, ids[3] = pool + 50;  // sequence 0, its second and fourth pages
    const HostTensor bad = HostTensor::i32(call.block_table.shape(), ids);
    dev.block_table.upload(bad);  // same shape: the views stay valid
    dev.views.block_table = dev.block_table.view(bad);
    call.block_table.set_linear(1, 0.0);
    call.block_table.set_linear(3, double(pool - 1));
    const Outputs ref = run_reference(call);
    ASSERT_TRUE(ref.ok) << ref.error;
    const Outputs got = run_cuda(call, dev);
    ASSERT_TRUE(got.ok) << got.error;
    SCOPED_TRACE(std::string("kernel ") + got.sel.kernel);
    const double tol = flashport::test::tolerance(c.dtype);
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false), gather_rows(call, ref.out, false), tol,
                                       "out"));
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.lse, true), gather_rows(call, ref.lse, true), 1e-4,
                                       "lse"));
    EXPECT_TRUE(dev.out.sentinel_intact());
  }
}

TEST(CudaFwd, AppendThenAttendWithRotary) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 6; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true;
    c.paged = rep >= 3;
    c.page_size = 16;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sk = 400;
    c.snew = rep % 3 == 0 ? 1 : 5;
    c.sq = c.snew;
    c.causal = rep % 2 == 0;
    c.rot_dim = rep == 0 ? 0 : (rep % 2 ? 64 : 32);
    c.rot_interleaved = rep % 3 == 1;
    check_case(c);
  }
  // The pre-pass moves 16-byte chunks where the rotary pairs stay inside them (rot_dim / 2 a
  // multiple of 8, or interleaved pairs with rot_dim a multiple of 8) and the rows are 16-byte
  // aligned, else element by element: rotary dims and head dims on both sides of that line.
  struct R { int64_t d, rot; bool interleaved; };
  for (R r : {R{64, 24, false}, R{64, 24, true}, R{64, 8, false}, R{40, 16, false}, R{36, 16, true}, R{128, 128, false},
              R{128, 6, true}}) {
    SCOPED_TRACE("d " + std::to_string(r.d) + " rot " + std::to_string(r.rot) + (r.interleaved ? " interleaved" : ""));
    Case c;
    c.dtype = rand_dtype();
    c.cache = true;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = r.d, c.dv = r.d, c.sk = 300;
    c.snew = 7, c.sq = 7, c.causal = true;
    c.rot_dim = r.rot, c.rot_interleaved = r.interleaved;
    check_case(c);
  }
}

// The append / rotary-q pre-pass (aux_kernels.cu) moves a row in 16-byte units where every row is
// 16-byte aligned and the dims and rotary pairs come in whole chunks, else element by element;
// a thread moves one unit of up to 4 heads (cos/sin read once for them). Both row shapes, both
// pair layouts, fp32 and 16-bit tables, the serving shape (32 q heads, 8 kv heads, D 128, rotary
// 64: several head groups), a ragged last head group, unaligned rows (odd row strides), paged
// caches (pages not a multiple of the appended rows), cache_batch_idx and left pads.
TEST(CudaFwd, AppendRotaryVectorAndScalarRows) {
  SKIP_WITHOUT_GPU();
  struct R { int64_t d, rot; bool interleaved, tables16, odd_rows; int layout; };  // 0 cache, 1 paged, 2 batch_idx, 3 leftpad
  for (R r : {R{128, 64, false, false, false, 0}, R{128, 64, false, true, false, 1}, R{128, 64, true, false, false, 2},
              R{72, 40, false, false, false, 3}, R{72, 40, true, true, false, 1}, R{36, 16, true, false, false, 0},
              R{128, 64, false, false, true, 0}, R{64, 32, true, true, true, 1}, R{256, 256, false, false, false, 3}}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true;
    c.paged = r.layout == 1, c.page_size = 7;
    c.batch_idx = r.layout == 2;
    c.batch = 2, c.hq = r.d == 128 ? 32 : 12, c.hkv = r.d == 128 ? 8 : 3, c.d = r.d, c.dv = r.d, c.sk = 300;
    c.snew = 9, c.sq = 9, c.causal = true;
    if (r.layout == 3) c.seqused = {40, 250}, c.leftpad = {5, 31};
    c.rot_dim = r.rot, c.rot_interleaved = r.interleaved, c.rot_tables_16bit = r.tables16;
    c.odd_rows = r.odd_rows;
    check_case(c);
  }
  // Decode: one appended row, q rotated at a single position, split-KV combine after it.
  Case d;
  d.dtype = FP_BF16;
  d.cache = true, d.batch = 1, d.hq = 32, d.hkv = 8, d.d = 128, d.dv = 128, d.sk = 4096, d.snew = 1, d.sq = 1;
  d.seqused = {4000}, d.rot_dim = 64, d.splits = 0;
  fp_selection sel{};
  check_case(d, &sel);
  EXPECT_GT(sel.num_splits, 1);
}

TEST(CudaFwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 24; ++rep) {
    Case c;
    c.dtype = rand_dtype();
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
    if (!c.causal && rand_int(0, 2) == 0) c.wl = int32_t(rand_int(0, 100)), c.wr = int32_t(rand_int(-1, 100));
    if (rand_int(0, 3) == 0) c.softcap = 20.0f;
    c.alibi = rand_int(0, 3) == 0;
    c.sinks = rand_int(0, 3) == 0;
    c.dropout = rand_int(0, 4) == 0 ? 0.15f : 0.0f;
    c.splits = rand_int(0, 2) == 0 ? int32_t(rand_int(0, 5)) : 1;
    check_case(c);
  }
}

// ---- merge op ------------------------------------------------------------------------------

// The merge moves 4 columns a lane: one vector access where the rows allow (dv a multiple of 4,
// aligned rows), else 4 scalar ones (dv 75); up to 32 splits in flight, more in batches (40).
TEST(CudaMerge, MatchesReference) {
  SKIP_WITHOUT_GPU();
  struct M { fp_dtype pt; int64_t n, dv; };
  for (M m : {M{FP_F32, 5, 72}, M{FP_BF16, 5, 72}, M{FP_F32, 32, 128}, M{FP_F32, 40, 256}, M{FP_F16, 3, 75}}) {
    const fp_dtype pt = m.pt;
    const int64_t n = m.n, b = 2, s = 37, h = 3, dv = m.dv;
    SCOPED_TRACE("splits " + std::to_string(n) + " dv " + std::to_string(dv));
    HostTensor parts(pt, {n, b, s, h, dv}), lses(FP_F32, {n, b, h, s});
    parts.fill_normal();
    lses.fill_uniform(-3, 3);
    // Some partials empty (-inf), one row entirely empty.
    for (int64_t i = 0; i < s; i += 5) lses.set({1, 0, 1, i}, -INFINITY);
    for (int64_t k = 0; k < n; ++k) lses.set({k, 1, 2, 3}, -INFINITY);
    HostTensor out(FP_BF16, {b, s, h, dv}), lse(FP_F32, {b, h, s});
    out.fill_poison();
    lse.fill_poison();
    // Reference on fp64 copies.
    HostTensor p64 = to_f64(parts), l64 = to_f64(lses), o64(FP_F64, {b, s, h, dv}), lo64(FP_F64, {b, h, s});
    fp_merge_params rp;
    fp_merge_params_init(&rp);
    rp.backend = FP_BACKEND_REFERENCE;
    rp.out_partials = p64.view(), rp.lse_partials = l64.view(), rp.out = o64.view(), rp.lse = lo64.view();
    ASSERT_EQ(fp_merge_fwd(&rp), FP_OK) << fp_last_error();
    DevBuf dp, dl, dout, dlse;
    dp.upload(parts), dl.upload(lses), dout.upload(out), dlse.upload(lse);
    fp_merge_params mp;
    fp_merge_params_init(&mp);
    mp.backend = FP_BACKEND_CUDA;
    mp.out_partials = dp.view(parts), mp.lse_partials = dl.view(lses);
    mp.out = dout.view(out), mp.lse = dlse.view(lse);
    ASSERT_EQ(fp_merge_fwd(&mp), FP_OK) << fp_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    dout.download(out), dlse.download(lse);
    EXPECT_TRUE(close(out, o64, flashport::test::tolerance(FP_BF16), "merged out"));
    EXPECT_TRUE(close(lse, lo64, 1e-5, "merged lse"));
    EXPECT_TRUE(dout.sentinel_intact());
    EXPECT_TRUE(dlse.sentinel_intact());
  }
}

TEST(CudaMerge, BackwardMatchesReference) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 4, b = 2, s = 19, h = 3, dv = 40;
  HostTensor parts(FP_F32, {n, b, s, h, dv}), lses(FP_F32, {n, b, h, s});
  parts.fill_normal();
  lses.fill_uniform(-2, 2);
  for (int64_t i = 0; i < s; i += 4) lses.set({2, 1, 0, i}, -INFINITY);
  HostTensor out(FP_F32, {b, s, h, dv}), lse(FP_F32, {b, h, s}), dout(FP_F32, {b, s, h, dv}),
      dlse(FP_F32, {b, h, s});
  dout.fill_normal();
  dlse.fill_normal();
  // Forward on the reference (fp32 tensors) gives out/lse for both backward runs.
  fp_merge_params f;
  fp_merge_params_init(&f);
  f.backend = FP_BACKEND_REFERENCE;
  f.out_partials = parts.view(), f.lse_partials = lses.view(), f.out = out.view(), f.lse = lse.view();
  ASSERT_EQ(fp_merge_fwd(&f), FP_OK) << fp_last_error();
  HostTensor dp_ref(FP_F32, parts.shape()), dl_ref(FP_F32, lses.shape());
  fp_merge_bwd_params r;
  fp_merge_bwd_params_init(&r);
  r.fwd = f;
  r.dout = dout.view(), r.dlse = dlse.view();
  r.d_out_partials = dp_ref.view(), r.d_lse_partials = dl_ref.view();
  ASSERT_EQ(fp_merge_bwd(&r), FP_OK) << fp_last_error();

  DevBuf d_parts, d_lses, d_out, d_lse, d_dout, d_dlse, d_dp, d_dl;
  HostTensor dp(FP_F32, parts.shape()), dl(FP_F32, lses.shape());
  dp.fill_poison();
  dl.fill_poison();
  d_parts.upload(parts), d_lses.upload(lses), d_out.upload(out), d_lse.upload(lse);
  d_dout.upload(dout), d_dlse.upload(dlse), d_dp.upload(dp), d_dl.upload(dl);
  fp_merge_bwd_params g;
  fp_merge_bwd_params_init(&g);
  g.fwd.backend = FP_BACKEND_CUDA;
  g.fwd.out_partials = d_parts.view(parts), g.fwd.lse_partials = d_lses.view(lses);
  g.fwd.out = d_out.view(out), g.fwd.lse = d_lse.view(lse);
  g.dout = d_dout.view(dout), g.dlse = d_dlse.view(dlse);
  g.d_out_partials = d_dp.view(dp), g.d_lse_partials = d_dl.view(dl);
  ASSERT_EQ(fp_merge_bwd(&g), FP_OK) << fp_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  d_dp.download(dp), d_dl.download(dl);
  EXPECT_TRUE(close(dp, dp_ref, 1e-5, "d_out_partials"));
  EXPECT_TRUE(close(dl, dl_ref, 1e-4, "d_lse_partials"));
  EXPECT_TRUE(d_dp.sentinel_intact());
  EXPECT_TRUE(d_dl.sentinel_intact());
}

// ---- CUDA graphs ---------------------------------------------------------------------------

// Graph capture and replay of the case (expect_graph_replay_equals) with at least `min_splits`.
void check_graph(const Case& cs, int min_splits) {
  SCOPED_TRACE(cs.describe());
  Call call(cs);
  DeviceCall direct(call);
  const Outputs want = run_cuda(call, direct);
  ASSERT_TRUE(want.ok) << want.error;
  EXPECT_GE(want.sel.num_splits, min_splits);
  expect_graph_replay_equals(call, want, /*garbage_workspace=*/false);
}

TEST(CudaGraph, PrefillDecodeSplitCaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case prefill;
  prefill.batch = 2, prefill.hq = 4, prefill.hkv = 2, prefill.d = 128, prefill.dv = 128;
  prefill.sq = 300, prefill.sk = 300, prefill.causal = true;
  check_graph(prefill, 1);
  Case decode;
  decode.cache = true, decode.paged = true, decode.page_size = 16;
  decode.batch = 2, decode.hq = 8, decode.hkv = 2, decode.d = 128, decode.dv = 128, decode.sq = 1;
  decode.sk = 2048, decode.snew = 1, decode.rot_dim = 128, decode.splits = 1;
  check_graph(decode, 1);
  Case split = decode;
  split.splits = 0;
  check_graph(split, 2);
  Case forced = prefill;
  forced.splits = 4;
  check_graph(forced, 4);
}

// ---- decode split-KV: partials, then the combine kernel ----------------------------------------

// Runs the case with a workspace full of 0xFF bytes (the partials): checked against the fp64
// reference; then the same call again on the same workspace and three replays of it from a CUDA
// graph must give the first result's bits.
void check_split_decode(const Case& cs, int min_splits) {
  SCOPED_TRACE(cs.describe());
  Call call(cs);
  const Outputs ref = run_reference(call);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceCall dev(call);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
  SCOPED_TRACE(std::string("kernel ") + sel.kernel);
  EXPECT_GE(sel.num_splits, min_splits);
  EXPECT_NE(std::string(sel.kernel).find(":decode_"), std::string::npos) << "a decode tile runs";
  if (sel.num_splits > 1)
    EXPECT_NE(std::string(sel.kernel).find(":splitkv+combine"), std::string::npos);
  HostTensor garbage(FP_F32, {static_cast<int64_t>((sel.workspace_bytes + 3) / 4)});
  DevBuf ws;
  ws.upload(garbage);
  CUDA_OK(cudaMemset(ws.ptr, 0xFF, ws.bytes));
  // The memset runs on the legacy stream, asynchronously; `stream` is non-blocking and would not
  // wait for it.
  CUDA_OK(cudaDeviceSynchronize());
  p.workspace = ws.ptr, p.workspace_bytes = ws.bytes, p.stream = stream;
  ASSERT_EQ(fp_attn_fwd(&p), FP_OK) << fp_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor out = call.out, lse = call.lse;
  dev.out.download(out);
  dev.lse.download(lse);
  const double tol = flashport::test::tolerance(cs.dtype);
  EXPECT_TRUE(flashport::test::close(gather_rows(call, out, false), gather_rows(call, ref.out, false), tol, "out"));
  EXPECT_TRUE(out.all_written());
  EXPECT_TRUE(flashport::test::close(gather_rows(call, lse, true), gather_rows(call, ref.lse, true),
                                     cs.rot_dim > 0 ? tol / 4 : 1e-4, "lse"));
  EXPECT_TRUE(lse.all_written());
  EXPECT_TRUE(dev.out.sentinel_intact() && dev.lse.sentinel_intact() && ws.sentinel_intact());

  // The same call again: poisoned outputs, the workspace as the first call left it.
  dev.out.upload(call.out);
  dev.lse.upload(call.lse);
  ASSERT_EQ(fp_attn_fwd(&p), FP_OK) << fp_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor again = call.out, again_lse = call.lse;
  dev.out.download(again);
  dev.lse.download(again_lse);
  EXPECT_TRUE(again.bitwise_equal(out)) << "second call differs";
  EXPECT_TRUE(again_lse.bitwise_equal(lse)) << "second call's lse differs";

  // Captured once, replayed three times.
  dev.out.upload(call.out);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_fwd(&p);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 3; ++r) {
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    HostTensor replay = call.out;
    dev.out.download(replay);
    EXPECT_TRUE(replay.bitwise_equal(out)) << "graph replay " << r << " differs";
    dev.out.upload(call.out);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaFwdDecode, SplitCountsForcedAndAuto) {
  SKIP_WITHOUT_GPU();
  // Odd key counts (partial last block, splits of unequal length); forced counts past the key
  // blocks are clamped.
  for (auto [sk, s] : {std::pair<int64_t, int32_t>{1000, 2}, {1000, 3}, {1000, 5}, {1000, 8}, {1000, 17},
                       {8191, 37}, {8191, 64}, {8191, 128}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = sk < 8000 ? 2 : 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = sk;
    c.splits = s;
    check_split_decode(c, 2);
  }
  Case c;  // heuristic
  c.dtype = FP_BF16;
  c.batch = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 8192, c.splits = 0;
  check_split_decode(c, 2);
}

TEST(CudaFwdDecode, SplitHeadDimsGroupsAndFeatures) {
  SKIP_WITHOUT_GPU();
  struct Shape { int64_t hq, hkv, d, dv, sq; };
  // Dv = 70: scalar columns in the combine; group 8 x Sq 7 = 56 packed rows: several warps' rows.
  for (const Shape& sh : {Shape{8, 2, 64, 64, 1}, Shape{4, 4, 256, 256, 1}, Shape{8, 1, 128, 70, 2},
                          Shape{16, 2, 40, 72, 7}, Shape{6, 3, 96, 128, 3}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = sh.hq, c.hkv = sh.hkv, c.d = sh.d, c.dv = sh.dv, c.sq = sh.sq, c.sk = 1531;
    c.splits = static_cast<int32_t>(rand_int(2, 9));
    check_split_decode(c, 2);
    c.sinks = true, c.softcap = 20.0f, c.alibi = true, c.causal = sh.sq > 1;
    check_split_decode(c, 2);
    c.sinks = false, c.softcap = 0.0f, c.alibi = false;
    c.dropout = 0.2f, c.wl = 300;
    check_split_decode(c, 2);
  }
}

TEST(CudaFwdDecode, SplitKvCaches) {
  SKIP_WITHOUT_GPU();
  // Paged (odd page size too) and contiguous caches, sequences of very different lengths (short
  // ones leave most splits empty; seqused 0: no key at all -> out 0, lse -inf).
  for (int rep = 0; rep < 4; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true;
    c.paged = rep < 2;
    c.page_size = rep == 0 ? 16 : 7;
    c.batch_idx = rep == 3;
    c.batch = 3, c.hq = 16, c.hkv = 4, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 3000;
    c.seqused = {0, 2999, static_cast<int64_t>(rand_int(1, 200))};
    c.splits = rep == 2 ? 0 : 11;
    check_split_decode(c, 2);
  }
  // Append + rotary into a paged cache, then attend with forced splits.
  Case c;
  c.dtype = FP_BF16;
  c.cache = true, c.paged = true, c.page_size = 16;
  c.batch = 2, c.hq = 8, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 1, c.snew = 1, c.sk = 2048;
  c.rot_dim = 64;
  c.splits = 6;
  check_split_decode(c, 2);
}

TEST(CudaFwdDecode, VarlenDecodeWithSplits) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.varlen = true;
  c.lq = {1, 3, 2, 1};
  c.lk = {1, 900, 2500, 64};
  c.hq = 8, c.hkv = 2, c.d = 128, c.dv = 128;
  c.splits = 7;
  check_split_decode(c, 2);
}

// ---- planning ------------------------------------------------------------------------------

TEST(CudaPlan, DeclinesWithReasons) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_F64;  // float32 runs (f32_test.cpp); float64 is declined by design
  Call call(c);
  DeviceCall dev(call);
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd_select(&p, &sel), FP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(fp_last_error()).find("float64"), std::string::npos) << fp_last_error();
  // Too small a workspace is refused, nothing written.
  Case s;
  s.sq = 64, s.sk = 4096, s.splits = 8;
  Call call2(s);
  DeviceCall dev2(call2);
  fp_attn_params p2 = call2.params(dev2.views, FP_BACKEND_CUDA);
  ASSERT_EQ(fp_attn_fwd_select(&p2, &sel), FP_OK) << fp_last_error();
  EXPECT_GT(sel.workspace_bytes, 0u);
  EXPECT_EQ(fp_attn_fwd(&p2), FP_ERR_WORKSPACE);
}

}  // namespace
}  // namespace gputest
