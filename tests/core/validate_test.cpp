// One test per validation rule: the status, a message naming the argument, nothing written.
#include <cmath>
#include <limits>

#include "validate_fixtures.hpp"

namespace flashport::test {
namespace {

#define EXPECT_FWD_INVALID(call, needle) \
  EXPECT_TRUE(fwd_rejected((call).p, FP_ERR_INVALID_ARGUMENT, needle, {&(call).out, &(call).lse}))

::testing::AssertionResult resolves(const fp_attn_params& p, Problem* prob = nullptr) {
  Problem local;
  Status st = resolve_fwd(p, prob ? prob : &local);
  if (st.is_ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << fp_status_name(st.code()) << ": " << st.message();
}

// ---- The fixtures themselves are valid ----------------------------------------------------------

TEST(ValidateFwd, ValidCallsResolve) {
  FwdCall f;
  EXPECT_TRUE(resolves(f.p));
  VarlenCall v;
  EXPECT_TRUE(resolves(v.p));
  PagedCall pg;
  EXPECT_TRUE(resolves(pg.p));
  FwdCall no_lse;
  no_lse.p.lse = fp_tensor{};
  EXPECT_TRUE(resolves(no_lse.p));
}

// ---- Required tensors --------------------------------------------------------------------------

TEST(ValidateFwd, QRequired) { FwdCall c; c.p.q = fp_tensor{}; EXPECT_FWD_INVALID(c, "q: is required"); }
TEST(ValidateFwd, KRequired) { FwdCall c; c.p.k = fp_tensor{}; EXPECT_FWD_INVALID(c, "k: is required"); }
TEST(ValidateFwd, VRequired) { FwdCall c; c.p.v = fp_tensor{}; EXPECT_FWD_INVALID(c, "v: is required"); }
TEST(ValidateFwd, OutRequired) { FwdCall c; c.p.out = fp_tensor{}; EXPECT_FWD_INVALID(c, "out: is required"); }
TEST(ValidateFwd, NullDataOfNonEmptyTensor) {
  FwdCall c;
  c.p.k.data = nullptr;
  EXPECT_FWD_INVALID(c, "k: data is NULL");
}
TEST(ValidateFwd, DataWithoutDims) {
  FwdCall c;
  c.p.v.ndim = 0;
  EXPECT_FWD_INVALID(c, "v: ndim must be in [1, 5]");
}
TEST(ValidateFwd, NegativeSize) {
  FwdCall c;
  c.p.q.shape[1] = -1;
  EXPECT_FWD_INVALID(c, "q: sizes must be >= 0");
}
TEST(ValidateFwd, BadDtypeEnum) {
  FwdCall c;
  c.p.sinks = c.lse.view();
  c.p.sinks.dtype = static_cast<fp_dtype>(42);
  EXPECT_FWD_INVALID(c, "sinks: dtype is not a valid fp_dtype");
}
TEST(ValidateFwd, BadDeviceEnum) {
  FwdCall c;
  c.p.out.device_type = static_cast<fp_device_type>(9);
  EXPECT_FWD_INVALID(c, "out: device_type is not a valid");
}

// ---- Ranks per layout --------------------------------------------------------------------------

TEST(ValidateFwd, BatchedQMustBe4D) {
  FwdCall c;
  HostTensor q3(FP_F32, {6, 4, 8});
  c.p.q = q3.view();
  EXPECT_FWD_INVALID(c, "q: must be 4-D [B, Sq, Hq, D]");
}
TEST(ValidateFwd, BatchedOutMustBe4D) {
  FwdCall c;
  HostTensor out3(FP_F32, {6, 4, 8});
  c.p.out = out3.view();
  EXPECT_FWD_INVALID(c, "out: must be 4-D");
}
TEST(ValidateFwd, VarlenQMustBe3D) {
  FwdCall c;
  HostTensor cu = HostTensor::i32({3}, {0, 3, 6});
  c.p.cu_seqlens_q = cu.view();
  c.p.max_seqlen_q = 3;
  EXPECT_FWD_INVALID(c, "q: must be 3-D [Tq, Hq, D] with cu_seqlens_q");
}
TEST(ValidateFwd, VarlenOutMustBe3D) {
  VarlenCall c;
  HostTensor out4(FP_F32, {1, 5, 4, 8});
  c.p.out = out4.view();
  EXPECT_FWD_INVALID(c, "out: must be 3-D [Tq, Hq, Dv]");
}
TEST(ValidateFwd, PackedKMustBe3D) {
  VarlenCall c;
  HostTensor k4(FP_F32, {1, 10, 2, 8});
  c.p.k = k4.view();
  EXPECT_FWD_INVALID(c, "k: must be 3-D [Tk, Hkv, D|Dv] with cu_seqlens_k");
}
TEST(ValidateFwd, PagedKMustBe4D) {
  PagedCall c;
  HostTensor k3(FP_F32, {24, 2, 8});
  c.p.k = k3.view();
  EXPECT_FWD_INVALID(c, "k: must be 4-D [num_blocks, page_size");
}
TEST(ValidateFwd, BatchedVMustBe4D) {
  FwdCall c;
  HostTensor v3(FP_F32, {10, 2, 8});
  c.p.v = v3.view();
  EXPECT_FWD_INVALID(c, "v: must be 4-D [B, Sk, Hkv, D|Dv]");
}

// ---- Dtypes ------------------------------------------------------------------------------------

TEST(ValidateFwd, QMustBeFloat) {
  FwdCall c;
  for (fp_tensor* t : {&c.p.q, &c.p.k, &c.p.v, &c.p.out}) t->dtype = FP_I32;
  EXPECT_FWD_INVALID(c, "q: dtype must be float16, bfloat16, float32 or float64");
}
TEST(ValidateFwd, KDtypeMustMatchQ) { FwdCall c; c.p.k.dtype = FP_F16; EXPECT_FWD_INVALID(c, "k: must have q's dtype float32"); }
TEST(ValidateFwd, VDtypeMustMatchQ) { FwdCall c; c.p.v.dtype = FP_BF16; EXPECT_FWD_INVALID(c, "v: must have q's dtype"); }
TEST(ValidateFwd, OutDtypeMustMatchQ) { FwdCall c; c.p.out.dtype = FP_F64; EXPECT_FWD_INVALID(c, "out: must have q's dtype"); }
TEST(ValidateFwd, LseMustBeF32) {
  FwdCall c(FP_F16);
  HostTensor lse16(FP_F16, {2, 4, 3});
  c.p.lse = lse16.view();
  EXPECT_FWD_INVALID(c, "lse: must be float32");
}
TEST(ValidateFwd, LseF64OnlyWithF64Inputs) {
  FwdCall c;
  HostTensor lse64(FP_F64, {2, 4, 3});
  c.p.lse = lse64.view();
  EXPECT_FWD_INVALID(c, "lse: must be float32 (float64 allowed only with float64 inputs)");
  FwdCall d(FP_F64);
  HostTensor lse64b(FP_F64, {2, 4, 3});
  d.p.lse = lse64b.view();
  Problem prob;
  ASSERT_TRUE(resolves(d.p, &prob));
  EXPECT_EQ(prob.lse_dtype, FP_F64);
  EXPECT_EQ(prob.dtype, FP_F64);
}
TEST(ValidateFwd, CuSeqlensMustBeInt32) {
  VarlenCall c;
  HostTensor cu(FP_F32, {3});
  c.p.cu_seqlens_q = cu.view();
  EXPECT_FWD_INVALID(c, "cu_seqlens_q: must be int32");
  VarlenCall d;
  HostTensor cuk(FP_F64, {3});
  d.p.cu_seqlens_k = cuk.view();
  EXPECT_FWD_INVALID(d, "cu_seqlens_k: must be int32");
}
TEST(ValidateFwd, SequsedKMustBeInt32) {
  PagedCall c;
  HostTensor s(FP_F32, {2});
  c.p.seqused_k = s.view();
  EXPECT_FWD_INVALID(c, "seqused_k: must be int32");
}
TEST(ValidateFwd, BlockTableMustBeInt32) {
  PagedCall c;
  HostTensor bt(FP_F32, {2, 3});
  c.p.block_table = bt.view();
  EXPECT_FWD_INVALID(c, "block_table: must be int32");
}
TEST(ValidateFwd, CacheBatchIdxMustBeInt32) {
  FwdCall c;
  HostTensor idx(FP_F16, {2});
  c.p.cache_batch_idx = idx.view();
  EXPECT_FWD_INVALID(c, "cache_batch_idx: must be int32");
}
TEST(ValidateFwd, AlibiMustBeF32) {
  FwdCall c(FP_F16);
  HostTensor a(FP_F16, {4});
  c.p.alibi_slopes = a.view();
  EXPECT_FWD_INVALID(c, "alibi_slopes: must be float32");
}
TEST(ValidateFwd, SinksMustBeF32) {
  FwdCall c(FP_F64);
  HostTensor lse(FP_F64, {2, 4, 3});
  c.p.lse = lse.view();
  HostTensor s(FP_F64, {4});
  c.p.sinks = s.view();
  EXPECT_FWD_INVALID(c, "sinks: must be float32");
}
TEST(ValidateFwd, KNewDtypeMustMatchQ) {
  PagedCall c;
  HostTensor kn(FP_F16, {2, 1, 2, 8});
  c.p.k_new = kn.view();
  EXPECT_FWD_INVALID(c, "k_new: must have q's dtype");
}
TEST(ValidateFwd, VNewDtypeMustMatchQ) {
  PagedCall c;
  HostTensor vn(FP_F64, {2, 1, 2, 8});
  c.p.v_new = vn.view();
  EXPECT_FWD_INVALID(c, "v_new: must have q's dtype");
}
TEST(ValidateFwd, RotaryDtypeF32OrQs) {
  PagedCall c;
  HostTensor cos(FP_F16, {12, 2}), sin(FP_F16, {12, 2});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: must be float32 or q's dtype");
  HostTensor cos32(FP_F32, {12, 2}), sin32(FP_F32, {12, 2});
  c.p.rotary_cos = cos32.view();
  c.p.rotary_sin = sin32.view();
  EXPECT_TRUE(resolves(c.p));
}

// ---- One device ----------------------------------------------------------------------------------

TEST(ValidateFwd, AllTensorsOnOneDeviceIndex) {
  FwdCall c;
  c.p.v.device_index = 1;
  EXPECT_FWD_INVALID(c, "v: must be on the same device as q (cpu:0)");
}
TEST(ValidateFwd, AllTensorsOnOneDeviceType) {
  FwdCall c;
  c.p.lse.device_type = FP_DEVICE_CUDA;
  EXPECT_FWD_INVALID(c, "lse: must be on the same device as q");
}

// ---- Strides -------------------------------------------------------------------------------------

TEST(ValidateFwd, LastDimMustBeContiguous) {
  FwdCall c;
  HostTensor k = HostTensor::padded(FP_F32, {2, 5, 2, 16}, {0, 0, 0, 0});
  fp_tensor kv = k.view();
  kv.shape[3] = 8;
  kv.stride[3] = 2;
  c.p.k = kv;
  EXPECT_FWD_INVALID(c, "k: last dimension must be contiguous (stride 1)");
}
TEST(ValidateFwd, LastDimStrideFreeWhenSizeOne) {
  FwdCall c;
  HostTensor s(FP_F32, {4});
  fp_tensor sv = s.view();
  c.p.sinks = sv;
  HostTensor a(FP_F32, {4});
  c.p.alibi_slopes = a.view();
  HostTensor k1(FP_F32, {2, 5, 2, 1}), q1(FP_F32, {2, 3, 4, 1});
  FwdCall d;
  fp_tensor kv = k1.view(), qv = q1.view();
  kv.stride[3] = 7;
  qv.stride[3] = 0;
  d.p.k = kv;
  d.p.q = qv;
  EXPECT_TRUE(resolves(d.p));
  EXPECT_TRUE(resolves(c.p));
}
TEST(ValidateFwd, ArbitraryOuterStridesAreUsed) {
  FwdCall c;
  HostTensor q = HostTensor::permuted(FP_F32, {2, 3, 4, 8}, {0, 2, 1, 3});
  c.p.q = q.view();
  Problem prob;
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.q.batch_stride, 96);
  EXPECT_EQ(prob.q.row_stride, 8);
  EXPECT_EQ(prob.q.head_stride, 24);
}

// ---- Heads and head dims -----------------------------------------------------------------------

TEST(ValidateFwd, HqMultipleOfHkv) {
  FwdCall c;
  HostTensor k(FP_F32, {2, 5, 3, 8}), v(FP_F32, {2, 5, 3, 8});
  c.p.k = k.view();
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "k: query heads must be a multiple of key/value heads (Hq % Hkv == 0)");
}
TEST(ValidateFwd, AtLeastOneHead) {
  FwdCall c;
  HostTensor k(FP_F32, {2, 5, 0, 8}), v(FP_F32, {2, 5, 0, 8});
  c.p.k = k.view();
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "k: must have at least one head");
}
TEST(ValidateFwd, HeadDimRange) {
  FwdCall c;
  HostTensor q(FP_F32, {2, 3, 4, 257}), k(FP_F32, {2, 5, 2, 257});
  c.p.q = q.view();
  c.p.k = k.view();
  EXPECT_FWD_INVALID(c, "q: head dim D must be in [1, 256]");
  FwdCall d;
  HostTensor q0(FP_F32, {2, 3, 4, 0}), k0(FP_F32, {2, 5, 2, 0});
  d.p.q = q0.view();
  d.p.k = k0.view();
  EXPECT_FWD_INVALID(d, "q: head dim D must be in [1, 256]");
  FwdCall e;
  HostTensor q256(FP_F32, {2, 3, 4, 256}), k256(FP_F32, {2, 5, 2, 256});
  e.p.q = q256.view();
  e.p.k = k256.view();
  EXPECT_TRUE(resolves(e.p));
}
TEST(ValidateFwd, ValueHeadDimRange) {
  FwdCall c;
  HostTensor v(FP_F32, {2, 5, 2, 300}), out(FP_F32, {2, 3, 4, 300});
  c.p.v = v.view();
  c.p.out = out.view();
  EXPECT_FWD_INVALID(c, "v: head dim Dv must be in [1, 256]");
}
TEST(ValidateFwd, DvMayDifferFromD) {
  FwdCall c;
  HostTensor v(FP_F32, {2, 5, 2, 16}), out(FP_F32, {2, 3, 4, 16});
  c.p.v = v.view();
  c.p.out = out.view();
  Problem prob;
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.d, 8);
  EXPECT_EQ(prob.dv, 16);
}

