// The C API boundary: init functions, the thread-local last error, and exception containment
// (nothing thrown inside flashport escapes a C function).
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <string>

#include "dispatch.hpp"
#include "flashport/flashport.h"

#ifndef FLASHPORT_VERSION_STRING
#define FLASHPORT_VERSION_STRING "0.1.0"
#endif

namespace {

thread_local std::string g_last_error;

fp_status finish(const flashport::Status& st) {
  g_last_error = st.is_ok() ? std::string() : st.message();
  return st.code();
}

// Runs `body` and maps every exception to FP_ERR_RUNTIME with its message.
template <class F>
fp_status guarded(const char* fn, F&& body) {
  try {
    return finish(body());
  } catch (const std::bad_alloc&) {
    g_last_error = std::string(fn) + ": out of host memory";
  } catch (const std::exception& e) {
    g_last_error = std::string(fn) + ": " + e.what();
  } catch (...) {
    g_last_error = std::string(fn) + ": unknown exception";
  }
  return FP_ERR_RUNTIME;
}

fp_status null_arg(const char* name) {
  g_last_error = std::string(name) + ": must not be NULL";
  return FP_ERR_INVALID_ARGUMENT;
}

}  // namespace

fp_status flashport::call_at_c_boundary(const char* fn, const std::function<Status()>& body) {
  return guarded(fn, body);
}

extern "C" {

void fp_attn_params_init(fp_attn_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));  // all tensors absent (ndim 0, data NULL), scalars 0
  p->softmax_scale = std::numeric_limits<float>::quiet_NaN();
  p->window_left = -1;
  p->window_right = -1;
  p->causal_align = FP_CAUSAL_BOTTOM_RIGHT;
  p->backend = FP_BACKEND_AUTO;
}

void fp_attn_bwd_params_init(fp_attn_bwd_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));
  fp_attn_params_init(&p->fwd);
}

void fp_merge_params_init(fp_merge_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));
  p->backend = FP_BACKEND_AUTO;
}

void fp_merge_bwd_params_init(fp_merge_bwd_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));
  fp_merge_params_init(&p->fwd);
}

fp_status fp_attn_fwd_select(const fp_attn_params* p, fp_selection* sel) {
  if (!p) return null_arg("params");
  if (!sel) return null_arg("selection");
  return guarded("fp_attn_fwd_select", [&] { return flashport::attn_fwd_select_op(*p, sel); });
}

fp_status fp_attn_bwd_select(const fp_attn_bwd_params* p, fp_selection* sel) {
  if (!p) return null_arg("params");
  if (!sel) return null_arg("selection");
  return guarded("fp_attn_bwd_select", [&] { return flashport::attn_bwd_select_op(*p, sel); });
}

fp_status fp_attn_fwd_workspace(const fp_attn_params* p, size_t* bytes) {
  if (!p) return null_arg("params");
  if (!bytes) return null_arg("bytes");
  fp_selection sel;
  const fp_status st = fp_attn_fwd_select(p, &sel);
  if (st == FP_OK) *bytes = sel.workspace_bytes;
  return st;
}

fp_status fp_attn_bwd_workspace(const fp_attn_bwd_params* p, size_t* bytes) {
  if (!p) return null_arg("params");
  if (!bytes) return null_arg("bytes");
  fp_selection sel;
  const fp_status st = fp_attn_bwd_select(p, &sel);
  if (st == FP_OK) *bytes = sel.workspace_bytes;
  return st;
}

fp_status fp_attn_fwd(const fp_attn_params* p) {
  if (!p) return null_arg("params");
  return guarded("fp_attn_fwd", [&] { return flashport::attn_fwd_op(*p); });
}

fp_status fp_attn_probs(const fp_attn_params* p, fp_tensor probs) {
  if (!p) return null_arg("params");
  return guarded("fp_attn_probs", [&] { return flashport::attn_probs_op(*p, probs); });
}

fp_status fp_attn_bwd(const fp_attn_bwd_params* p) {
  if (!p) return null_arg("params");
  return guarded("fp_attn_bwd", [&] { return flashport::attn_bwd_op(*p); });
}

fp_status fp_merge_fwd(const fp_merge_params* p) {
  if (!p) return null_arg("params");
  return guarded("fp_merge_fwd", [&] { return flashport::merge_fwd_op(*p); });
}

fp_status fp_merge_bwd(const fp_merge_bwd_params* p) {
  if (!p) return null_arg("params");
  return guarded("fp_merge_bwd", [&] { return flashport::merge_bwd_op(*p); });
}

const char* fp_last_error(void) { return g_last_error.c_str(); }

const char* fp_status_name(fp_status s) {
  switch (s) {
    case FP_OK: return "FP_OK";
    case FP_ERR_INVALID_ARGUMENT: return "FP_ERR_INVALID_ARGUMENT";
    case FP_ERR_UNSUPPORTED: return "FP_ERR_UNSUPPORTED";
    case FP_ERR_WORKSPACE: return "FP_ERR_WORKSPACE";
    case FP_ERR_BACKEND_UNAVAILABLE: return "FP_ERR_BACKEND_UNAVAILABLE";
    case FP_ERR_RUNTIME: return "FP_ERR_RUNTIME";
  }
  return "FP_ERR_UNKNOWN";
}

const char* fp_backend_name(fp_backend b) {
  switch (b) {
    case FP_BACKEND_AUTO: return "auto";
    case FP_BACKEND_REFERENCE: return "reference";
    case FP_BACKEND_CPU: return "cpu";
    case FP_BACKEND_CUDA: return "cuda";
    case FP_BACKEND_HIP: return "hip";
  }
  return "unknown";
}

int fp_backend_available(fp_backend b) {
  try {
    const flashport::Backend* be = flashport::find_backend(b);
    return be && be->available() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

const char* fp_version(void) { return FLASHPORT_VERSION_STRING; }

}  // extern "C"
