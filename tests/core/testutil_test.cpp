// The shared test utilities must catch what they claim to catch.
#include <cmath>
#include <cstring>

#include "test_util.hpp"

namespace flashport::test {
namespace {

TEST(TestUtil, ContiguousViewAndAccess) {
  HostTensor t(FP_F32, {2, 3, 4});
  fp_tensor v = t.view();
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.stride[0], 12);
  EXPECT_EQ(v.stride[2], 1);
  EXPECT_EQ(v.device_type, FP_DEVICE_CPU);
  t.set({1, 2, 3}, 5.5);
  EXPECT_EQ(static_cast<float*>(v.data)[23], 5.5f);
  EXPECT_EQ(t.get({1, 2, 3}), 5.5);
}

TEST(TestUtil, PermutedAndPaddedStrides) {
  HostTensor p = HostTensor::permuted(FP_F16, {2, 5, 3, 8}, {0, 2, 1, 3});  // [B,H,S,D] memory
  EXPECT_EQ(p.strides(), (std::vector<int64_t>{120, 8, 40, 1}));
  HostTensor q = HostTensor::padded(FP_F32, {2, 3}, {0, 5});
  EXPECT_EQ(q.strides(), (std::vector<int64_t>{8, 1}));
  EXPECT_EQ(q.storage_bytes(), (8 + 3) * 4u);
}

TEST(TestUtil, FreshNormalValuesDifferPerTestAndAreNotZero) {
  HostTensor a(FP_F32, {64});
  a.fill_normal();
  double sum2 = 0;
  for (double x : a.to_double()) sum2 += x * x;
  EXPECT_GT(sum2, 10.0);  // 64 unit normals: ~64
  HostTensor b(FP_F32, {64});
  b.fill_normal();
  EXPECT_FALSE(a.bitwise_equal(b));
}

TEST(TestUtil, PoisonAndAllWritten) {
  for (fp_dtype dt : {FP_F16, FP_BF16, FP_F32, FP_F64, FP_I32}) {
    HostTensor t(dt, {3, 4});
    t.fill_poison();
    EXPECT_EQ(t.poisoned_count(), 12);
    if (dt != FP_I32) {
      EXPECT_TRUE(std::isnan(t.at_linear(0)));
    }
    EXPECT_FALSE(t.all_written());
    for (int64_t i = 0; i < 11; ++i) t.set_linear(i, 1.0);
    EXPECT_FALSE(t.all_written());
    t.set_linear(11, 0.0);
    EXPECT_TRUE(t.all_written());
  }
}

TEST(TestUtil, GuardsCatchWritesPastTheEndBeforeTheStartAndInGaps) {
  HostTensor t = HostTensor::padded(FP_F32, {2, 3}, {0, 1});
  t.fill_normal();
  EXPECT_TRUE(t.guards_intact());
  HostTensor copy = t;  // deep copy
  static_cast<float*>(t.storage())[3] = 1.0f;  // the gap after row 0
  EXPECT_FALSE(t.guards_intact());
  EXPECT_TRUE(copy.guards_intact());

  HostTensor a(FP_F16, {5});
  static_cast<uint16_t*>(a.storage())[5] = 0;  // one past the end
  EXPECT_FALSE(a.guards_intact());
  HostTensor b(FP_F64, {5});
  static_cast<double*>(b.storage())[-1] = 0;  // one before the start
  EXPECT_FALSE(b.guards_intact());
}

TEST(TestUtil, CompareReportsErrorsNaNAndInfMismatch) {
  std::vector<double> ref{1, 2, 3, -INFINITY};
  EXPECT_TRUE(close(ref, ref, 0.0));
  std::vector<double> a{1, 2, 3.001, -INFINITY};
  Comparison c = compare(a, ref);
  EXPECT_NEAR(c.rel_err, 0.001 / std::sqrt(14.0), 1e-12);
  EXPECT_NEAR(c.max_abs_err, 0.001, 1e-12);
  EXPECT_EQ(c.worst_index, 2);
  EXPECT_TRUE(close(a, ref, 1e-3));
  EXPECT_FALSE(close(a, ref, 1e-4));
  std::vector<double> nan{1, NAN, 3, -INFINITY};
  EXPECT_FALSE(close(nan, ref, 1.0));
  std::vector<double> noinf{1, 2, 3, -1e30};
  EXPECT_FALSE(close(noinf, ref, 1.0));
  std::vector<double> shorter{1, 2, 3};
  EXPECT_FALSE(close(shorter, ref, 1.0));
}

TEST(TestUtil, TolerancesOrderedByPrecision) {
  EXPECT_LT(tolerance(FP_F64), tolerance(FP_F32));
  EXPECT_LT(tolerance(FP_F32), tolerance(FP_F16));
  EXPECT_LT(tolerance(FP_F16), tolerance(FP_BF16));
  EXPECT_EQ(tolerance_vs_naive(FP_F32, 1e-3), 4e-3);
}

}  // namespace
}  // namespace flashport::test

namespace flashport::test {
namespace {

TEST(TestUtil, SeedsAreReproduciblePerTest) {
  const uint64_t s = test_seed();
  EXPECT_EQ(s, test_seed());  // stable within a test: FLASHPORT_TEST_SEED reproduces it
  std::mt19937_64 r1(s), r2(s);
  HostTensor a(FP_BF16, {33}), b(FP_BF16, {33});
  a.fill_normal(r1);
  b.fill_normal(r2);
  EXPECT_TRUE(a.bitwise_equal(b));
}

TEST(TestUtil, I32AndRoundTrip) {
  HostTensor t = HostTensor::i32({2, 2}, {1, -2, 3, 4});
  EXPECT_EQ(t.to_i32(), (std::vector<int32_t>{1, -2, 3, 4}));
  HostTensor f = HostTensor::permuted(FP_F64, {2, 3}, {1, 0});
  f.from_double({1, 2, 3, 4, 5, 6});
  EXPECT_EQ(f.get({1, 0}), 4.0);
  EXPECT_EQ(static_cast<const double*>(f.storage())[1], 4.0);  // column-major storage
  EXPECT_EQ(f.to_double(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

}  // namespace
}  // namespace flashport::test
