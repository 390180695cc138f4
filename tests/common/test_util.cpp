#include "test_util.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace flashport::test {

namespace {

constexpr uint8_t kGuardByte = 0xA5;  // guards before/after the storage
constexpr uint8_t kGapByte = 0xCD;    // stride gaps between elements

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t poison_bits(fp_dtype t) {
  switch (t) {
    case FP_F16: return 0x7E5Au;           // quiet NaN with a payload
    case FP_BF16: return 0x7FDAu;          // quiet NaN with a payload
    case FP_F32: return 0x7FC0DEADu;
    case FP_F64: return 0x7FF8DEADBEEFDEADull;
    case FP_I32: return 0x7FC0DEADu;
  }
  return 0;
}

std::string shape_str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace

// ---- Seeds -------------------------------------------------------------------------------------

uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FLASHPORT_TEST_SEED"); env && *env)
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 0));
    return mix64(static_cast<uint64_t>(
        std::chrono::high_resolution_clock::now().time_since_epoch().count()));
  }();
  return seed;
}

uint64_t test_seed() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return mix64(base_seed() ^ fnv1a(name));
}

std::mt19937_64& test_rng() {
  static thread_local std::mt19937_64 rng(test_seed());
  return rng;
}

// ---- HostTensor --------------------------------------------------------------------------------

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    st[i] = st[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  return st;
}

HostTensor::HostTensor(fp_dtype dtype, std::vector<int64_t> shape)
    : HostTensor(dtype, shape, contiguous_strides(shape)) {}

HostTensor::HostTensor(fp_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> strides)
    : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
  if (shape_.size() != strides_.size() || shape_.size() > FP_MAX_DIMS)
    throw std::invalid_argument("HostTensor: shape/strides rank mismatch or rank > FP_MAX_DIMS");
  for (size_t i = 0; i < shape_.size(); ++i)
    if (shape_[i] < 0 || strides_[i] < 0)
      throw std::invalid_argument("HostTensor: negative size or stride");
  allocate();
}

HostTensor HostTensor::permuted(fp_dtype dtype, std::vector<int64_t> shape,
                                std::vector<int> order) {
  if (order.size() != shape.size()) throw std::invalid_argument("HostTensor::permuted: rank");
  std::vector<int64_t> st(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
    st[order[i]] = s;
    s *= std::max<int64_t>(shape[order[i]], 1);
  }
  return HostTensor(dtype, std::move(shape), std::move(st));
}

HostTensor HostTensor::padded(fp_dtype dtype, std::vector<int64_t> shape,
                              std::vector<int64_t> pad) {
  if (pad.size() != shape.size()) throw std::invalid_argument("HostTensor::padded: rank");
  std::vector<int64_t> st(shape.size(), 1);
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1) + pad[i];
  }
  return HostTensor(dtype, std::move(shape), std::move(st));
}

HostTensor HostTensor::i32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
  HostTensor t(FP_I32, std::move(shape));
  t.fill_i32(values);
  return t;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

void HostTensor::allocate() {
  const size_t es = dtype_size(dtype_);
  int64_t extent = 0;  // one past the last element, in elements
  if (numel() > 0) {
    extent = 1;
    for (size_t i = 0; i < shape_.size(); ++i) extent += (shape_[i] - 1) * strides_[i];
  }
  storage_bytes_ = static_cast<size_t>(extent) * es;
  buf_.assign(storage_bytes_ + 2 * kGuard, kGuardByte);
  std::fill(buf_.begin() + kGuard, buf_.begin() + kGuard + storage_bytes_, kGapByte);
  auto covered = std::make_shared<std::vector<bool>>(storage_bytes_, false);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t off = offset_of_linear(i);
    for (size_t b = 0; b < es; ++b) (*covered)[off * es + b] = true;
  }
  covered_ = covered;
  if (n > 0) fill_value(0.0);
}

fp_tensor HostTensor::view() const {
  return view_at(const_cast<void*>(storage()), FP_DEVICE_CPU, 0);
}

fp_tensor HostTensor::view_at(void* data, fp_device_type dev, int32_t device_index) const {
  fp_tensor t;
  std::memset(&t, 0, sizeof(t));
  t.data = data;
  t.dtype = dtype_;
  t.ndim = ndim();
  for (int i = 0; i < ndim(); ++i) {
    t.shape[i] = shape_[i];
    t.stride[i] = strides_[i];
  }
  t.device_type = dev;
  t.device_index = device_index;
  return t;
}

