// Thin C++ conveniences over the C API (flashport.h): tensor makers, an exception type and
// param structs that initialise themselves. The C structs remain the one description of a call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "flashport/flashport.h"

namespace flashport {

// A failed call: the status and fp_last_error()'s message.
class Error : public std::runtime_error {
 public:
  Error(fp_status status, const std::string& message)
      : std::runtime_error(std::string(fp_status_name(status)) + ": " + message),
        status_(status) {}
  fp_status status() const noexcept { return status_; }

 private:
  fp_status status_;
};

// Throws Error unless s is FP_OK.
inline void check(fp_status s) {
  if (s != FP_OK) throw Error(s, fp_last_error());
}

struct Device {
  fp_device_type type = FP_DEVICE_CPU;
  int32_t index = 0;
  static Device cpu() { return {FP_DEVICE_CPU, 0}; }
  static Device cuda(int32_t i = 0) { return {FP_DEVICE_CUDA, i}; }
  static Device hip(int32_t i = 0) { return {FP_DEVICE_HIP, i}; }
};

// A view with explicit shape and strides (in elements).
inline fp_tensor make_tensor(void* data, fp_dtype dtype, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> strides, Device dev = Device::cpu()) {
  if (shape.size() != strides.size() || shape.size() == 0 || shape.size() > FP_MAX_DIMS)
    throw Error(FP_ERR_INVALID_ARGUMENT, "make_tensor: shape and strides need 1..FP_MAX_DIMS "
                                         "entries of equal count");
  fp_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  i = 0;
  for (int64_t s : strides) t.stride[i++] = s;
  t.device_type = dev.type;
  t.device_index = dev.index;
  return t;
}

// A view with contiguous (row-major) strides.
inline fp_tensor make_tensor(void* data, fp_dtype dtype, std::initializer_list<int64_t> shape,
                             Device dev = Device::cpu()) {
  if (shape.size() == 0 || shape.size() > FP_MAX_DIMS)
    throw Error(FP_ERR_INVALID_ARGUMENT, "make_tensor: shape needs 1..FP_MAX_DIMS entries");
  fp_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d] > 0 ? t.shape[d] : 1;
  }
  t.device_type = dev.type;
  t.device_index = dev.index;
  return t;
}

// The C param structs, initialised by their fp_*_init function on construction.
struct AttnParams : fp_attn_params {
  AttnParams() { fp_attn_params_init(this); }
};
struct AttnBwdParams : fp_attn_bwd_params {
  AttnBwdParams() { fp_attn_bwd_params_init(this); }
};
struct MergeParams : fp_merge_params {
  MergeParams() { fp_merge_params_init(this); }
};
struct MergeBwdParams : fp_merge_bwd_params {
  MergeBwdParams() { fp_merge_bwd_params_init(this); }
};

// Throwing wrappers.
inline fp_selection select(const fp_attn_params& p) {
  fp_selection s{};
  check(fp_attn_fwd_select(&p, &s));
  return s;
}
inline fp_selection select(const fp_attn_bwd_params& p) {
  fp_selection s{};
  check(fp_attn_bwd_select(&p, &s));
  return s;
}
inline size_t workspace_bytes(const fp_attn_params& p) {
  size_t n = 0;
  check(fp_attn_fwd_workspace(&p, &n));
  return n;
}
inline size_t workspace_bytes(const fp_attn_bwd_params& p) {
  size_t n = 0;
  check(fp_attn_bwd_workspace(&p, &n));
  return n;
}
inline bool backend_available(fp_backend b) { return fp_backend_available(b) != 0; }
inline void attn_fwd(const fp_attn_params& p) { check(fp_attn_fwd(&p)); }
inline void attn_probs(const fp_attn_params& p, const fp_tensor& probs) { check(fp_attn_probs(&p, probs)); }
inline void attn_bwd(const fp_attn_bwd_params& p) { check(fp_attn_bwd(&p)); }
inline void merge_fwd(const fp_merge_params& p) { check(fp_merge_fwd(&p)); }
inline void merge_bwd(const fp_merge_bwd_params& p) { check(fp_merge_bwd(&p)); }

}  // namespace flashport
