// Backend selection and launch. ONE selection routine (choose_backend) answers fp_*_select,
// the workspace size and the launch, so they can never disagree.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "backend.hpp"

namespace flashport {

struct Selected {
  const Backend* backend = nullptr;
  Plan plan;
  std::string skipped;  // "name: reason; ..." of the backends that declined (for FLASHPORT_LOG)
};

using PlanFn = std::function<Status(const Backend&, Plan*)>;

// The backend a call is forced to: `requested` if not AUTO, else FLASHPORT_BACKEND from
// runtime_config() (reference|cpu|cuda|hip; empty or "auto" = none). An unknown value is an error.
Status forced_backend(fp_backend requested, fp_backend* forced);

// The selection rule over an explicit backend list (priority order): with a forced backend,
// that one or an error (BACKEND_UNAVAILABLE if not in the list or not available, UNSUPPORTED
// with its reason if its plan declines); otherwise the first backend that handles `device` and
// whose plan accepts, or UNSUPPORTED listing every reason.
Status choose_backend(const std::vector<const Backend*>& backends, const char* op,
                      fp_backend forced, fp_device_type device, const PlanFn& plan,
                      Selected* out);

// FP_ERR_WORKSPACE naming the required size if `given_bytes` is below the plan's need.
Status check_workspace(const Selected& s, size_t given_bytes);

// The workspace a planned call runs on: `given` (checked against the plan), or, when `given` is
// NULL and `alloc` is set, alloc(alloc_ctx, plan bytes) called once (never for 0 bytes; a NULL
// answer is FP_ERR_WORKSPACE).
Status take_workspace(const Selected& s, void* given, size_t given_bytes,
                      void* (*alloc)(void* ctx, size_t bytes), void* alloc_ctx, void** workspace);

// The compiled backend with this id, or null.
const Backend* find_backend(fp_backend id);

// The C API boundary (c_api.cpp): runs `body`, sets the thread's last error, and maps every
// exception to FP_ERR_RUNTIME naming `fn`. Exposed for tests.
fp_status call_at_c_boundary(const char* fn, const std::function<Status()>& body);

// The C API's operations on registered_backends() (validation included).
Status attn_fwd_select_op(const fp_attn_params& p, fp_selection* sel);
Status attn_bwd_select_op(const fp_attn_bwd_params& p, fp_selection* sel);
Status attn_fwd_op(const fp_attn_params& p);
Status attn_bwd_op(const fp_attn_bwd_params& p);
// The same over an explicit backend list (tests): one resolve, one selection (one plan of the
// chosen backend), the workspace, one launch.
Status attn_fwd_with(const std::vector<const Backend*>& backends, const fp_attn_params& p);
Status attn_bwd_with(const std::vector<const Backend*>& backends, const fp_attn_bwd_params& p);
Status attn_probs_op(const fp_attn_params& p, const fp_tensor& probs);
Status merge_fwd_op(const fp_merge_params& p);
Status merge_bwd_op(const fp_merge_bwd_params& p);

}  // namespace flashport
