// The decode kernel (src/gpu/mma/decode_kernel.cuh) against the fp64 reference: fresh random
// inputs, poisoned outputs and sentinels (gpu_harness.hpp), NaN in every cache row no key reads,
// every KV layout it takes (contiguous, paged with page sizes 1/16/256, cache_batch_idx,
// cache_leftpad, varlen), GQA packs, the score features, LSE, forced and automatic split counts
// (its in-kernel merge), and CUDA-graph capture and replay with a garbage workspace.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu_harness.hpp"

namespace gputest {
namespace {

using flashport::gpu::kDecodeTile;

// Key tiles the planner counts for the case (contiguous: Sk rows, varlen: the longest sequence's,
// which the harness passes as max_seqlen_k; paged: whole pages).
int64_t key_tiles(const Case& c) {
  const int64_t sk = c.varlen ? *std::max_element(c.lk.begin(), c.lk.end()) : c.sk;
  const int64_t rows = c.cache && c.paged ? (sk + c.page_size - 1) / c.page_size * c.page_size : sk;
  return std::max<int64_t>(1, (rows + kDecodeTile.block_n - 1) / kDecodeTile.block_n);
}

// Checks the case against the reference and that the decode kernel ran it with the forced split
// count (clamped to the key tiles), or > 1 split when `want_split` and the count is automatic.
void check_decode(const Case& c, bool want_split = false) {
  fp_selection sel{};
  check_case(c, &sel);
  SCOPED_TRACE(c.describe());
  EXPECT_NE(std::string(sel.kernel).find(kDecodeTile.name), std::string::npos) << sel.kernel;
  if (c.splits > 0) {
    EXPECT_EQ(sel.num_splits, std::min<int64_t>({c.splits, key_tiles(c), 128}));
  } else if (want_split) {
    EXPECT_GT(sel.num_splits, 1);
  }
  if (sel.num_splits > 1)
    EXPECT_NE(std::string(sel.kernel).find(":splitkv+combine_in_kernel"), std::string::npos) << sel.kernel;
}

// B x Sk x (Hq/Hkv), each case on a layout and a split count of its own (every layout meets
// every split count over the sweep): caches with NaN in the rows no key reads, the first
// sequence at full length, the others random.
TEST(CudaDecodeKernel, ShapesLayoutsAndSplits) {
  SKIP_WITHOUT_GPU();
  struct Heads { int64_t hq, hkv; };
  const int32_t kSplits[] = {0, 1, 2, 7, 64};
  int k = 0;
  for (int64_t batch : {1, 3, 8})
    for (int64_t sk : {1, 7, 64, 1000, 8192 + 13})
      for (Heads h : {Heads{32, 8}, Heads{8, 8}, Heads{16, 1}}) {
        ++k;
        Case c;
        c.dtype = rand_dtype();
        c.batch = batch, c.hq = h.hq, c.hkv = h.hkv, c.d = 128, c.dv = 128, c.sq = 1, c.sk = sk;
        c.cache = true;
        c.nan_unused_cache = true;
        c.seqused = {sk};
        for (int64_t b = 1; b < batch; ++b) c.seqused.push_back(rand_int(0, sk));
        switch (k % 6) {
          case 0: break;  // contiguous
          case 1: c.paged = true, c.page_size = 1; break;
          case 2: c.paged = true, c.page_size = 16; break;
          case 3: c.paged = true, c.page_size = 256; break;
          case 4: c.batch_idx = true; break;
          case 5:
            for (int64_t b = 0; b < batch; ++b) c.leftpad.push_back(rand_int(0, c.seqused[size_t(b)]));
            break;
        }
        c.splits = kSplits[k % 5];
        check_decode(c);
      }
}

// Leftpad on paged caches and with cache_batch_idx; the long case with automatic splits.
TEST(CudaDecodeKernel, LeftPadOnEveryLayout) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 4; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.nan_unused_cache = true;
    c.paged = rep < 2, c.page_size = rep == 0 ? 16 : 256;
    c.batch_idx = rep == 2;
    c.batch = 3, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 5000;
    c.seqused = {5000, 4000, 130};
    c.leftpad = {3, 1777, 129};
    c.splits = rep == 3 ? 0 : 7;
    check_decode(c, true);
  }
}

