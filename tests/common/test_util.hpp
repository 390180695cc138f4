// Shared test utilities: an owning host tensor with guard bytes, seeded random fills, poison
// fills, comparisons and per-dtype tolerances. Every backend's tests use these, so "correct"
// means the same thing everywhere.
#pragma once
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "flashport/flashport.h"

namespace flashport::test {

// ---- Seeds -------------------------------------------------------------------------------------
// The base seed of this run: FLASHPORT_TEST_SEED if set, else fresh (time based). Printed by main.
uint64_t base_seed();
// Seed of the running test: base_seed() mixed with the test's full name, so every test draws
// different values and a failure is reproduced with FLASHPORT_TEST_SEED=<base> --gtest_filter=...
uint64_t test_seed();
// Generator re-seeded with test_seed() at the start of every test.
std::mt19937_64& test_rng();

// 64-byte aligned allocation, so storage() suits any SIMD load and copies stay aligned.
template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
};

// ---- HostTensor --------------------------------------------------------------------------------
// An owning CPU tensor of any fp_dtype with contiguous or custom strides. The storage is framed by
// guard bytes (before and after) and every byte not covered by an element (stride gaps) keeps a
// known pattern; guards_intact() detects any write outside the elements.
class HostTensor {
 public:
  HostTensor() = default;
  // Contiguous (row-major) strides.
  HostTensor(fp_dtype dtype, std::vector<int64_t> shape);
  // Custom element strides (any order, gaps allowed; negative strides not supported).
  HostTensor(fp_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> strides);
  // Contiguous in `order` (a permutation: order[0] is the outermost dim in memory), e.g.
  // permuted(FP_F32, {B,S,H,D}, {0,2,1,3}) gives a [B,S,H,D] view of [B,H,S,D] memory.
  static HostTensor permuted(fp_dtype dtype, std::vector<int64_t> shape,
                             std::vector<int> order);
  // Contiguous strides with the given dims padded (extra elements between rows), e.g.
  // padded(FP_F16, {B,S,H,D}, {0,0,0,8}) leaves 8 unused elements after each row of D.
  static HostTensor padded(fp_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> pad);
  static HostTensor i32(std::vector<int64_t> shape, const std::vector<int32_t>& values);

  bool empty() const { return buf_.empty(); }
  fp_dtype dtype() const { return dtype_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t dim(int i) const { return shape_.at(i); }
  int64_t numel() const;
  // Storage (including stride gaps), e.g. to copy to a device.
  void* storage() { return buf_.empty() ? nullptr : buf_.data() + kGuard; }
  const void* storage() const { return buf_.empty() ? nullptr : buf_.data() + kGuard; }
  size_t storage_bytes() const { return storage_bytes_; }

  // The fp_tensor view of this (CPU) tensor; view_at() of the same shape and strides elsewhere.
  fp_tensor view() const;
  fp_tensor view_at(void* data, fp_device_type dev, int32_t device_index = 0) const;

  // Element access by multi-index or by logical (row-major) linear index.
  int64_t offset(std::initializer_list<int64_t> idx) const;
  int64_t offset_of_linear(int64_t linear) const;
  double get(std::initializer_list<int64_t> idx) const;
  void set(std::initializer_list<int64_t> idx, double v);
  double at_linear(int64_t linear) const;
  void set_linear(int64_t linear, double v);

  // Fills (elements only; guards and gaps keep their patterns).
  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0);
  void fill_normal(double mean = 0.0, double stddev = 1.0) { fill_normal(test_rng(), mean, stddev); }
  void fill_uniform(std::mt19937_64& rng, double lo, double hi);
  void fill_uniform(double lo, double hi) { fill_uniform(test_rng(), lo, hi); }
  void fill_value(double v);
  void fill_i32(const std::vector<int32_t>& values);  // logical order
  // A NaN bit pattern (for int32: 0x7FC0DEAD) in every element: outputs start poisoned.
  void fill_poison();