int64_t HostTensor::offset(std::initializer_list<int64_t> idx) const {
  if (static_cast<int>(idx.size()) != ndim()) throw std::invalid_argument("HostTensor: index rank");
  int64_t off = 0;
  int i = 0;
  for (int64_t x : idx) {
    if (x < 0 || x >= shape_[i]) throw std::out_of_range("HostTensor: index out of range");
    off += x * strides_[i++];
  }
  return off;
}

int64_t HostTensor::offset_of_linear(int64_t linear) const {
  int64_t off = 0;
  for (int i = ndim() - 1; i >= 0; --i) {
    off += (linear % shape_[i]) * strides_[i];
    linear /= shape_[i];
  }
  return off;
}

uint8_t* HostTensor::elem_ptr(int64_t off) {
  return buf_.data() + kGuard + off * dtype_size(dtype_);
}
const uint8_t* HostTensor::elem_ptr(int64_t off) const {
  return buf_.data() + kGuard + off * dtype_size(dtype_);
}

double HostTensor::get(std::initializer_list<int64_t> idx) const {
  return load_as_double(storage(), dtype_, offset(idx));
}
void HostTensor::set(std::initializer_list<int64_t> idx, double v) {
  store_from_double(storage(), dtype_, offset(idx), v);
}
double HostTensor::at_linear(int64_t linear) const {
  return load_as_double(storage(), dtype_, offset_of_linear(linear));
}
void HostTensor::set_linear(int64_t linear, double v) {
  store_from_double(storage(), dtype_, offset_of_linear(linear), v);
}

void HostTensor::fill_normal(std::mt19937_64& rng, double mean, double stddev) {
  std::normal_distribution<double> dist(mean, stddev);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) set_linear(i, dist(rng));
}

void HostTensor::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) set_linear(i, dist(rng));
}

void HostTensor::fill_value(double v) {
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) set_linear(i, v);
}

void HostTensor::fill_i32(const std::vector<int32_t>& values) {
  if (dtype_ != FP_I32) throw std::invalid_argument("HostTensor::fill_i32: not int32");
  if (static_cast<int64_t>(values.size()) != numel())
    throw std::invalid_argument("HostTensor::fill_i32: count mismatch");
  for (int64_t i = 0; i < numel(); ++i)
    std::memcpy(elem_ptr(offset_of_linear(i)), &values[i], 4);
}

void HostTensor::fill_poison() {
  const uint64_t bits = poison_bits(dtype_);
  const size_t es = dtype_size(dtype_);
  for (int64_t i = 0; i < numel(); ++i)
    std::memcpy(elem_ptr(offset_of_linear(i)), &bits, es);  // little endian: low bytes
}

bool HostTensor::is_poison_at(int64_t off) const {
  uint64_t bits = 0;
  std::memcpy(&bits, elem_ptr(off), dtype_size(dtype_));
  return bits == poison_bits(dtype_);
}

std::vector<double> HostTensor::to_double() const {
  std::vector<double> out(numel());
  for (int64_t i = 0; i < numel(); ++i) out[i] = at_linear(i);
  return out;
}

void HostTensor::from_double(const std::vector<double>& values) {
  if (static_cast<int64_t>(values.size()) != numel())
    throw std::invalid_argument("HostTensor::from_double: count mismatch");
  for (int64_t i = 0; i < numel(); ++i) set_linear(i, values[i]);
}

std::vector<int32_t> HostTensor::to_i32() const {
  if (dtype_ != FP_I32) throw std::invalid_argument("HostTensor::to_i32: not int32");
  std::vector<int32_t> out(numel());
  for (int64_t i = 0; i < numel(); ++i) std::memcpy(&out[i], elem_ptr(offset_of_linear(i)), 4);
  return out;
}

::testing::AssertionResult HostTensor::guards_intact() const {
  for (size_t i = 0; i < kGuard; ++i) {
    if (buf_[i] != kGuardByte)
      return ::testing::AssertionFailure() << "guard byte " << (kGuard - i)
                                           << " before the storage was overwritten";
    if (buf_[kGuard + storage_bytes_ + i] != kGuardByte)
      return ::testing::AssertionFailure() << "guard byte " << i
                                           << " after the storage was overwritten (storage "
                                           << storage_bytes_ << " bytes, shape "
                                           << shape_str(shape_) << ")";
  }
  for (size_t i = 0; i < storage_bytes_; ++i)
    if (!(*covered_)[i] && buf_[kGuard + i] != kGapByte)
      return ::testing::AssertionFailure() << "stride gap byte at storage offset " << i
                                           << " was overwritten (shape " << shape_str(shape_)
                                           << ", strides " << shape_str(strides_) << ")";
  return ::testing::AssertionSuccess();
}