// Causal (both alignments), windows, softcap, ALiBi ([Hq] and [B, Hq]), sinks, no LSE, with
// several query rows per sequence (Sq x group <= 16), with and without splits.
TEST(CudaDecodeKernel, ScoreFeaturesAndQueryRows) {
  SKIP_WITHOUT_GPU();
  struct Rows { int64_t sq, hq, hkv; };
  for (Rows r : {Rows{1, 32, 8}, Rows{2, 16, 2}, Rows{4, 8, 2}, Rows{16, 4, 4}, Rows{3, 5, 1}})
    for (int32_t splits : {1, 5, 0}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = r.hq, c.hkv = r.hkv, c.d = 128, c.dv = 128, c.sq = r.sq, c.sk = 1531;
      c.cache = true, c.paged = splits == 5, c.page_size = 16, c.nan_unused_cache = true;
      c.seqused = {1531, 700};
      c.splits = splits;
      c.causal = true;
      check_decode(c);
      c.top_left = r.sq > 1;
      c.wl = 300;
      check_decode(c);
      c.causal = false, c.top_left = false, c.wl = 200, c.wr = r.sq > 1 ? 1 : -1;
      check_decode(c);
      c.wl = c.wr = -1;
      c.softcap = 15.0f, c.alibi = true, c.sinks = true;
      check_decode(c);
      c.softcap = 0.0f, c.alibi_per_batch = true, c.lse = false;
      check_decode(c);
      c.alibi = false, c.sinks = true, c.lse = true, c.scale = 0.05f;
      check_decode(c);
    }
}

// Head dims below the instance's 128 (zero columns), batched and varlen (non-cache) K/V, strided
// tensors, fp16 and bf16.
TEST(CudaDecodeKernel, HeadDimsBatchedVarlenStrided) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{96, 72}, {72, 128}, {128, 80}, {120, 120}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 3, c.hq = 16, c.hkv = 4, c.d = d, c.dv = dv, c.sq = 1, c.sk = 999;
    c.splits = static_cast<int32_t>(rand_int(0, 9));
    check_decode(c);
    c.strided = true;
    check_decode(c);
  }
  Case v;
  v.dtype = rand_dtype();
  v.varlen = true;
  v.lq = {1, 4, 2, 1};
  v.lk = {1, 900, 2500, 64};
  v.hq = 8, v.hkv = 2, v.d = 128, v.dv = 128;
  for (int32_t s : {1, 7, 0}) {
    v.splits = s;
    v.causal = s == 7;
    check_decode(v);
  }
}

// Append + rotary into the cache first (rotated q in the workspace, before the partials).
TEST(CudaDecodeKernel, AppendRotaryThenAttend) {
  SKIP_WITHOUT_GPU();
  for (bool paged : {false, true}) {
    Case c;
    c.dtype = FP_BF16;
    c.cache = true, c.paged = paged, c.page_size = 16;
    c.batch = 2, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.snew = 1, c.sk = 4096;
    c.rot_dim = 128;
    c.splits = paged ? 0 : 6;
    check_decode(c, true);
  }
}

// Dropout is declined (no decode use): the mma.sync decode tile runs it, correctly.
TEST(CudaDecodeKernel, DropoutRunsTheMmaDecodeTile) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_F16;
  c.batch = 2, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 777;
  c.dropout = 0.25f;
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_EQ(std::string(sel.kernel).find(kDecodeTile.name), std::string::npos) << sel.kernel;
  EXPECT_NE(std::string(sel.kernel).find(":decode_d128_m64"), std::string::npos) << sel.kernel;
}

// Captured into a CUDA graph and replayed over a workspace of 0xFF bytes (split counters and
// partials must be set by each replay), bit-equal to a direct call; a second direct call over
// the first one's workspace gives the same bits.
TEST(CudaDecodeKernel, GraphReplayWithGarbageWorkspace) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 3; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.paged = rep == 1, c.page_size = 16, c.nan_unused_cache = true;
    c.batch = rep == 2 ? 8 : 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 8192 + 13;
    c.seqused = std::vector<int64_t>(size_t(c.batch), 8192 + 13);
    c.splits = rep == 1 ? 64 : 0;
    SCOPED_TRACE(c.describe());
    Call call(c);
    DeviceCall direct(call);
    const Outputs want = run_cuda(call, direct);
    ASSERT_TRUE(want.ok) << want.error;
    EXPECT_NE(std::string(want.sel.kernel).find(kDecodeTile.name), std::string::npos) << want.sel.kernel;
    EXPECT_GT(want.sel.num_splits, 1);
    // Same workspace, outputs poisoned again: same bits (fixed merge order, counters re-zeroed).
    direct.out.upload(call.out);
    const Outputs again = run_cuda(call, direct);
    ASSERT_TRUE(again.ok) << again.error;
    EXPECT_TRUE(again.out.bitwise_equal(want.out)) << "second call differs";
    EXPECT_TRUE(again.lse.bitwise_equal(want.lse)) << "second call's lse differs";
    expect_graph_replay_equals(call, want, /*garbage_workspace=*/true);
  }
}