// ---- Shape consistency -------------------------------------------------------------------------

TEST(ValidateFwd, KLastDimMustBeD) {
  FwdCall c;
  HostTensor k(FP_F32, {2, 5, 2, 4});
  c.p.k = k.view();
  EXPECT_FWD_INVALID(c, "k: last dim must equal q's head dim D = 8");
}
TEST(ValidateFwd, VRowsMustMatchK) {
  FwdCall c;
  HostTensor v(FP_F32, {2, 6, 2, 8});
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "v: must match k in every dim but the last");
}
TEST(ValidateFwd, VHeadsMustMatchK) {
  FwdCall c;
  HostTensor v(FP_F32, {2, 5, 1, 8});
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "v: must match k in every dim but the last");
}
TEST(ValidateFwd, OutShapeMustBeQWithDv) {
  FwdCall c;
  HostTensor out(FP_F32, {2, 3, 4, 7});
  c.p.out = out.view();
  EXPECT_FWD_INVALID(c, "out: must have shape [B, Sq, Hq, Dv] = [2, 3, 4, 8]");
  FwdCall d;
  HostTensor out2(FP_F32, {2, 4, 4, 8});
  d.p.out = out2.view();
  EXPECT_FWD_INVALID(d, "out: must have shape");
}
TEST(ValidateFwd, VarlenOutShape) {
  VarlenCall c;
  HostTensor out(FP_F32, {4, 4, 8});
  c.p.out = out.view();
  EXPECT_FWD_INVALID(c, "out: must have shape [Tq, Hq, Dv] = [5, 4, 8]");
}
TEST(ValidateFwd, LseShapeBatched) {
  FwdCall c;
  HostTensor lse(FP_F32, {2, 3, 4});  // [B, Sq, Hq]: the wrong order
  c.p.lse = lse.view();
  EXPECT_FWD_INVALID(c, "lse: must have shape [B, Hq, Sq] = [2, 4, 3]");
}
TEST(ValidateFwd, LseShapeVarlen) {
  VarlenCall c;
  HostTensor lse(FP_F32, {5, 4});
  c.p.lse = lse.view();
  EXPECT_FWD_INVALID(c, "lse: must have shape [Hq, Tq] = [4, 5]");
}
TEST(ValidateFwd, BatchedKBatchMustMatchQ) {
  FwdCall c;
  HostTensor k(FP_F32, {3, 5, 2, 8}), v(FP_F32, {3, 5, 2, 8});
  c.p.k = k.view();
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "k: batch must equal q's batch B = 2");
}

// ---- Varlen ------------------------------------------------------------------------------------

