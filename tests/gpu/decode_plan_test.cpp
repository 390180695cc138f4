// The decode kernel's planning rules (gpu/mma/decode_plan.hpp) on validated calls, without a
// device: which calls it takes or declines (and why), its split count and workspace on an
// H100-sized machine. The tensors are shapes only (a fake CUDA address, never read).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "core/validate.hpp"
#include "flashport/flashport.h"
#include "gpu/mma/decode_plan.hpp"

namespace {

using namespace flashport;
using namespace flashport::gpu;

// A fake device address: aligned, never dereferenced (resolve_fwd reads no CUDA memory).
void* fake_ptr() { return reinterpret_cast<void*>(uintptr_t(1) << 20); }

fp_tensor dense(fp_dtype t, std::vector<int64_t> shape) {
  fp_tensor x{};
  x.data = fake_ptr();
  x.dtype = t;
  x.ndim = static_cast<int32_t>(shape.size());
  int64_t st = 1;
  for (int i = x.ndim - 1; i >= 0; --i) {
    x.shape[i] = shape[size_t(i)];
    x.stride[i] = st;
    st *= shape[size_t(i)];
  }
  x.device_type = FP_DEVICE_CUDA;
  x.device_index = 0;
  return x;
}

struct Shape {
  int64_t b = 1, sq = 1, sk = 8192, hq = 32, hkv = 8, d = 128, dv = 128;
  fp_dtype dtype = FP_BF16;
  bool paged = false;
  int64_t page_size = 16;
  int32_t splits = 0;
  float dropout = 0.0f;
  bool causal = false;
};

// Resolves the call (a KV cache with seqused_k, contiguous or paged) into `out`.
Status resolve(const Shape& s, Problem* out, fp_attn_params* raw) {
  fp_attn_params_init(raw);
  raw->backend = FP_BACKEND_CUDA;
  raw->q = dense(s.dtype, {s.b, s.sq, s.hq, s.d});
  raw->out = dense(s.dtype, {s.b, s.sq, s.hq, s.dv});
  raw->lse = dense(FP_F32, {s.b, s.hq, s.sq});
  if (s.paged) {
    const int64_t blocks = (s.sk + s.page_size - 1) / s.page_size;
    raw->k = dense(s.dtype, {s.b * blocks, s.page_size, s.hkv, s.d});
    raw->v = dense(s.dtype, {s.b * blocks, s.page_size, s.hkv, s.dv});
    raw->block_table = dense(FP_I32, {s.b, blocks});
  } else {
    raw->k = dense(s.dtype, {s.b, s.sk, s.hkv, s.d});
    raw->v = dense(s.dtype, {s.b, s.sk, s.hkv, s.dv});
  }
  raw->seqused_k = dense(FP_I32, {s.b});
  raw->num_splits = s.splits;
  raw->dropout_p = s.dropout;
  raw->causal = s.causal;
  return resolve_fwd(*raw, out);
}

constexpr int64_t kH100Slots = 132 * 2;  // SMs x resident decode blocks (2 x 100 KiB shared)

TEST(DecodeKernelPlan, TakesDecodeShapes) {
  for (const Shape& s : {Shape{}, Shape{.b = 8}, Shape{.b = 64, .sk = 65536}, Shape{.hq = 8, .hkv = 8},
                         Shape{.hq = 16, .hkv = 1}, Shape{.sq = 2, .hq = 16, .hkv = 2, .causal = true},
                         Shape{.sq = 16, .hq = 8, .hkv = 8, .causal = true}, Shape{.d = 96, .dv = 72},
                         Shape{.dtype = FP_F16, .paged = true, .page_size = 1},
                         Shape{.paged = true, .page_size = 256}}) {
    Problem p;
    fp_attn_params raw;
    ASSERT_TRUE(resolve(s, &p, &raw).is_ok());
    EXPECT_EQ(decode_kernel_decline(p), "") << "B=" << s.b << " Sq=" << s.sq << " Hq/Hkv=" << s.hq << "/" << s.hkv;
  }
}

TEST(DecodeKernelPlan, DeclinesWithReasons) {
  struct Declined {
    Shape s;
    const char* why;
  };
  for (const Declined& c : {Declined{Shape{.d = 64, .dv = 64}, "head dims"}, Declined{Shape{.d = 256, .dv = 256}, "head dims"},
                            Declined{Shape{.d = 100, .dv = 100}, "head dims"},
                            Declined{Shape{.sq = 5, .hq = 32, .hkv = 8}, "rows"},
                            Declined{Shape{.sq = 17, .hq = 8, .hkv = 8}, "rows"},
                            Declined{Shape{.dtype = FP_F32}, "float16/bfloat16"},
                            Declined{Shape{.dropout = 0.1f}, "dropout"}}) {
    Problem p;
    fp_attn_params raw;
    ASSERT_TRUE(resolve(c.s, &p, &raw).is_ok());
    const std::string why = decode_kernel_decline(p);
    EXPECT_NE(why.find(c.why), std::string::npos) << "'" << why << "' should name " << c.why;
  }
}

// Split counts and workspace of the benchmark shapes (B x Sk, 32/8 heads) on an H100.
TEST(DecodeKernelPlan, SplitsAndWorkspace) {
  struct Want {
    int64_t b, sk;
    int splits;
  };
  for (const Want& w : {Want{1, 8192, 32}, Want{1, 65536, 32}, Want{8, 8192, 4}, Want{8, 65536, 4},
                        Want{64, 8192, 1}, Want{1, 1, 1}, Want{1, 1000, 8}}) {
    Problem p;
    fp_attn_params raw;
    Shape s;
    s.b = w.b, s.sk = w.sk;
    ASSERT_TRUE(resolve(s, &p, &raw).is_ok());
    SCOPED_TRACE("B=" + std::to_string(w.b) + " Sk=" + std::to_string(w.sk));
    const DecodeKernelShape sh = decode_kernel_shape(p);
    EXPECT_EQ(sh.pack, 4);
    EXPECT_EQ(sh.heads, 8);
    const int splits = decode_kernel_splits(p, kH100Slots);
    EXPECT_EQ(splits, w.splits);
    const FwdWorkspace ws = decode_kernel_workspace(p, splits);
    if (splits > 1) {
      EXPECT_EQ(ws.split_counters, w.b * 8) << "one counter per (sequence, kv head)";
      EXPECT_GE(ws.split_counter_offset, ws.lse_offset + size_t(splits) * size_t(ws.rows) * 4);
      EXPECT_EQ(ws.split_counter_offset % 256, 0u);
      EXPECT_GE(ws.total, ws.split_counter_offset + size_t(ws.split_counters) * sizeof(NonceCounter));
      EXPECT_EQ(decode_kernel_workspace_bytes(ws), ws.total + 15) << "room to start at a 16-byte boundary";
    } else {
      EXPECT_EQ(ws.total, 0u) << "no split, no rotary: no workspace";
      EXPECT_EQ(decode_kernel_workspace_bytes(ws), 0u);
    }
  }
  // Forced counts: kept, clamped to the key tiles (1000 keys: 8 tiles of 128) and the partials' bound.
  for (auto [forced, sk, want] : {std::tuple<int32_t, int64_t, int>{2, 8192, 2}, {7, 8192, 7}, {64, 8192, 64},
                                  {64, 1000, 8}, {64, 7, 1}, {1, 8192, 1}, {300, 65536, 128}}) {
    Problem p;
    fp_attn_params raw;
    Shape s;
    s.sk = sk, s.splits = forced;
    ASSERT_TRUE(resolve(s, &p, &raw).is_ok());
    EXPECT_EQ(decode_kernel_splits(p, kH100Slots), want) << "forced " << forced << " Sk=" << sk;
  }
}

// The layout starts at the caller's first 16-byte boundary, inside the 15 extra bytes.
// The call nonces (next_call_nonce: the decode kernel's split counters, the Hopper forward's tile
// walk): never 0 (the kernels' reset value), distinct, and not small integers (a workspace that
// held indices or positions must not match them).
TEST(DecodeKernelPlan, CallNoncesAreDistinctAndWide) {
  std::vector<uint64_t> n(10000);
  for (uint64_t& x : n) x = next_call_nonce();
  EXPECT_EQ(std::count(n.begin(), n.end(), 0ull), 0);
  EXPECT_EQ(std::count_if(n.begin(), n.end(), [](uint64_t x) { return x < (1ull << 32); }), 0);
  std::sort(n.begin(), n.end());
  EXPECT_EQ(std::adjacent_find(n.begin(), n.end()), n.end()) << "a nonce repeated";
}

TEST(DecodeKernelPlan, WorkspaceBaseIsAligned) {
  alignas(16) static char buf[64];
  for (size_t off = 0; off < 32; ++off) {
    char* base = static_cast<char*>(decode_kernel_workspace_base(buf + off));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(base) % 16, 0u);
    EXPECT_GE(base, buf + off);
    EXPECT_LE(base, buf + off + 15);
  }
}

// The tile row the planner and the kernel share: its min_blocks blocks per SM on sm_90 (228 KiB
// per SM, 1 KiB reserved per block), and a block within an A100's 163 KiB opt-in limit.
TEST(DecodeKernelPlan, TileFitsItsBlocksPerSm) {
  EXPECT_EQ(kDecodeTile.rows, 16);
  EXPECT_EQ(kDecodeTile.keys_per_warp(), 16);
  EXPECT_LE(kDecodeTile.min_blocks * (kDecodeTile.smem_bytes() + 1024), 228 * 1024);
  EXPECT_LE(kDecodeTile.smem_bytes(), 163 * 1024);
  EXPECT_LE(kDecodeTile.scratch_bytes(), kDecodeTile.smem_bytes());
}

}  // namespace