int64_t HostTensor::poisoned_count() const {
  int64_t n = 0;
  for (int64_t i = 0; i < numel(); ++i) n += is_poison_at(offset_of_linear(i)) ? 1 : 0;
  return n;
}

::testing::AssertionResult HostTensor::all_written() const {
  int64_t n = 0, first = -1;
  for (int64_t i = 0; i < numel(); ++i)
    if (is_poison_at(offset_of_linear(i))) {
      if (first < 0) first = i;
      ++n;
    }
  if (n == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << n << " of " << numel()
                                       << " elements were never written (first at logical index "
                                       << first << ", shape " << shape_str(shape_) << ")";
}

bool HostTensor::bitwise_equal(const HostTensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  const size_t es = dtype_size(dtype_);
  for (int64_t i = 0; i < numel(); ++i)
    if (std::memcmp(elem_ptr(offset_of_linear(i)), other.elem_ptr(other.offset_of_linear(i)), es))
      return false;
  return true;
}

// ---- Comparison --------------------------------------------------------------------------------

Comparison compare(const std::vector<double>& a, const std::vector<double>& b) {
  Comparison c;
  c.count_actual = static_cast<int64_t>(a.size());
  c.count_expected = static_cast<int64_t>(b.size());
  const size_t n = std::min(a.size(), b.size());
  long double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    if (std::isnan(x)) ++c.nan_actual;
    if (std::isinf(x)) ++c.inf_actual;
    if (std::isnan(y)) ++c.nan_expected;
    if (std::isinf(y)) ++c.inf_expected;
    if (!std::isfinite(x) || !std::isfinite(y)) {
      if (!(std::isinf(x) && x == y)) ++c.nonfinite_mismatch;
      continue;
    }
    const double d = std::fabs(x - y);
    diff2 += static_cast<long double>(d) * d;
    ref2 += static_cast<long double>(y) * y;
    if (c.worst_index < 0 || d > c.max_abs_err) {
      c.max_abs_err = d;
      c.worst_index = static_cast<int64_t>(i);
    }
  }
  c.rel_err = ref2 > 0 ? static_cast<double>(std::sqrt(diff2 / ref2))
                       : static_cast<double>(std::sqrt(diff2));
  return c;
}

Comparison compare(const HostTensor& actual, const HostTensor& expected) {
  return compare(actual.to_double(), expected.to_double());
}

std::string Comparison::describe() const {
  std::ostringstream os;
  os << "rel_err " << rel_err << ", max_abs_err " << max_abs_err << " (at " << worst_index
     << "), elements " << count_actual << " vs " << count_expected << ", NaN " << nan_actual
     << "/" << nan_expected << ", inf " << inf_actual << "/" << inf_expected
     << ", non-finite mismatches " << nonfinite_mismatch;
  return os.str();
}

::testing::AssertionResult close(const std::vector<double>& actual,
                                 const std::vector<double>& expected, double rel_tol,
                                 const std::string& what) {
  const Comparison c = compare(actual, expected);
  const bool ok = c.count_actual == c.count_expected && c.nan_actual == 0 &&
                  c.nonfinite_mismatch == 0 && c.rel_err <= rel_tol;
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << c.describe() << "; tolerance "
                                       << rel_tol << " (seed " << base_seed() << ")";
}

::testing::AssertionResult close(const HostTensor& actual, const HostTensor& expected,
                                 double rel_tol, const std::string& what) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << what << ": shape " << shape_str(actual.shape())
                                         << " vs expected " << shape_str(expected.shape());
  return close(actual.to_double(), expected.to_double(), rel_tol, what);
}

// ---- Tolerances --------------------------------------------------------------------------------

double tolerance(fp_dtype dtype) {
  switch (dtype) {
    case FP_F64: return 1e-12;
    case FP_F32: return 5e-5;
    case FP_F16: return 3e-3;
    case FP_BF16: return 2e-2;
    case FP_I32: return 0.0;
  }
  return 0.0;
}

double grad_tolerance(fp_dtype dtype) {
  switch (dtype) {
    case FP_F64: return 1e-10;
    case FP_F32: return 2e-4;
    case FP_F16: return 1e-2;
    case FP_BF16: return 5e-2;
    case FP_I32: return 0.0;
  }
  return 0.0;
}

double tolerance_vs_naive(fp_dtype dtype, double naive_rel_err) {
  return std::max(tolerance(dtype), 4.0 * naive_rel_err);
}

}  // namespace flashport::test