TEST(ValidateFwd, CuSeqlensMustBe1D) {
  VarlenCall c;
  HostTensor cu = HostTensor::i32({1, 3}, {0, 3, 5});
  c.p.cu_seqlens_q = cu.view();
  EXPECT_FWD_INVALID(c, "cu_seqlens_q: must be 1-D [B + 1]");
}
TEST(ValidateFwd, CuSeqlensQNeedsAnEntry) {
  VarlenCall c;
  HostTensor cu(FP_I32, {0});
  c.p.cu_seqlens_q = cu.view();
  EXPECT_FWD_INVALID(c, "cu_seqlens_q: must have B + 1 >= 1 entries");
}
TEST(ValidateFwd, CuSeqlensKLengthMatchesBatch) {
  VarlenCall c;
  HostTensor cu = HostTensor::i32({4}, {0, 4, 6, 10});
  c.p.cu_seqlens_k = cu.view();
  EXPECT_FWD_INVALID(c, "cu_seqlens_k: must have B + 1 = 3 entries");
}
TEST(ValidateFwd, MaxSeqlenQNonNegative) {
  VarlenCall c;
  c.p.max_seqlen_q = -1;
  EXPECT_FWD_INVALID(c, "max_seqlen_q: must be >= 0 with cu_seqlens_q");
}
TEST(ValidateFwd, MaxSeqlenKNonNegative) {
  VarlenCall c;
  c.p.max_seqlen_k = -1;
  EXPECT_FWD_INVALID(c, "max_seqlen_k: must be >= 0 with cu_seqlens_k");
}
TEST(ValidateFwd, MaxSeqlenWithoutCuSeqlensIsNotIgnored) {
  FwdCall c;
  c.p.max_seqlen_q = 3;
  EXPECT_FWD_INVALID(c, "max_seqlen_q: is only meaningful with cu_seqlens_q");
  FwdCall d;
  d.p.max_seqlen_k = 5;
  EXPECT_FWD_INVALID(d, "max_seqlen_k: is only meaningful with cu_seqlens_k");
}
TEST(ValidateFwd, VarlenQWithBatchedKResolves) {
  VarlenCall c;
  HostTensor k(FP_F32, {2, 7, 2, 8}), v(FP_F32, {2, 7, 2, 8});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cu_seqlens_k = fp_tensor{};
  c.p.max_seqlen_k = 0;
  Problem prob;
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.seq.sk, 7);
  EXPECT_EQ(prob.k.layout, KvLayout::Batched);
  EXPECT_TRUE(prob.q.packed);
}

// ---- Paged / cache -----------------------------------------------------------------------------

TEST(ValidateFwd, BlockTableExclusiveWithCuSeqlensK) {
  VarlenCall c;
  HostTensor bt = HostTensor::i32({2, 1}, {0, 0});
  c.p.block_table = bt.view();
  EXPECT_FWD_INVALID(c, "block_table: cannot be combined with cu_seqlens_k");
}
TEST(ValidateFwd, BlockTableMustBe2D) {
  PagedCall c;
  HostTensor bt = HostTensor::i32({6}, {0, 1, 2, 3, 4, 5});
  c.p.block_table = bt.view();
  EXPECT_FWD_INVALID(c, "block_table: must be 2-D [B, max_blocks]");
}
TEST(ValidateFwd, BlockTableRowsMatchBatch) {
  PagedCall c;
  HostTensor bt = HostTensor::i32({3, 3}, {0, 1, 2, 3, 4, 5, 0, 1, 2});
  c.p.block_table = bt.view();
  EXPECT_FWD_INVALID(c, "block_table: must have B = 2 rows");
}
TEST(ValidateFwd, PageSizeAtLeastOne) {
  PagedCall c;
  HostTensor k(FP_F32, {6, 0, 2, 8}), v(FP_F32, {6, 0, 2, 8});
  c.p.k = k.view();
  c.p.v = v.view();
  EXPECT_FWD_INVALID(c, "k: page_size (dim 1 of a paged cache) must be >= 1");
}
TEST(ValidateFwd, CacheBatchIdxShape) {
  FwdCall c;
  HostTensor idx = HostTensor::i32({3}, {0, 1, 0});
  c.p.cache_batch_idx = idx.view();
  EXPECT_FWD_INVALID(c, "cache_batch_idx: must have shape [B] = [2]");
}
TEST(ValidateFwd, CacheBatchIdxNotWithPaged) {
  PagedCall c;
  HostTensor idx = HostTensor::i32({2}, {0, 1});
  c.p.cache_batch_idx = idx.view();
  EXPECT_FWD_INVALID(c, "cache_batch_idx: only applies to a contiguous cache");
}
TEST(ValidateFwd, CacheBatchIdxNotWithPackedK) {
  VarlenCall c;
  HostTensor idx = HostTensor::i32({2}, {0, 1});
  c.p.cache_batch_idx = idx.view();
  EXPECT_FWD_INVALID(c, "cache_batch_idx: only applies to a contiguous cache");
}
TEST(ValidateFwd, CacheBatchIdxAllowsOtherCacheBatch) {
  FwdCall c;
  HostTensor k(FP_F32, {4, 5, 2, 8}), v(FP_F32, {4, 5, 2, 8});
  HostTensor idx = HostTensor::i32({2}, {3, 1});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cache_batch_idx = idx.view();
  EXPECT_TRUE(resolves(c.p));
}
TEST(ValidateFwd, SequsedKShape) {
  FwdCall c;
  HostTensor s = HostTensor::i32({3}, {1, 1, 1});
  c.p.seqused_k = s.view();
  EXPECT_FWD_INVALID(c, "seqused_k: must have shape [B] = [2]");
}

// ---- Append-then-attend and rotary -------------------------------------------------------------

TEST(ValidateFwd, KNewAndVNewTogether) {
  PagedCall c;
  c.p.v_new = fp_tensor{};
  EXPECT_FWD_INVALID(c, "v_new: k_new and v_new must be given together");
  PagedCall d;
  d.p.k_new = fp_tensor{};
  EXPECT_FWD_INVALID(d, "k_new: k_new and v_new must be given together");
}
TEST(ValidateFwd, KNewNeedsSequsedK) {
  PagedCall c;
  c.p.seqused_k = fp_tensor{};
  EXPECT_FWD_INVALID(c, "k_new: needs seqused_k");
}
TEST(ValidateFwd, KNewNeedsBatchedQ) {
  VarlenCall c;
  HostTensor k(FP_F32, {2, 8, 2, 8}), v(FP_F32, {2, 8, 2, 8});
  HostTensor kn(FP_F32, {2, 1, 2, 8}), vn(FP_F32, {2, 1, 2, 8});
  HostTensor used = HostTensor::i32({2}, {1, 2});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cu_seqlens_k = fp_tensor{};
  c.p.max_seqlen_k = 0;
  c.p.k_new = kn.view();
  c.p.v_new = vn.view();
  c.p.seqused_k = used.view();
  EXPECT_FWD_INVALID(c, "k_new: needs batched q");
}
TEST(ValidateFwd, KNewNeedsNonPackedK) {
  FwdCall c;
  HostTensor k(FP_F32, {10, 2, 8}), v(FP_F32, {10, 2, 8});
  HostTensor cu = HostTensor::i32({3}, {0, 5, 10});
  HostTensor kn(FP_F32, {2, 1, 2, 8}), vn(FP_F32, {2, 1, 2, 8});
  HostTensor used = HostTensor::i32({2}, {1, 2});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cu_seqlens_k = cu.view();
  c.p.max_seqlen_k = 5;
  c.p.k_new = kn.view();
  c.p.v_new = vn.view();
  c.p.seqused_k = used.view();
  EXPECT_FWD_INVALID(c, "k_new: needs a batched or paged cache");
}
TEST(ValidateFwd, KNewShape) {
  PagedCall c;
  HostTensor kn(FP_F32, {2, 1, 4, 8});
  c.p.k_new = kn.view();
  EXPECT_FWD_INVALID(c, "k_new: must have shape [B, Snew, Hkv, D] = [2, 1, 2, 8]");
}
TEST(ValidateFwd, VNewShape) {
  PagedCall c;
  HostTensor vn(FP_F32, {2, 2, 2, 8});
  c.p.v_new = vn.view();
  EXPECT_FWD_INVALID(c, "v_new: must have shape [B, Snew, Hkv, Dv] = [2, 1, 2, 8]");
}
TEST(ValidateFwd, RotaryCosAndSinTogether) {
  PagedCall c;
  HostTensor cos(FP_F32, {12, 2});
  c.p.rotary_cos = cos.view();
  EXPECT_FWD_INVALID(c, "rotary_sin: rotary_cos and rotary_sin must be given together");
}
TEST(ValidateFwd, RotaryNeedsKNew) {
  FwdCall c;
  HostTensor cos(FP_F32, {5, 2}), sin(FP_F32, {5, 2});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: needs k_new");
}
TEST(ValidateFwd, RotaryMustBe2D) {
  PagedCall c;
  HostTensor cos(FP_F32, {12, 2, 1}), sin(FP_F32, {12, 2, 1});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: must be 2-D [S_ro, rotary_dim / 2]");
}
TEST(ValidateFwd, RotaryDimAtMostD) {
  PagedCall c;
  HostTensor cos(FP_F32, {12, 5}), sin(FP_F32, {12, 5});  // rotary_dim 10 > D 8
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: rotary_dim = 2 * shape[1] must be even, >= 2 and <= D = 8");
}
TEST(ValidateFwd, RotarySinLikeCos) {
  PagedCall c;
  HostTensor cos(FP_F32, {12, 2}), sin(FP_F32, {13, 2});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_sin: must have rotary_cos's shape, strides and dtype");
  PagedCall d;
  HostTensor cos2(FP_F32, {12, 2});
  HostTensor sin2 = HostTensor::padded(FP_F32, {12, 2}, {0, 1});
  d.p.rotary_cos = cos2.view();
  d.p.rotary_sin = sin2.view();
  EXPECT_FWD_INVALID(d, "rotary_sin: must have rotary_cos's shape, strides");
}
TEST(ValidateFwd, RotaryRowsCoverCapacity) {
  PagedCall c;  // capacity max_blocks * page = 12
  HostTensor cos(FP_F32, {11, 2}), sin(FP_F32, {11, 2});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: S_ro (rows) must cover the cache capacity 12");
}
TEST(ValidateFwd, RotaryRowsCoverCausalQueryPositions) {
  PagedCall c;  // seqused_k = {5, 2}; causal q rows rotate at seqused_k + i, i < Sq = 3
  HostTensor q(FP_F32, {c.B, 3, c.Hq, c.D}), out(FP_F32, {c.B, 3, c.Hq, c.Dv});
  q.fill_normal();
  out.fill_poison();
  c.p.q = q.view();
  c.p.out = out.view();
  c.p.lse = fp_tensor{};
  c.p.causal = 1;
  int32_t* used = static_cast<int32_t*>(c.seqused.storage());
  used[0] = 10;  // 10 + 1 new key fits the capacity 12, but q rows reach position 10 + 2 = 12
  HostTensor cos(FP_F32, {12, 2}), sin(FP_F32, {12, 2});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  EXPECT_FWD_INVALID(c, "rotary_cos: S_ro (rows) must cover the query positions seqused_k + i");
  EXPECT_EQ(out.poisoned_count(), out.numel());
  used[0] = 9;
  Problem prob;
  EXPECT_TRUE(resolves(c.p, &prob));
}
TEST(ValidateFwd, RotaryInterleavedIsABoolean) {
  FwdCall c;
  c.p.rotary_interleaved = 2;
  EXPECT_FWD_INVALID(c, "rotary_interleaved: must be 0 or 1");
}
TEST(ValidateFwd, RotaryResolves) {
  PagedCall c;
  HostTensor cos(FP_F32, {16, 3}), sin(FP_F32, {16, 3});
  c.p.rotary_cos = cos.view();
  c.p.rotary_sin = sin.view();
  c.p.rotary_interleaved = 1;
  Problem prob;
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.rotary_dim, 6);
  EXPECT_TRUE(prob.rotary_interleaved);
  EXPECT_EQ(prob.rotary_rows, 16);
  EXPECT_EQ(prob.rotary_row_stride, 3);
  EXPECT_EQ(prob.rotary_cos, cos.storage());
  EXPECT_EQ(prob.rotary_dtype, FP_F32);
}