  // Values in logical order, as double.
  std::vector<double> to_double() const;
  void from_double(const std::vector<double>& values);
  std::vector<int32_t> to_i32() const;

  // No byte before/after the storage or in a stride gap was changed.
  ::testing::AssertionResult guards_intact() const;
  // No element still holds the poison pattern (every element was written).
  ::testing::AssertionResult all_written() const;
  // Number of elements still holding the poison pattern.
  int64_t poisoned_count() const;
  // Bitwise equality of all elements with another tensor of the same dtype and shape.
  bool bitwise_equal(const HostTensor& other) const;

  static constexpr size_t kGuard = 64;  // guard bytes on each side

 private:
  void allocate();
  bool is_poison_at(int64_t off) const;
  uint8_t* elem_ptr(int64_t off);
  const uint8_t* elem_ptr(int64_t off) const;

  fp_dtype dtype_ = FP_F32;
  std::vector<int64_t> shape_, strides_;
  size_t storage_bytes_ = 0;
  std::vector<uint8_t, AlignedAllocator<uint8_t>> buf_;  // guard | storage | guard; copies are deep
  std::shared_ptr<const std::vector<bool>> covered_;     // bytes that belong to some element
};

// Contiguous row-major strides of a shape.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

// ---- Comparison --------------------------------------------------------------------------------
struct Comparison {
  int64_t count_actual = 0, count_expected = 0;
  double rel_err = 0.0;       // ||a - b|| / ||b|| over finite pairs (absolute if ||b|| == 0)
  double max_abs_err = 0.0;   // over finite pairs
  int64_t worst_index = -1;   // logical index of the max abs error
  int64_t nan_actual = 0, inf_actual = 0;
  int64_t nan_expected = 0, inf_expected = 0;
  int64_t nonfinite_mismatch = 0;  // positions where a and b are not both the same inf
  std::string describe() const;
};

Comparison compare(const std::vector<double>& actual, const std::vector<double>& expected);
Comparison compare(const HostTensor& actual, const HostTensor& expected);

// Passes iff counts match, no NaN in actual, infinities match exactly in place and sign, and
// rel_err <= rel_tol. `what` names the tensor in the failure message.
::testing::AssertionResult close(const HostTensor& actual, const HostTensor& expected,
                                 double rel_tol, const std::string& what = "tensor");
::testing::AssertionResult close(const std::vector<double>& actual,
                                 const std::vector<double>& expected, double rel_tol,
                                 const std::string& what = "tensor");

// An fp64 copy of a tensor (empty stays empty): the reference's inputs.
inline HostTensor to_f64(const HostTensor& t) {
  if (t.empty()) return {};
  HostTensor r(FP_F64, t.shape());
  r.from_double(t.to_double());
  return r;
}

// cu_seqlens of per-sequence lengths: {0, l0, l0 + l1, ...}.
inline std::vector<int32_t> cumsum(const std::vector<int64_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + static_cast<int32_t>(lens[i]);
  return cu;
}

// ---- Tolerances --------------------------------------------------------------------------------
// Relative error (||a-b||/||b|| against the fp64 reference) allowed for a backend computing in
// `dtype`. The values are a small multiple of what a naive same-precision attention (the input
// rounded to dtype, fp32 accumulation for 16-bit types, output rounded to dtype) achieves on unit
// normal inputs: fp64 ~1e-15 -> 1e-12; fp32 ~1e-7 -> 5e-5; fp16 output rounding ~3e-4 -> 3e-3;
// bf16 output rounding ~2.5e-3 -> 2e-2. Gradients accumulate more; use grad_tolerance().
double tolerance(fp_dtype dtype);
double grad_tolerance(fp_dtype dtype);
// When a test measures the naive same-precision error itself: max(tolerance(dtype), 4 * naive).
double tolerance_vs_naive(fp_dtype dtype, double naive_rel_err);

}  // namespace flashport::test
