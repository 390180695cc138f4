// The NVIDIA kernels' dropout keep bits (src/gpu/common/dropout_lanes.cuh: the Hopper forward and
// backward, and the mma.sync forward main loop), unchanged, run on the CPU by the warp emulation
// of simt_emu.hpp at 32 lanes: each Philox call of the rule is made by one lane and its bits
// handed to the lanes holding the elements by shuffles (forward: within a quad; backward: an
// 8 x 8 bit transpose over the 8 lanes of a query column). Every lane's bits of every element,
// for each tile width the kernels instantiate, are checked against the rule itself
// (core/philox.hpp dropout_keep) at several rates, seeds, heads and positions, with rows of two
// heads (the mma.sync forward's packed GQA rows), and with the device-resident (seed, offset)
// words. The GPU suites (CudaHopperDropout*, CudaFwd.Dropout*, CudaDecodeKernel.Dropout*) check
// the same bits through whole kernels; this runs everywhere, without a GPU.
#include "gpu/amd/amd_layouts.hpp"
#include "simt_emu.hpp"
// After the emulation header:
#include "gpu/common/dropout_lanes.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using flashport::ScoreRules;
using flashport::dropout_keep;
using flashport::dropout_threshold;

struct Rng {
  uint64_t seed, offset;
};

ScoreRules rules(float p, Rng rng, const uint32_t* device_words = nullptr) {
  ScoreRules r;
  r.dropout_p = p;
  r.dropout_threshold = dropout_threshold(p);
  r.dropout_scale = flashport::dropout_keep_scale(r.dropout_threshold);
  r.dropout_seed = device_words ? 0 : rng.seed;
  r.dropout_offset = device_words ? 0 : rng.offset;
  r.dropout_rng = device_words;
  return r;
}

constexpr int kLanes = 128;  // a warpgroup: 4 warps, each its 16 rows (forward) or keys (backward)
constexpr int kB = 1, kHq = 6, kH = 5;

// Forward: warp w holds rows row0 + 16 w + l/4 (+ 8); keys n0 + 8t + 2(l % 4) + {0, 1}. Row
// hf = 1 is of head h1 (h1 != kH: packed GQA rows, two heads in one m-tile).
template <int kNTiles>
int64_t forward_mismatches(const ScoreRules& R, Rng rng, int row0, int n0, int h1 = kH) {
  std::vector<uint32_t> keep(2 * kLanes);
  simt::run_block(kLanes, 32, {}, {1, 1, 1}, 0, [&] {
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
    uint32_t k[2];
    const int hf = lane % 2;  // the row of this lane's calls
    flashport::gpu::fwd_keep_bits<kNTiles>(k, R, kB, kHq, hf ? h1 : kH, row0 + 16 * warp + lane / 4 + 8 * hf, n0);
    keep[2 * tid] = k[0], keep[2 * tid + 1] = k[1];
  });
  const uint32_t t8 = R.dropout_threshold;
  int64_t bad = 0;
  for (int tid = 0; tid < kLanes; ++tid)
    for (int hf = 0; hf < 2; ++hf)
      for (int t = 0; t < kNTiles; ++t)
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = row0 + 16 * (tid / 32) + (tid % 32) / 4 + 8 * hf, j = n0 + 8 * t + 2 * (tid % 4) + e2;
          const bool want = dropout_keep(rng.seed, rng.offset, t8, kB, kHq, hf ? h1 : kH, i, j);
          bad += ((keep[2 * tid + hf] >> flashport::gpu::fwd_keep_bit(t, e2)) & 1u) != uint32_t(want);
        }
  return bad;
}