// ---- Scalars -----------------------------------------------------------------------------------

TEST(ValidateFwd, SoftmaxScaleFiniteOrNaN) {
  FwdCall c;
  c.p.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_FWD_INVALID(c, "softmax_scale: must be finite (or NaN for 1/sqrt(D))");
}
TEST(ValidateFwd, WindowLeftAtLeastMinusOne) {
  FwdCall c;
  c.p.window_left = -2;
  EXPECT_FWD_INVALID(c, "window_left: must be >= -1");
}
TEST(ValidateFwd, WindowRightAtLeastMinusOne) {
  FwdCall c;
  c.p.window_right = -5;
  EXPECT_FWD_INVALID(c, "window_right: must be >= -1");
}
TEST(ValidateFwd, CausalIsABoolean) {
  FwdCall c;
  c.p.causal = 2;
  EXPECT_FWD_INVALID(c, "causal: must be 0 or 1");
}
TEST(ValidateFwd, CausalIntersectsAnyWindowRight) {
  // flash_attn's semantics: causal = 1 with any window_right >= -1 is the causal mask
  // intersected with the window, so the effective window_right is 0; window_left stays.
  for (int32_t wr : {-1, 0, 1, 3, 1000}) {
    for (int32_t wl : {-1, 0, 2}) {
      FwdCall d;
      d.p.causal = 1;
      d.p.window_left = wl;
      d.p.window_right = wr;
      Problem prob;
      ASSERT_TRUE(resolves(d.p, &prob)) << "wl " << wl << " wr " << wr;
      EXPECT_EQ(prob.rules.window_right, 0);
      EXPECT_EQ(prob.rules.window_left, wl);
    }
  }
  FwdCall c;  // what stays an error stays a named error, causal or not
  c.p.causal = 1;
  c.p.window_right = -2;
  EXPECT_FWD_INVALID(c, "window_right: must be >= -1");
  FwdCall l;
  l.p.causal = 1;
  l.p.window_left = -3;
  l.p.window_right = 4;
  EXPECT_FWD_INVALID(l, "window_left: must be >= -1");
}
TEST(ValidateFwd, CausalAlignEnum) {
  FwdCall c;
  c.p.causal_align = static_cast<fp_causal_align>(3);
  EXPECT_FWD_INVALID(c, "causal_align: is not a valid fp_causal_align");
}
TEST(ValidateFwd, SoftcapFiniteNonNegative) {
  for (float bad : {-1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    FwdCall c;
    c.p.softcap = bad;
    EXPECT_FWD_INVALID(c, "softcap: must be finite and >= 0");
  }
}
TEST(ValidateFwd, AlibiShape) {
  FwdCall c;
  HostTensor a(FP_F32, {3});
  c.p.alibi_slopes = a.view();
  EXPECT_FWD_INVALID(c, "alibi_slopes: must have shape [Hq] or [B, Hq] = [2, 4]");
  FwdCall d;
  HostTensor a2(FP_F32, {4, 2});
  d.p.alibi_slopes = a2.view();
  EXPECT_FWD_INVALID(d, "alibi_slopes: must have shape");
}
TEST(ValidateFwd, AlibiBatchStride) {
  FwdCall c;
  HostTensor per_head(FP_F32, {4});
  c.p.alibi_slopes = per_head.view();
  Problem prob;
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.rules.alibi_batch_stride, 0);
  EXPECT_EQ(prob.rules.alibi, per_head.storage());
  HostTensor per_batch = HostTensor::padded(FP_F32, {2, 4}, {0, 3});
  per_batch.fill_normal();
  c.p.alibi_slopes = per_batch.view();
  ASSERT_TRUE(resolves(c.p, &prob));
  EXPECT_EQ(prob.rules.alibi_batch_stride, 7);
  EXPECT_EQ(prob.rules.alibi_slope(1, 2), static_cast<float>(per_batch.get({1, 2})));
}
TEST(ValidateFwd, SinksShape) {
  FwdCall c;
  HostTensor s(FP_F32, {2});
  c.p.sinks = s.view();
  EXPECT_FWD_INVALID(c, "sinks: must have shape [Hq] = [4]");
}
TEST(ValidateFwd, DropoutRange) {
  for (float bad : {1.0f, -0.1f, 2.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    FwdCall c;
    c.p.dropout_p = bad;
    EXPECT_FWD_INVALID(c, "dropout_p: must be finite and in [0, 1)");
  }
}
TEST(ValidateFwd, DropoutRngRules) {
  {
    FwdCall c;
    HostTensor w(FP_F32, {4});
    c.p.dropout_rng = w.view();
    EXPECT_FWD_INVALID(c, "dropout_rng: must be int32");
  }
  {
    FwdCall c;
    HostTensor w = HostTensor::i32({2}, {1, 2});
    c.p.dropout_rng = w.view();
    EXPECT_FWD_INVALID(c, "dropout_rng: must have shape [4] = [4]");
  }
  {
    FwdCall c;
    HostTensor w = HostTensor::i32({4}, {1, 2, 3, 4});
    c.p.dropout_rng = w.view();
    c.p.dropout_offset = 5;
    EXPECT_FWD_INVALID(c, "dropout_rng: excludes dropout_seed/dropout_offset");
  }
}
TEST(ResolveFwd, DropoutRngOnHostIsReadIntoTheScalars) {
  FwdCall c;
  HostTensor w = HostTensor::i32({4}, {static_cast<int32_t>(0x9abcdef0u), 0x12345678, 7, 1});
  c.p.dropout_p = 0.5f;
  c.p.dropout_rng = w.view();
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.rules.dropout_seed, 0x123456789abcdef0ull);
  EXPECT_EQ(r.rules.dropout_offset, (1ull << 32) | 7u);
  EXPECT_EQ(r.rules.dropout_rng, nullptr);
  EXPECT_EQ(r.rules.rng_seed(), 0x123456789abcdef0ull);
  EXPECT_EQ(r.rules.rng_offset(), (1ull << 32) | 7u);
}
TEST(ResolveFwd, DropoutRngOnDeviceIsNotRead) {
  // A device-resident RNG state is handed to the kernels; the host never dereferences it.
  VarlenCall c;
  fp_tensor rng{};
  rng.data = reinterpret_cast<void*>(0x20);
  rng.dtype = FP_I32;
  rng.ndim = 1;
  rng.shape[0] = 4;
  rng.stride[0] = 1;
  c.p.dropout_p = 0.1f;
  c.p.dropout_rng = rng;
  for (fp_tensor* t : {&c.p.q, &c.p.k, &c.p.v, &c.p.out, &c.p.lse, &c.p.cu_seqlens_q,
                       &c.p.cu_seqlens_k, &c.p.dropout_rng}) {
    t->device_type = FP_DEVICE_CUDA;
    if (t != &c.p.dropout_rng) t->data = reinterpret_cast<void*>(0x10);
  }
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.rules.dropout_rng, reinterpret_cast<const uint32_t*>(0x20));
}
TEST(ValidateFwd, NumSplitsNonNegative) {
  FwdCall c;
  c.p.num_splits = -1;
  EXPECT_FWD_INVALID(c, "num_splits: must be >= 0");
}
TEST(ValidateFwd, NumThreadsNonNegative) {
  FwdCall c;
  c.p.num_threads = -2;
  EXPECT_FWD_INVALID(c, "num_threads: must be >= 0");
}
TEST(ValidateFwd, BackendEnum) {
  FwdCall c;
  c.p.backend = static_cast<fp_backend>(17);
  EXPECT_FWD_INVALID(c, "backend: is not a valid fp_backend");
}
TEST(ValidateFwd, WorkspaceNonNullWithBytes) {
  FwdCall c;
  c.p.workspace_bytes = 64;
  EXPECT_FWD_INVALID(c, "workspace: must be non-NULL when workspace_bytes > 0");
}
TEST(ValidateFwd, StreamMustBeNullForCpu) {
  FwdCall c;
  int dummy = 0;
  c.p.stream = &dummy;
  EXPECT_FWD_INVALID(c, "stream: must be NULL for CPU tensors");
}

