// Philox4x32-10 against Random123's published known answers (kat_vectors), and the dropout rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "core/philox.hpp"

namespace flashport {
namespace {

struct Kat {
  uint32_t ctr[4];
  uint32_t key[2];
  uint32_t want[4];
};

// Random123 tests/kat_vectors, the "philox4x32 10" lines: counter, key, expected output.
const Kat kKats[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

TEST(Philox, Random123KnownAnswers) {
  for (const Kat& k : kKats) {
    Philox4 c{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}};
    const Philox4 r = philox4x32_10(c, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.x[i], k.want[i]) << "word " << i << " of ctr " << std::hex << k.ctr[0];
  }
}

TEST(Philox, DropoutWordsUseTheDocumentedCounter) {
  // counter = { j/16, i, lo32(offset + b*Hq + h), hi32(...) }, key = seed (lo, hi); key j's
  // byte: byte j % 4 of word (j / 4) % 4.
  const uint64_t seed = 0x299f31d0a4093822ull, offset = 0xFFFFFFF0ull;
  const int64_t b = 3, hq = 8, h = 5, i = 77;
  const uint64_t stream = offset + b * hq + h;  // crosses 2^32: exercises the high word
  Philox4 c{{9u, 77u, static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  const Philox4 want = philox4x32_10(c, 0xa4093822u, 0x299f31d0u);
  const uint32_t t = dropout_threshold(0.5f);
  for (int64_t k = 0; k < 16; ++k) {
    const int64_t j = 16 * 9 + k;
    const Philox4 got = dropout_words(seed, offset, b, hq, h, i, j);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(got.x[w], want.x[w]);
    const uint32_t byte = (want.x[k / 4] >> (8 * (k % 4))) & 0xFFu;
    EXPECT_EQ(dropout_byte(got, j), byte) << "key " << k;
    EXPECT_EQ(dropout_keep(seed, offset, t, b, hq, h, i, j), byte >= t) << "key " << k;
  }
}

TEST(Philox, DropoutThresholdEdges) {
  EXPECT_EQ(dropout_threshold(0.0f), 0u);
  EXPECT_EQ(dropout_threshold(0.5f), 128u);
  EXPECT_EQ(dropout_threshold(0.25f), 64u);
  EXPECT_EQ(dropout_threshold(0.1f), 26u);                 // round(25.6)
  EXPECT_EQ(dropout_threshold(std::ldexp(1.0f, -20)), 1u);  // p > 0 always drops something
  EXPECT_EQ(dropout_threshold(std::nextafter(1.0f, 0.0f)), 255u);
  EXPECT_EQ(dropout_threshold(1.0f), 255u);  // saturates (p = 1 is rejected by validation)
  EXPECT_FLOAT_EQ(dropout_keep_scale(64u), 256.0f / 192.0f);
  // p = 0 keeps everything.
  for (int64_t j = 0; j < 64; ++j) EXPECT_TRUE(dropout_keep(1, 2, dropout_threshold(0.0f), 0, 1, 0, 0, j));
}

TEST(Philox, KeepRateMatchesP) {
  const float p = 0.3f;
  const uint32_t t = dropout_threshold(p);
  int64_t kept = 0, total = 0;
  for (int64_t i = 0; i < 64; ++i)
    for (int64_t j = 0; j < 256; ++j, ++total) kept += dropout_keep(42, 0, t, 1, 4, 2, i, j) ? 1 : 0;
  const double rate = double(kept) / double(total);
  EXPECT_NEAR(rate, (256.0 - t) / 256.0, 0.015);  // 16384 draws: sigma ~0.0036
}

}  // namespace
}  // namespace flashport