// Backward (P^T): warp w holds keys key_base + 16 w + l/4 (+ 8), queries q0 + 8t + 2(l % 4) + {0, 1}.
template <int kQTiles>
int64_t backward_mismatches(const ScoreRules& R, Rng rng, int q0, int key_base) {
  constexpr int kWords = (4 * kQTiles + 31) / 32;
  std::vector<uint32_t> keep(kWords * kLanes);
  simt::run_block(kLanes, 32, {}, {1, 1, 1}, 0, [&] {
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
    uint32_t k[kWords];
    flashport::gpu::bwd_keep_bits<kQTiles>(k, R, kB, kHq, kH, q0, key_base + 16 * warp + lane / 4);
    for (int w = 0; w < kWords; ++w) keep[kWords * tid + w] = k[w];
  });
  const uint32_t t8 = R.dropout_threshold;
  int64_t bad = 0;
  for (int tid = 0; tid < kLanes; ++tid)
    for (int t = 0; t < kQTiles; ++t)
      for (int hf = 0; hf < 2; ++hf)
        for (int e2 = 0; e2 < 2; ++e2) {
          const int bit = 4 * t + 2 * hf + e2;
          const int i = q0 + 8 * t + 2 * (tid % 4) + e2, j = key_base + 16 * (tid / 32) + (tid % 32) / 4 + 8 * hf;
          const bool want = dropout_keep(rng.seed, rng.offset, t8, kB, kHq, kH, i, j);
          const int at = flashport::gpu::bwd_keep_bit(bit);
          bad += ((keep[kWords * tid + at / 32] >> (at % 32)) & 1u) != uint32_t(want);
        }
  return bad;
}

// The SWAR byte compare behind both layouts: every byte value against every threshold, in each
// byte position, with garbage in the other bytes.
TEST(DropoutLanes, ByteCompareIsExact) {
  int64_t bad = 0;
  for (uint32_t t = 0; t < 256; ++t) {
    const uint32_t t4 = t * 0x01010101u;
    for (uint32_t v = 0; v < 256; ++v)
      for (int pos = 0; pos < 4; ++pos) {
        const uint32_t others = 0x9E3779B9u * (v + 7 * t + 1);  // arbitrary neighbours
        const uint32_t x = (others & ~(0xFFu << (8 * pos))) | (v << (8 * pos));
        const uint32_t got = flashport::gpu::bytes_ge_top_bits(x, t4, t4 & 0x7F7F7F7Fu);
        bad += ((got >> (8 * pos + 7)) & 1u) != uint32_t(v >= t);
      }
  }
  EXPECT_EQ(bad, 0);
}

const Rng kRngs[] = {{0x1234567890abcdefull, 0}, {7, 0xFFFFFFF0ull}};

// body(rules, rng, label) for each tested rate and (seed, offset).
template <typename Body>
void for_each_rule(Body&& body) {
  for (float p : {0.1f, 0.5f, 0.93f})
    for (const Rng& rng : kRngs)
      body(rules(p, rng), rng, "p " + std::to_string(p) + " seed " + std::to_string(rng.seed));
}

// The kernels' dropout key tiles: 16 accumulator tiles (128 keys), 12 (96), 8 (64: the Hopper D256
// tile and every mma.sync forward tile, which packs GQA rows).
TEST(DropoutLanes, ForwardBitsAreTheRule) {
  for_each_rule([](const ScoreRules& R, const Rng& rng, const std::string& what) {
    EXPECT_EQ(forward_mismatches<16>(R, rng, 0, 0), 0) << what;
    EXPECT_EQ(forward_mismatches<16>(R, rng, 1000, 4096 + 128), 0) << what;
    EXPECT_EQ(forward_mismatches<12>(R, rng, 64, 96 * 7), 0) << what;
    EXPECT_EQ(forward_mismatches<8>(R, rng, 333, 64 * 5), 0) << what;
    EXPECT_EQ(forward_mismatches<8>(R, rng, 77, 64 * 3, kH - 3), 0) << what;  // packed rows
  });
}

// The query tiles of a warp's stage: 16 and 8 (the Hopper D64/D128 steps), 4 (the Hopper D256
// kernel's halves, the mma.sync D128 backward), 8 (mma.sync D64), 2 and 1 (below).
TEST(DropoutLanes, BackwardBitsAreTheRule) {
  for_each_rule([](const ScoreRules& R, const Rng& rng, const std::string& what) {
    EXPECT_EQ(backward_mismatches<16>(R, rng, 0, 0), 0) << what;
    EXPECT_EQ(backward_mismatches<16>(R, rng, 128 * 9, 64 * 3), 0) << what;
    EXPECT_EQ(backward_mismatches<8>(R, rng, 64 * 5, 128 * 2), 0) << what;
    EXPECT_EQ(backward_mismatches<4>(R, rng, 32 * 7, 64 * 11), 0) << what;
    // Below 4 tiles some lanes make no call: the mma.sync D256 (2) and fp32 D256 (1) backward.
    EXPECT_EQ(backward_mismatches<2>(R, rng, 64 * 3, 64 * 5), 0) << what;
    EXPECT_EQ(backward_mismatches<1>(R, rng, 32 * 9 + 8, 32 * 3), 0) << what;
  });
}