// ---- Index values in host memory ---------------------------------------------------------------

TEST(ValidateFwd, CuSeqlensStartsAtZero) {
  VarlenCall c;
  c.cu_q.fill_i32({1, 3, 5});
  EXPECT_FWD_INVALID(c, "cu_seqlens_q: first entry must be 0");
}
TEST(ValidateFwd, CuSeqlensNonDecreasing) {
  VarlenCall c;
  c.cu_k.fill_i32({0, 6, 4});
  EXPECT_FWD_INVALID(c, "cu_seqlens_k: must be non-decreasing");
}
TEST(ValidateFwd, CuSeqlensLastWithinRows) {
  VarlenCall c;
  c.cu_q.fill_i32({0, 3, 6});
  EXPECT_FWD_INVALID(c, "cu_seqlens_q: last entry must be <= the packed rows");
}
TEST(ValidateFwd, CuSeqlensLengthsWithinMaxSeqlen) {
  VarlenCall c;
  c.p.max_seqlen_k = 5;  // sequence 1 has 6 keys
  EXPECT_FWD_INVALID(c, "cu_seqlens_k: sequence length exceeds max_seqlen_k");
  VarlenCall d;
  d.p.max_seqlen_q = 2;
  EXPECT_FWD_INVALID(d, "cu_seqlens_q: sequence length exceeds max_seqlen_q");
}
TEST(ValidateFwd, CuSeqlensMayEndBeforeTheRows) {
  VarlenCall c;
  c.cu_q.fill_i32({0, 1, 3});
  EXPECT_TRUE(resolves(c.p));
}
TEST(ValidateFwd, SequsedKWithinCapacity) {
  PagedCall c;
  c.seqused.fill_i32({-1, 2});
  EXPECT_FWD_INVALID(c, "seqused_k: entries must be in [0, capacity]");
  PagedCall d;
  d.seqused.fill_i32({13, 2});
  EXPECT_FWD_INVALID(d, "seqused_k: entries must be in [0, capacity]");
}
TEST(ValidateFwd, SequsedKPlusAppendFitsCapacity) {
  PagedCall c;
  c.seqused.fill_i32({12, 2});  // 12 + Snew 1 > 12
  EXPECT_FWD_INVALID(c, "seqused_k: seqused_k + Snew must fit the cache capacity");
}
TEST(ValidateFwd, SequsedKWithPackedKeysUsesSequenceLength) {
  VarlenCall c;  // key lengths {4, 6}
  HostTensor used = HostTensor::i32({2}, {4, 7});
  c.p.seqused_k = used.view();
  EXPECT_FWD_INVALID(c, "seqused_k: entries must be in [0, capacity]");
  used.fill_i32({2, 6});
  EXPECT_TRUE(resolves(c.p));
}
TEST(ValidateFwd, BlockTableEntriesInRange) {
  PagedCall c;
  c.block_table.fill_i32({5, 6, 0, 1, 2, 3});  // block 1 of sequence 0 is used
  EXPECT_FWD_INVALID(c, "block_table: entries must be in [0, num_blocks = 6)");
  PagedCall d;
  d.block_table.fill_i32({5, 0, 0, -1, 2, 3});
  EXPECT_FWD_INVALID(d, "block_table[1, 0] = -1");
}
TEST(ValidateFwd, UnusedBlockTableEntriesAreNotChecked) {
  PagedCall c;  // lengths 6 and 3 reach 2 and 1 blocks of 4
  c.block_table.fill_i32({5, 0, -1, 1, 99, -7});
  EXPECT_TRUE(resolves(c.p));
}
TEST(ValidateFwd, CacheBatchIdxInRange) {
  FwdCall c;
  HostTensor k(FP_F32, {3, 5, 2, 8}), v(FP_F32, {3, 5, 2, 8});
  HostTensor idx = HostTensor::i32({2}, {0, 3});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cache_batch_idx = idx.view();
  EXPECT_FWD_INVALID(c, "cache_batch_idx: entries must be in [0, B_cache = 3)");
}
TEST(ValidateFwd, IndexValuesOnDeviceAreNotRead) {
  // Device pointers must never be dereferenced on the host: a bogus pointer passes validation.
  VarlenCall c;
  for (fp_tensor* t : {&c.p.q, &c.p.k, &c.p.v, &c.p.out, &c.p.lse, &c.p.cu_seqlens_q,
                       &c.p.cu_seqlens_k}) {
    t->device_type = FP_DEVICE_CUDA;
    t->data = reinterpret_cast<void*>(0x10);
  }
  EXPECT_TRUE(resolves(c.p));
}

// ---- Resolution ----------------------------------------------------------------------------------

TEST(ResolveFwd, BatchedFields) {
  FwdCall c;
  c.p.causal = 1;
  c.p.window_left = 2;
  c.p.causal_align = FP_CAUSAL_TOP_LEFT;
  c.p.softcap = 30.0f;
  c.p.dropout_p = 0.25f;
  c.p.dropout_seed = 0x1234567890ull;
  c.p.dropout_offset = 77;
  c.p.num_splits = 3;
  HostTensor sinks(FP_F32, {4});
  c.p.sinks = sinks.view();
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.raw, &c.p);
  EXPECT_EQ(r.dtype, FP_F32);
  EXPECT_EQ(r.device, FP_DEVICE_CPU);
  EXPECT_EQ(r.q_ptr, c.q.storage());
  EXPECT_EQ(r.k_ptr, c.k.storage());
  EXPECT_EQ(r.v_ptr, c.v.storage());
  EXPECT_EQ(r.out_ptr, c.out.storage());
  EXPECT_EQ(r.lse_ptr, c.lse.storage());
  EXPECT_EQ(r.k_new_ptr, nullptr);
  EXPECT_EQ(r.hq, 4);
  EXPECT_EQ(r.hkv, 2);
  EXPECT_EQ(r.group, 2);
  EXPECT_EQ(r.seq.batch, 2);
  EXPECT_EQ(r.seq.sq, 3);
  EXPECT_EQ(r.seq.sk, 5);
  EXPECT_EQ(r.seq.q_len(1), 3);
  EXPECT_EQ(r.seq.k_len(1), 5);
  EXPECT_EQ(r.q.batch_stride, 96);
  EXPECT_EQ(r.q.row_stride, 32);
  EXPECT_EQ(r.q.head_stride, 8);
  EXPECT_FALSE(r.q.packed);
  EXPECT_EQ(r.k.layout, KvLayout::Batched);
  EXPECT_EQ(r.k.s0, 80);
  EXPECT_EQ(r.k.s1, 16);
  EXPECT_EQ(r.k.s2, 8);
  EXPECT_TRUE(r.has_lse);
  EXPECT_EQ(r.lse.batch_stride, 12);
  EXPECT_EQ(r.lse.head_stride, 3);
  EXPECT_EQ(r.lse.row_stride, 1);
  EXPECT_FLOAT_EQ(r.rules.scale, 1.0f / std::sqrt(8.0f));
  EXPECT_EQ(r.rules.window_left, 2);
  EXPECT_EQ(r.rules.window_right, 0);
  EXPECT_TRUE(r.rules.top_left);
  EXPECT_EQ(r.rules.softcap, 30.0f);
  EXPECT_EQ(r.rules.sinks, sinks.storage());
  EXPECT_EQ(r.rules.dropout_p, 0.25f);
  EXPECT_EQ(r.rules.dropout_threshold, 64u);
  EXPECT_FLOAT_EQ(r.rules.dropout_scale, 256.0f / 192.0f);
  EXPECT_EQ(r.rules.dropout_seed, 0x1234567890ull);
  EXPECT_EQ(r.rules.dropout_offset, 77u);
  EXPECT_EQ(r.num_splits, 3);
  EXPECT_EQ(r.total_q_rows, 6);
  EXPECT_EQ(r.rotary_dim, 0);
}
TEST(ResolveFwd, ExplicitScaleKept) {
  FwdCall c;
  c.p.softmax_scale = -0.5f;
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.rules.scale, -0.5f);
  EXPECT_EQ(r.rules.window_right, -1);
  EXPECT_EQ(r.rules.window_left, -1);
  EXPECT_EQ(r.rules.dropout_threshold, 0u);
  EXPECT_EQ(r.rules.dropout_scale, 1.0f);
}
TEST(ResolveFwd, VarlenFields) {
  VarlenCall c;
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.seq.batch, 2);
  EXPECT_EQ(r.seq.sq, 3);
  EXPECT_EQ(r.seq.sk, 6);
  EXPECT_EQ(r.seq.cu_q, c.cu_q.storage());
  EXPECT_EQ(r.seq.cu_k, c.cu_k.storage());
  EXPECT_EQ(r.seq.q_len(1), 2);
  EXPECT_EQ(r.seq.q_start(1), 3);
  EXPECT_EQ(r.seq.k_len(1), 6);
  EXPECT_EQ(r.seq.k_start(1), 4);
  EXPECT_TRUE(r.q.packed);
  EXPECT_EQ(r.q.row_stride, 32);
  EXPECT_EQ(r.q.head_stride, 8);
  EXPECT_EQ(r.q.at(1, 3, 1, 2), (3 + 1) * 32 + 2 * 8);
  EXPECT_EQ(r.k.layout, KvLayout::Packed);
  EXPECT_EQ(r.k.s0, 16);
  EXPECT_EQ(r.k.s2, 8);
  EXPECT_EQ(r.k.at(r.seq, 1, 2, 1), (4 + 2) * 16 + 8);
  EXPECT_TRUE(r.lse.packed);
  EXPECT_EQ(r.lse.head_stride, 5);
  EXPECT_EQ(r.lse.row_stride, 1);
  EXPECT_EQ(r.lse.at(1, 3, 2, 1), 2 * 5 + 4);
  EXPECT_EQ(r.total_q_rows, 5);
}
TEST(ResolveFwd, PagedFields) {
  PagedCall c;
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.seq.kv_layout, KvLayout::Paged);
  EXPECT_EQ(r.seq.page_size, 4);
  EXPECT_EQ(r.seq.max_blocks, 3);
  EXPECT_EQ(r.seq.block_table_stride, 3);
  EXPECT_EQ(r.seq.sk, 12);
  EXPECT_EQ(r.seq.snew, 1);
  EXPECT_EQ(r.seq.cache_rows_used(0), 5);
  EXPECT_EQ(r.seq.k_len(0), 6);
  EXPECT_EQ(r.seq.k_len(1), 3);
  // Sequence 0, key 5 lives in block_table[0][1] = 0, slot 1.
  EXPECT_EQ(r.k.at(r.seq, 0, 5, 1), 0 * 64 + 1 * 16 + 8);
  // Sequence 1, key 2: block_table[1][0] = 1, slot 2.
  EXPECT_EQ(r.k.at(r.seq, 1, 2, 0), 1 * 64 + 2 * 16);
  EXPECT_EQ(r.k_new_ptr, c.k_new.storage());
  EXPECT_EQ(r.v_new_ptr, c.v_new.storage());
  EXPECT_EQ(r.k_new.batch_stride, 16);
  EXPECT_EQ(r.k_new.row_stride, 16);
  EXPECT_EQ(r.k_new.head_stride, 8);
}
TEST(ResolveFwd, CacheBatchIdxAddressing) {
  FwdCall c;
  HostTensor k(FP_F32, {4, 5, 2, 8}), v(FP_F32, {4, 5, 2, 8});
  HostTensor idx = HostTensor::i32({2}, {3, 1});
  c.p.k = k.view();
  c.p.v = v.view();
  c.p.cache_batch_idx = idx.view();
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.k.at(r.seq, 0, 2, 1), 3 * 80 + 2 * 16 + 8);
}