// The split counters (mma/decode_kernel.cuh, NonceCounter) end a split call with `ready` 0 and
// one count per split: a CUDA-graph replay repeats the call's nonce, so a `ready` left at it would
// let a replay's splits count on before split 0 restarts the counter, and the wrong block merge
// other splits' stale partials (outputs alone rarely show it). The counters are the last region of
// the decode layout (gpu/common/fwd_plan.hpp): B x Hkv NonceCounters, 256-byte aligned, from the
// first 16-byte boundary of the caller's workspace. The workspace holds a set bit pattern in every
// word before the call.
TEST(CudaDecodeKernel, SplitCountersEndClear) {
  SKIP_WITHOUT_GPU();
  for (int32_t splits : {0, 5, 64}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.batch = 3, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 9000;
    c.seqused = {9000, 4100, 77};
    c.splits = splits;
    SCOPED_TRACE(c.describe());
    Call call(c);
    DeviceCall dev(call);
    fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
    fp_selection sel{};
    ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
    HostTensor sized(FP_F32, {static_cast<int64_t>((sel.workspace_bytes + 3) / 4)});
    dev.workspace.upload(sized);
    CUDA_OK(cudaMemset(dev.workspace.ptr, 0xA5, dev.workspace.bytes));
    const Outputs got = run_cuda(call, dev);
    ASSERT_TRUE(got.ok) << got.error;
    ASSERT_NE(std::string(got.sel.kernel).find(kDecodeTile.name), std::string::npos) << got.sel.kernel;
    ASSERT_GT(got.sel.num_splits, 1);
    const size_t n = size_t(c.batch * c.hkv);
    const size_t region = (n * sizeof(flashport::gpu::NonceCounter) + 255) / 256 * 256;
    const uintptr_t base = (reinterpret_cast<uintptr_t>(dev.workspace.ptr) + 15) / 16 * 16;
    const size_t layout_bytes = got.sel.workspace_bytes - 15;  // decode_kernel_workspace_bytes
    ASSERT_GE(layout_bytes, region);
    std::vector<flashport::gpu::NonceCounter> counters(n);
    CUDA_OK(cudaMemcpy(counters.data(), reinterpret_cast<const void*>(base + layout_bytes - region),
                       n * sizeof(flashport::gpu::NonceCounter), cudaMemcpyDeviceToHost));
    for (const flashport::gpu::NonceCounter& k : counters) {
      EXPECT_EQ(k.ready, 0ull) << "a counter left started after the merge";
      EXPECT_EQ(k.count, got.sel.num_splits) << "one count per split";
    }
    const Outputs ref = run_reference(call);
    ASSERT_TRUE(ref.ok) << ref.error;
    const double tol = flashport::test::tolerance(c.dtype);
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false), gather_rows(call, ref.out, false), tol, "out"));
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.lse, true), gather_rows(call, ref.lse, true), 1e-4, "lse"));
    EXPECT_TRUE(got.out.all_written() && got.lse.all_written());
  }
}

// A caller's workspace starting at an odd 4-byte offset, filled with 0xFF bytes: the kernel's
// 16-byte partial stores and loads start at the next 16-byte boundary inside it.
TEST(CudaDecodeKernel, UnalignedGarbageWorkspace) {
  SKIP_WITHOUT_GPU();
  for (size_t offset : {4, 8, 12}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.paged = offset == 8, c.page_size = 16, c.nan_unused_cache = true;
    c.batch = 2, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 3000;
    c.splits = 7;
    c.rot_dim = offset == 12 ? 128 : 0, c.snew = offset == 12 ? 1 : 0;  // rotated q in the workspace too
    SCOPED_TRACE(c.describe() + " workspace offset " + std::to_string(offset));
    Call call(c);
    const Outputs ref = run_reference(call);
    ASSERT_TRUE(ref.ok) << ref.error;
    DeviceCall dev(call);
    dev.workspace_offset = offset;
    fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
    fp_selection sel{};
    ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
    HostTensor sized(FP_F32, {static_cast<int64_t>((sel.workspace_bytes + offset + 3) / 4)});
    dev.workspace.upload(sized);
    CUDA_OK(cudaMemset(dev.workspace.ptr, 0xFF, dev.workspace.bytes));
    CUDA_OK(cudaDeviceSynchronize());
    const Outputs got = run_cuda(call, dev);
    ASSERT_TRUE(got.ok) << got.error;
    EXPECT_NE(std::string(got.sel.kernel).find(kDecodeTile.name), std::string::npos) << got.sel.kernel;
    EXPECT_EQ(got.sel.num_splits, 7);
    const double tol = flashport::test::tolerance(c.dtype);
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false), gather_rows(call, ref.out, false), tol, "out"));
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.lse, true), gather_rows(call, ref.lse, true),
                                       c.rot_dim > 0 ? tol / 4 : 1e-4, "lse"));
    EXPECT_TRUE(got.out.all_written() && got.lse.all_written());
    EXPECT_TRUE(dev.out.sentinel_intact() && dev.lse.sentinel_intact() && dev.workspace.sentinel_intact());
  }
}

}  // namespace
}  // namespace gputest
