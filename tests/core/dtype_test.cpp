// fp16 / bf16 conversions of src/core/dtype.hpp: exhaustive round trips and rounding rules.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

#include "core/dtype.hpp"

namespace flashport {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Dtype, HalfToFloatToHalfIsIdentityForAll65536Values) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    const bool is_nan = ((h >> 10) & 0x1F) == 0x1F && (h & 0x3FF) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(std::isnan(half_to_float(float_to_half(f)))) << std::hex << h;
    } else {
      ASSERT_EQ(float_to_half(f), h) << std::hex << h;
    }
  }
}

TEST(Dtype, HalfToFloatKnownValues) {
  EXPECT_EQ(half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(half_to_float(0xC000), -2.0f);
  EXPECT_EQ(half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(half_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(half_to_float(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(half_to_float(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits_of(half_to_float(0x8000)), 0x80000000u);  // -0
}

// Against an independent rule: the nearest half by exhaustive search over finite halves,
// ties to the even mantissa, beyond 65520 to inf.
uint16_t nearest_half_slow(float f) {
  const double x = f;
  if (std::fabs(x) >= 65520.0) return x > 0 ? 0x7C00 : 0xFC00;
  uint16_t best = 0;
  double best_d = INFINITY;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  for (uint32_t m = 0; m < 0x7C00; ++m) {
    const double d = std::fabs(std::fabs(x) - static_cast<double>(half_to_float(static_cast<uint16_t>(m))));
    if (d < best_d || (d == best_d && (m & 1) == 0)) {
      best_d = d;
      best = static_cast<uint16_t>(m);
    }
  }
  return sign | best;
}

TEST(Dtype, FloatToHalfRoundsToNearestEven) {
  // Ties between consecutive halves (the midpoint is exact in float) go to the even one.
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);       // 1 + half ulp -> 1
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);   // -> even above
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_half(-1e10f), 0xFC00);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);           // tie to even (zero)
  EXPECT_EQ(float_to_half(std::ldexp(3.0f, -25)), 0x0002);           // 1.5 ulp -> 2
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(float_to_half(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(NAN))));
  // Random floats across the half range against the slow rule.
  uint64_t s = 0x1234567u;
  for (int n = 0; n < 300; ++n) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float f = std::ldexp(static_cast<float>((s >> 40) & 0xFFFFFF) / 16777216.0f + 0.5f,
                               static_cast<int>((s >> 20) % 44) - 27) *
                    ((s >> 63) ? -1.0f : 1.0f);
    ASSERT_EQ(float_to_half(f), nearest_half_slow(f)) << f;
  }
}

TEST(Dtype, Bf16RoundTripAndRounding) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
    } else {
      ASSERT_EQ(float_to_bf16(f), h) << std::hex << h;
    }
  }
  EXPECT_EQ(float_to_bf16(float_of(0x3F808000u)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(float_to_bf16(float_of(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16(float_of(0x3F808001u)), 0x3F81);  // above tie -> up
  EXPECT_EQ(float_to_bf16(float_of(0x7F7FFFFFu)), 0x7F80);  // max float rounds to inf
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(float_of(0x7F800001u)))));  // sNaN stays NaN
}

TEST(Dtype, LoadStoreAllTypes) {
  unsigned char buf[64];
  for (fp_dtype t : {FP_F16, FP_BF16, FP_F32, FP_F64, FP_I32}) {
    store_from_double(buf, t, 3, -2.0);
    EXPECT_EQ(load_as_double(buf, t, 3), -2.0) << dtype_name(t);
  }
  EXPECT_EQ(dtype_size(FP_BF16), 2u);
  EXPECT_EQ(dtype_size(FP_F64), 8u);
}

}  // namespace
}  // namespace flashport