// ---- Backward ------------------------------------------------------------------------------------

#define EXPECT_BWD_INVALID(call, needle) \
  EXPECT_TRUE(bwd_rejected((call).p, FP_ERR_INVALID_ARGUMENT, needle, {&(call).dq, &(call).dk, &(call).dv}))
#define EXPECT_BWD_UNSUPPORTED(call, needle) \
  EXPECT_TRUE(bwd_rejected((call).p, FP_ERR_UNSUPPORTED, needle, {&(call).dq, &(call).dk, &(call).dv}))

TEST(ValidateBwd, ValidCallResolves) {
  BwdCall c;
  BwdProblem r;
  Status st = resolve_bwd(c.p, &r);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(r.fwd.raw, &c.p.fwd);
  EXPECT_EQ(r.dout_ptr, c.dout.storage());
  EXPECT_EQ(r.dq_ptr, c.dq.storage());
  EXPECT_EQ(r.dk_ptr, c.dk.storage());
  EXPECT_EQ(r.dv_ptr, c.dv.storage());
  EXPECT_EQ(r.dq.row_stride, 32);
  EXPECT_EQ(r.dk.s0, 80);
  EXPECT_FALSE(r.deterministic);
  EXPECT_EQ(r.d_sinks, nullptr);
}
TEST(ValidateBwd, LseRequired) {
  BwdCall c;
  c.p.fwd.lse = fp_tensor{};
  EXPECT_BWD_INVALID(c, "lse: is required");
}
TEST(ValidateBwd, ForwardRulesApply) {
  BwdCall c;
  c.p.fwd.window_left = -3;
  EXPECT_BWD_INVALID(c, "window_left: must be >= -1");
}
TEST(ValidateBwd, DoutLikeOut) {
  BwdCall c;
  c.p.dout = fp_tensor{};
  EXPECT_BWD_INVALID(c, "dout: is required");
  BwdCall d;
  HostTensor dout(FP_F32, {2, 3, 4, 4});
  d.p.dout = dout.view();
  EXPECT_BWD_INVALID(d, "dout: must have out's shape");
}
TEST(ValidateBwd, DqLikeQ) {
  BwdCall c;
  c.p.dq.dtype = FP_F64;
  EXPECT_BWD_INVALID(c, "dq: must have q's dtype");
}
TEST(ValidateBwd, DkLikeK) {
  BwdCall c;
  HostTensor dk(FP_F32, {2, 5, 4, 8});
  c.p.dk = dk.view();
  EXPECT_BWD_INVALID(c, "dk: must have k's shape");
}
TEST(ValidateBwd, DvLikeV) {
  BwdCall c;
  c.p.dv.device_index = 3;
  EXPECT_BWD_INVALID(c, "dv: must be on the same device as v");
}
TEST(ValidateBwd, GradientStridesMayDiffer) {
  BwdCall c;
  HostTensor dq = HostTensor::permuted(FP_F32, {2, 3, 4, 8}, {0, 2, 1, 3});
  c.p.dq = dq.view();
  BwdProblem r;
  ASSERT_TRUE(resolve_bwd(c.p, &r).is_ok());
  EXPECT_EQ(r.dq.row_stride, 8);
  EXPECT_EQ(r.dq.head_stride, 24);
}
TEST(ValidateBwd, DSinksNeedsSinks) {
  BwdCall c;
  HostTensor ds(FP_F32, {4});
  ds.fill_poison();
  c.p.d_sinks = ds.view();
  EXPECT_BWD_INVALID(c, "d_sinks: needs sinks");
  EXPECT_TRUE(untouched({&ds}));
}
TEST(ValidateBwd, DSinksShapeAndDtype) {
  BwdCall c;
  HostTensor sinks(FP_F32, {4}), ds(FP_F32, {2}), ds16(FP_F16, {4});
  c.p.fwd.sinks = sinks.view();
  c.p.d_sinks = ds.view();
  EXPECT_BWD_INVALID(c, "d_sinks: must have shape [Hq] = [4]");
  c.p.d_sinks = ds16.view();
  EXPECT_BWD_INVALID(c, "d_sinks: must be float32");
  HostTensor ok(FP_F32, {4});
  c.p.d_sinks = ok.view();
  BwdProblem r;
  ASSERT_TRUE(resolve_bwd(c.p, &r).is_ok());
  EXPECT_EQ(r.d_sinks, ok.storage());
}
TEST(ValidateBwd, DeterministicIsABoolean) {
  BwdCall c;
  c.p.deterministic = 5;
  EXPECT_BWD_INVALID(c, "deterministic: must be 0 or 1");
}
TEST(ValidateBwd, KvCacheFeaturesUnsupported) {
  {
    BwdCall c;
    HostTensor idx = HostTensor::i32({2}, {1, 0});
    c.p.fwd.cache_batch_idx = idx.view();
    EXPECT_BWD_UNSUPPORTED(c, "backward: cache_batch_idx is not supported");
  }
  {
    PagedCall pg;
    BwdCall c;
    HostTensor dk(FP_F32, {6, 4, 2, 8}), dv(FP_F32, {6, 4, 2, 8});
    c.p.fwd = pg.p;
    c.p.fwd.k_new = fp_tensor{};
    c.p.fwd.v_new = fp_tensor{};
    c.p.dk = dk.view();
    c.p.dv = dv.view();
    HostTensor dq(FP_F32, {2, 1, 4, 8}), dout(FP_F32, {2, 1, 4, 8});
    c.p.dq = dq.view();
    c.p.dout = dout.view();
    EXPECT_TRUE(bwd_rejected(c.p, FP_ERR_UNSUPPORTED, "backward: block_table (paged KV cache) is not supported", {}));
  }
  {
    BwdCall c;
    HostTensor k(FP_F32, {2, 7, 2, 8}), v(FP_F32, {2, 7, 2, 8}), dk(FP_F32, {2, 7, 2, 8}),
        dv(FP_F32, {2, 7, 2, 8}), kn(FP_F32, {2, 1, 2, 8}), vn(FP_F32, {2, 1, 2, 8});
    HostTensor used = HostTensor::i32({2}, {3, 4});
    c.p.fwd.k = k.view();
    c.p.fwd.v = v.view();
    c.p.dk = dk.view();
    c.p.dv = dv.view();
    c.p.fwd.k_new = kn.view();
    c.p.fwd.v_new = vn.view();
    c.p.fwd.seqused_k = used.view();
    EXPECT_TRUE(bwd_rejected(c.p, FP_ERR_UNSUPPORTED, "backward: k_new/v_new", {}));
    HostTensor cos(FP_F32, {7, 2}), sin(FP_F32, {7, 2});
    c.p.fwd.rotary_cos = cos.view();
    c.p.fwd.rotary_sin = sin.view();
    c.p.fwd.k_new = fp_tensor{};
    c.p.fwd.v_new = fp_tensor{};
    // Rotary without k_new is already invalid in the forward rules.
    EXPECT_TRUE(bwd_rejected(c.p, FP_ERR_INVALID_ARGUMENT, "rotary_cos: needs k_new", {}));
  }
}
TEST(ValidateBwd, SequsedKWithVarlenIsFine) {
  VarlenCall v;
  HostTensor used = HostTensor::i32({2}, {3, 5});
  v.out.fill_normal();
  v.lse.fill_normal();
  HostTensor dout(FP_F32, {5, 4, 8}), dq(FP_F32, {5, 4, 8}), dk(FP_F32, {10, 2, 8}),
      dv(FP_F32, {10, 2, 8});
  AttnBwdParams p;
  p.fwd = v.p;
  p.fwd.seqused_k = used.view();
  p.dout = dout.view();
  p.dq = dq.view();
  p.dk = dk.view();
  p.dv = dv.view();
  BwdProblem r;
  Status st = resolve_bwd(p, &r);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(r.dk.layout, KvLayout::Packed);
  EXPECT_TRUE(r.dq.packed);
  EXPECT_EQ(r.fwd.seq.k_len(1), 5);
}