// (seed, offset) read from the device-resident words (dropout_rng), as under CUDA graphs and JAX.
TEST(DropoutLanes, DeviceResidentRngWords) {
  const Rng rng{0x0123456789abcdefull, 0x100000003ull};
  const uint32_t words[4] = {uint32_t(rng.seed), uint32_t(rng.seed >> 32), uint32_t(rng.offset),
                             uint32_t(rng.offset >> 32)};
  const ScoreRules R = rules(0.2f, rng, words);
  EXPECT_EQ(forward_mismatches<16>(R, rng, 256, 512), 0);
  EXPECT_EQ(backward_mismatches<8>(R, rng, 192, 384), 0);
}

// Applying the bits to packed P (the Hopper forward's drop_packed): for each tile width the
// kernels instantiate, exactly the dropped elements' 16-bit halves become 0, the others keep their
// bits.
template <int kNTiles>
void expect_drop_packed_is_the_rule(const ScoreRules& R, Rng rng, int row0, int n0, const std::string& what) {
  std::vector<uint32_t> out(size_t(kLanes) * (kNTiles / 2) * 4);
  simt::run_block(kLanes, 32, {}, {1, 1, 1}, 0, [&] {
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
    uint32_t keep[2];
    flashport::gpu::fwd_keep_bits<kNTiles>(keep, R, kB, kHq, kH, row0 + 16 * warp + lane / 4 + 8 * (lane & 1), n0);
    uint32_t pa[kNTiles / 2][4];
    for (int ks = 0; ks < kNTiles / 2; ++ks)
      for (int r = 0; r < 4; ++r) pa[ks][r] = 0x8001u * uint32_t(1 + 8 * ks + 2 * r) | 0x00010000u * uint32_t(3 + 8 * ks + 2 * r);
    flashport::gpu::fwd_drop_packed<kNTiles>(keep, pa);
    for (int ks = 0; ks < kNTiles / 2; ++ks)
      for (int r = 0; r < 4; ++r) out[(size_t(tid) * (kNTiles / 2) + ks) * 4 + r] = pa[ks][r];
  });
  int64_t bad = 0, dropped = 0;
  for (int tid = 0; tid < kLanes; ++tid)
    for (int ks = 0; ks < kNTiles / 2; ++ks)
      for (int r = 0; r < 4; ++r) {
        const uint32_t orig = 0x8001u * uint32_t(1 + 8 * ks + 2 * r) | 0x00010000u * uint32_t(3 + 8 * ks + 2 * r);
        const uint32_t got = out[(size_t(tid) * (kNTiles / 2) + ks) * 4 + r];
        const int t = 2 * ks + (r >> 1), hf = r & 1;
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = row0 + 16 * (tid / 32) + (tid % 32) / 4 + 8 * hf, j = n0 + 8 * t + 2 * (tid % 4) + e2;
          const bool kept = dropout_keep(rng.seed, rng.offset, R.dropout_threshold, kB, kHq, kH, i, j);
          dropped += !kept;
          const uint32_t half = (got >> (16 * e2)) & 0xFFFFu, want = kept ? (orig >> (16 * e2)) & 0xFFFFu : 0u;
          bad += half != want;
        }
      }
  EXPECT_EQ(bad, 0) << what;
  EXPECT_GT(dropped, 0) << what;
}

TEST(DropoutLanes, ForwardDropPackedZeroesDroppedHalves) {
  for_each_rule([](const ScoreRules& R, const Rng& rng, const std::string& what) {
    expect_drop_packed_is_the_rule<16>(R, rng, 40, 320, what);
    expect_drop_packed_is_the_rule<12>(R, rng, 64, 96 * 7, what);
    expect_drop_packed_is_the_rule<8>(R, rng, 333, 64 * 5, what);
  });
}

}  // namespace