// ---- Merge ----------------------------------------------------------------------------------------

#define EXPECT_MERGE_INVALID(call, needle) \
  EXPECT_TRUE(merge_rejected((call).p, needle, {&(call).out, &(call).lse}))

TEST(ValidateMerge, BatchedResolves) {
  MergeCall c;
  MergeProblem r;
  ASSERT_TRUE(resolve_merge(c.p, &r).is_ok());
  EXPECT_EQ(r.raw, &c.p);
  EXPECT_EQ(r.splits, 3);
  EXPECT_EQ(r.batch, 2);
  EXPECT_EQ(r.seqlen, 3);
  EXPECT_EQ(r.heads, 2);
  EXPECT_EQ(r.dv, 4);
  EXPECT_EQ(r.part_stride[0], 48);
  EXPECT_EQ(r.part_stride[4], 1);
  EXPECT_EQ(r.lse_part_stride[1], 6);
  EXPECT_EQ(r.out_stride[1], 8);
  EXPECT_EQ(r.lse_stride[2], 1);
  EXPECT_TRUE(r.has_lse);
}
TEST(ValidateMerge, PackedNormalisedToBatchOne) {
  HostTensor parts(FP_F16, {2, 7, 3, 5}), lse_parts(FP_F32, {2, 3, 7}), out(FP_BF16, {7, 3, 5});
  MergeParams p;
  p.out_partials = parts.view();
  p.lse_partials = lse_parts.view();
  p.out = out.view();
  MergeProblem r;
  Status st = resolve_merge(p, &r);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(r.batch, 1);
  EXPECT_EQ(r.seqlen, 7);
  EXPECT_EQ(r.heads, 3);
  EXPECT_EQ(r.dv, 5);
  EXPECT_EQ(r.part_stride[0], 105);
  EXPECT_EQ(r.part_stride[2], 15);
  EXPECT_EQ(r.part_stride[3], 5);
  EXPECT_EQ(r.lse_part_stride[0], 21);
  EXPECT_EQ(r.lse_part_stride[2], 7);
  EXPECT_EQ(r.lse_part_stride[3], 1);
  EXPECT_EQ(r.out_stride[1], 15);
  EXPECT_EQ(r.part_dtype, FP_F16);
  EXPECT_EQ(r.out_dtype, FP_BF16);
  EXPECT_FALSE(r.has_lse);
}
TEST(ValidateMerge, RequiredTensors) {
  MergeCall c;
  c.p.out_partials = fp_tensor{};
  EXPECT_MERGE_INVALID(c, "out_partials: is required");
  MergeCall d;
  d.p.lse_partials = fp_tensor{};
  EXPECT_MERGE_INVALID(d, "lse_partials: is required");
  MergeCall e;
  e.p.out = fp_tensor{};
  EXPECT_MERGE_INVALID(e, "out: is required");
}
TEST(ValidateMerge, PartialsRank) {
  MergeCall c;
  HostTensor parts(FP_F32, {3, 4, 4});
  c.p.out_partials = parts.view();
  EXPECT_MERGE_INVALID(c, "out_partials: must be 5-D [N, B, S, H, Dv] or 4-D [N, T, H, Dv]");
}
TEST(ValidateMerge, AtLeastOnePartial) {
  MergeCall c;
  HostTensor parts(FP_F32, {0, 2, 3, 2, 4}), lp(FP_F32, {0, 2, 2, 3});
  c.p.out_partials = parts.view();
  c.p.lse_partials = lp.view();
  EXPECT_MERGE_INVALID(c, "out_partials: must hold at least one partial");
}
TEST(ValidateMerge, LsePartialsShape) {
  MergeCall c;
  HostTensor lp(FP_F32, {3, 2, 3, 2});
  c.p.lse_partials = lp.view();
  EXPECT_MERGE_INVALID(c, "lse_partials: must have shape [N, B, H, S] = [3, 2, 2, 3]");
}
TEST(ValidateMerge, OutShape) {
  MergeCall c;
  HostTensor out(FP_F32, {2, 3, 2, 5});
  c.p.out = out.view();
  EXPECT_MERGE_INVALID(c, "out: must have shape [B, S, H, Dv] = [2, 3, 2, 4]");
}
TEST(ValidateMerge, LseShape) {
  MergeCall c;
  HostTensor lse(FP_F32, {2, 3, 2});
  c.p.lse = lse.view();
  EXPECT_MERGE_INVALID(c, "lse: must have shape [B, H, S] = [2, 2, 3]");
}
TEST(ValidateMerge, PackedShapes) {
  HostTensor parts(FP_F32, {2, 7, 3, 5}), lp(FP_F32, {2, 7, 3}), out(FP_F32, {7, 3, 5});
  out.fill_poison();
  MergeParams p;
  p.out_partials = parts.view();
  p.lse_partials = lp.view();
  p.out = out.view();
  EXPECT_TRUE(merge_rejected(p, "lse_partials: must have shape [N, H, T] = [2, 3, 7]", {&out}));
}
TEST(ValidateMerge, Dtypes) {
  MergeCall c;
  c.p.out_partials.dtype = FP_I32;
  EXPECT_MERGE_INVALID(c, "out_partials: dtype must be float16");
  MergeCall d;
  d.p.lse_partials.dtype = FP_F16;
  EXPECT_MERGE_INVALID(d, "lse_partials: must be float32");
  MergeCall e;
  e.p.lse.dtype = FP_F64;
  EXPECT_MERGE_INVALID(e, "lse: must have lse_partials' dtype float32");
  MergeCall f;
  f.p.out.dtype = FP_I32;
  EXPECT_MERGE_INVALID(f, "out: dtype must be float16");
}
TEST(ValidateMerge, OneDevice) {
  MergeCall c;
  c.p.out.device_index = 2;
  EXPECT_MERGE_INVALID(c, "out: must be on the same device as out_partials");
}
TEST(ValidateMerge, Execution) {
  MergeCall c;
  int s = 0;
  c.p.stream = &s;
  EXPECT_MERGE_INVALID(c, "stream: must be NULL for CPU tensors");
  MergeCall d;
  d.p.num_threads = -1;
  EXPECT_MERGE_INVALID(d, "num_threads: must be >= 0");
  MergeCall e;
  e.p.backend = static_cast<fp_backend>(-1);
  EXPECT_MERGE_INVALID(e, "backend: is not a valid fp_backend");
}

#define EXPECT_MERGE_BWD_INVALID(call, needle) \
  EXPECT_TRUE(merge_bwd_rejected((call).p, needle, {&(call).d_parts, &(call).d_lse_parts}))

TEST(ValidateMergeBwd, ValidResolves) {
  MergeBwdCall c;
  MergeBwdProblem r;
  Status st = resolve_merge_bwd(c.p, &r);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(r.raw, &c.p);
  EXPECT_EQ(r.fwd.raw, &c.p.fwd);
  EXPECT_TRUE(r.has_dlse);
  EXPECT_EQ(r.dout_stride[0], 24);
  EXPECT_EQ(r.d_part_stride[0], 48);
  EXPECT_EQ(r.d_lse_part_stride[0], 12);
  EXPECT_EQ(r.dlse_stride[1], 3);
}
TEST(ValidateMergeBwd, LseRequired) {
  MergeBwdCall c;
  c.p.fwd.lse = fp_tensor{};
  EXPECT_MERGE_BWD_INVALID(c, "lse: is required");
}
TEST(ValidateMergeBwd, DoutLikeOut) {
  MergeBwdCall c;
  HostTensor dout(FP_F32, {2, 3, 2, 3});
  c.p.dout = dout.view();
  EXPECT_MERGE_BWD_INVALID(c, "dout: must have out's shape");
}
TEST(ValidateMergeBwd, DlseLikeLseOptional) {
  MergeBwdCall c;
  c.p.dlse.dtype = FP_F64;
  EXPECT_MERGE_BWD_INVALID(c, "dlse: must have lse's dtype");
  MergeBwdCall d;
  d.p.dlse = fp_tensor{};
  MergeBwdProblem r;
  ASSERT_TRUE(resolve_merge_bwd(d.p, &r).is_ok());
  EXPECT_FALSE(r.has_dlse);
}
TEST(ValidateMergeBwd, DPartialsLikePartials) {
  MergeBwdCall c;
  HostTensor dp(FP_F32, {3, 2, 3, 2, 5});
  c.p.d_out_partials = dp.view();
  EXPECT_MERGE_BWD_INVALID(c, "d_out_partials: must have out_partials's shape");
  MergeBwdCall d;
  d.p.d_lse_partials = fp_tensor{};
  EXPECT_MERGE_BWD_INVALID(d, "d_lse_partials: is required");
}

// ---- Left-padded cache (cache_leftpad) -----------------------------------------------------------

// A contiguous cache call: FwdCall's k/v [2, 5, 2, 8] as a cache with seqused_k {4, 5}.
struct LeftpadCall : FwdCall {
  HostTensor seqused = HostTensor::i32({2}, {4, 5});
  HostTensor leftpad = HostTensor::i32({2}, {1, 0});
  LeftpadCall() {
    p.seqused_k = seqused.view();
    p.cache_leftpad = leftpad.view();
  }
};

TEST(ResolveFwd, LeftpadContiguousAddressing) {
  LeftpadCall c;
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.seq.cache_leftpad, c.leftpad.storage());
  EXPECT_EQ(r.seq.k_pad(0), 1);
  EXPECT_EQ(r.seq.k_len(0), 3);  // rows [1, 4)
  EXPECT_EQ(r.seq.k_len(1), 5);
  EXPECT_EQ(r.seq.cache_rows_used(0), 4);
  EXPECT_EQ(r.seq.key_row(0, 2), 3);
  // k [2, 5, 2, 8] contiguous: strides 80, 16, 8. Key 2 of sequence 0 is cache row 3.
  EXPECT_EQ(r.k.at(r.seq, 0, 2, 1), 0 * 80 + 3 * 16 + 8);
  EXPECT_EQ(r.k.at_row(r.seq, 0, 2, 1), 0 * 80 + 2 * 16 + 8);
  EXPECT_EQ(r.v.at(r.seq, 1, 0, 0), 80);
  // With cache_batch_idx the pad applies within the selected cache row.
  HostTensor idx = HostTensor::i32({2}, {1, 0});
  c.p.cache_batch_idx = idx.view();
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.k.at(r.seq, 0, 2, 1), 1 * 80 + 3 * 16 + 8);
}
TEST(ResolveFwd, LeftpadPagedAddressing) {
  PagedCall c;  // seqused_k {5, 2}, Snew 1, page 4, block_table {{5, 0, 3}, {1, 2, 4}}
  HostTensor pad = HostTensor::i32({2}, {2, 1});
  c.p.cache_leftpad = pad.view();
  Problem r;
  ASSERT_TRUE(resolves(c.p, &r));
  EXPECT_EQ(r.seq.k_len(0), 5 + 1 - 2);
  EXPECT_EQ(r.seq.k_len(1), 2 + 1 - 1);
  // Sequence 0, key 3 = cache row 5: block_table[0][1] = 0, slot 1 (page stride 64, row 16).
  EXPECT_EQ(r.k.at(r.seq, 0, 3, 1), 0 * 64 + 1 * 16 + 8);
  // The append writes absolute rows: sequence 1's new row is cache row 2 (block 1, slot 2).
  EXPECT_EQ(r.k.at_row(r.seq, 1, 2, 0), 1 * 64 + 2 * 16);
  EXPECT_EQ(r.k.at(r.seq, 1, 1, 0), 1 * 64 + 2 * 16);
}
TEST(ValidateFwd, LeftpadNeedsSeqused) {
  LeftpadCall c;
  c.p.seqused_k = fp_tensor{};
  EXPECT_FWD_INVALID(c, "cache_leftpad: needs seqused_k");
}
TEST(ValidateFwd, LeftpadIsInt32) {
  LeftpadCall c;
  HostTensor f(FP_F32, {2});
  c.p.cache_leftpad = f.view();
  EXPECT_FWD_INVALID(c, "cache_leftpad: must be int32");
}
TEST(ValidateFwd, LeftpadShapeIsB) {
  LeftpadCall c;
  HostTensor three = HostTensor::i32({3}, {0, 0, 0});
  c.p.cache_leftpad = three.view();
  EXPECT_FWD_INVALID(c, "cache_leftpad: must have shape [B] = [2]");
  HostTensor two_d = HostTensor::i32({2, 1}, {0, 0});
  c.p.cache_leftpad = two_d.view();
  EXPECT_FWD_INVALID(c, "cache_leftpad: must have shape [B] = [2]");
}
TEST(ValidateFwd, LeftpadContiguous) {
  LeftpadCall c;
  HostTensor wide = HostTensor::i32({4}, {0, 0, 0, 0});
  fp_tensor t = wide.view();
  t.shape[0] = 2;
  t.stride[0] = 2;
  c.p.cache_leftpad = t;
  EXPECT_FWD_INVALID(c, "cache_leftpad: last dimension must be contiguous");
}
TEST(ValidateFwd, LeftpadSameDevice) {
  LeftpadCall c;
  c.p.cache_leftpad.device_type = FP_DEVICE_CUDA;
  EXPECT_FWD_INVALID(c, "cache_leftpad: must be on the same device as q");
}
TEST(ValidateFwd, LeftpadNotWithPackedKeys) {
  VarlenCall c;
  HostTensor used = HostTensor::i32({2}, {4, 6}), pad = HostTensor::i32({2}, {1, 1});
  c.p.seqused_k = used.view();
  c.p.cache_leftpad = pad.view();
  EXPECT_FWD_INVALID(c, "cache_leftpad: applies to a KV cache");
}
TEST(ValidateFwd, LeftpadValuesWithinSeqused) {
  for (int32_t bad_pad : {-1, 5}) {  // seqused_k[0] = 4
    LeftpadCall c;
    static_cast<int32_t*>(c.leftpad.storage())[0] = bad_pad;
    EXPECT_FWD_INVALID(c, "cache_leftpad: entries must be in [0, seqused_k]");
  }
  // With an append, nothing is written into the cache either.
  PagedCall pg;
  HostTensor pad = HostTensor::i32({2}, {0, 3});  // seqused_k[1] = 2
  pg.p.cache_leftpad = pad.view();
  const HostTensor k0 = pg.k, v0 = pg.v;
  EXPECT_TRUE(fwd_rejected(pg.p, FP_ERR_INVALID_ARGUMENT, "cache_leftpad: entries must be in [0, seqused_k]",
                           {&pg.out, &pg.lse}));
  EXPECT_TRUE(pg.k.bitwise_equal(k0));
  EXPECT_TRUE(pg.v.bitwise_equal(v0));
  // pad == seqused_k is valid (no old keys; the appended ones remain).
  static_cast<int32_t*>(pad.storage())[1] = 2;
  EXPECT_TRUE(resolves(pg.p));
}
TEST(ValidateFwd, LeftpadBlocksInsideThePadAreNotRead) {
  PagedCall c;  // page 4; sequence 0 uses rows [pad, 6)
  int32_t* bt = static_cast<int32_t*>(c.block_table.storage());
  bt[0] = 99;  // block 0 of sequence 0: invalid
  HostTensor pad = HostTensor::i32({2}, {4, 0});
  c.p.cache_leftpad = pad.view();
  EXPECT_TRUE(resolves(c.p));  // rows 0..3 are all padding
  static_cast<int32_t*>(pad.storage())[0] = 3;
  EXPECT_FWD_INVALID(c, "block_table: entries must be in [0, num_blocks = 6)");
}
TEST(ValidateBwd, LeftpadUnsupported) {
  BwdCall c;
  HostTensor used = HostTensor::i32({2}, {4, 5}), pad = HostTensor::i32({2}, {1, 0});
  c.p.fwd.seqused_k = used.view();
  c.p.fwd.cache_leftpad = pad.view();
  EXPECT_BWD_UNSUPPORTED(c, "backward: cache_leftpad");
}

}  // namespace
}  // namespace flashport::test
