// Backend registry, selection and launch. Every op goes through choose_backend(): select,
// workspace size and launch share it, so a call that selects is a call that launches.
#include "dispatch.hpp"

#include <cstdio>
#include <cstring>
#include <string>

#include "config.hpp"
#include "validate.hpp"

namespace flashport {

const std::vector<const Backend*>& registered_backends() {
  static const std::vector<const Backend*> list = [] {
    std::vector<const Backend*> v;
#ifdef FLASHPORT_WITH_CUDA
    v.push_back(cuda_backend());
#endif
#ifdef FLASHPORT_WITH_HIP
    v.push_back(hip_backend());
#endif
#ifdef FLASHPORT_WITH_CPU
    v.push_back(cpu_backend());
#endif
    v.push_back(reference_backend());
    return v;
  }();
  return list;
}

const Backend* find_backend(fp_backend id) {
  for (const Backend* b : registered_backends())
    if (b->id() == id) return b;
  return nullptr;
}

namespace {

const char* name_of(fp_backend b) { return fp_backend_name(b); }

const char* device_name(fp_device_type d) {
  switch (d) {
    case FP_DEVICE_CPU: return "cpu";
    case FP_DEVICE_CUDA: return "cuda";
    case FP_DEVICE_HIP: return "hip";
  }
  return "?";
}

bool log_enabled() { return runtime_config().log; }

void log_call(const char* op, const Selected& s) {
  if (!log_enabled()) return;
  std::fprintf(stderr, "flashport: %s backend=%s kernel=%s splits=%d workspace=%zu%s%s%s%s%s\n", op,
               name_of(s.backend->id()), s.plan.kernel, s.plan.num_splits,
               s.plan.workspace_bytes, s.skipped.empty() ? "" : " skipped=[",
               s.skipped.empty() ? "" : (s.skipped + "]").c_str(),
               s.plan.passed_over[0] ? " passed_over=[" : "", s.plan.passed_over, s.plan.passed_over[0] ? "]" : "");
}

void log_error(const char* op, const Status& st) {
  if (!log_enabled()) return;
  std::fprintf(stderr, "flashport: %s failed (%s): %s\n", op, fp_status_name(st.code()),
               st.message().c_str());
}

void fill_selection(const Selected& s, fp_selection* sel) {
  std::memset(sel, 0, sizeof(*sel));
  sel->backend = s.backend->id();
  static_assert(sizeof(sel->kernel) == sizeof(s.plan.kernel));
  std::memcpy(sel->kernel, s.plan.kernel, sizeof(sel->kernel));
  sel->kernel[sizeof(sel->kernel) - 1] = '\0';
  sel->workspace_bytes = s.plan.workspace_bytes;
  sel->num_splits = s.plan.num_splits;
}

}  // namespace

Status check_workspace(const Selected& s, size_t given_bytes) {
  if (given_bytes < s.plan.workspace_bytes)
    return {FP_ERR_WORKSPACE, "workspace: " + std::string(name_of(s.backend->id())) + " kernel " +
                                  s.plan.kernel + " needs " +
                                  std::to_string(s.plan.workspace_bytes) + " bytes (got " +
                                  std::to_string(given_bytes) +
                                  "); query it with fp_attn_*_select or fp_attn_*_workspace"};
  return Status::ok();
}

Status take_workspace(const Selected& s, void* given, size_t given_bytes,
                      void* (*alloc)(void* ctx, size_t bytes), void* alloc_ctx, void** workspace) {
  *workspace = given;
  if (given != nullptr || alloc == nullptr) return check_workspace(s, given_bytes);
  if (s.plan.workspace_bytes == 0) return Status::ok();  // the allocator is never asked for 0
  *workspace = alloc(alloc_ctx, s.plan.workspace_bytes);
  if (*workspace == nullptr)
    return {FP_ERR_WORKSPACE, "workspace_alloc: returned NULL for the " +
                                  std::to_string(s.plan.workspace_bytes) + " bytes that " +
                                  name_of(s.backend->id()) + " kernel " + s.plan.kernel +
                                  " needs"};
  return Status::ok();
}

namespace {

Status select_fwd(const std::vector<const Backend*>& backends, const fp_attn_params& p,
                  const Problem& prob, const char* op, Selected* s) {
  fp_backend forced;
  FP_RETURN_IF_ERROR(forced_backend(p.backend, &forced));
  return choose_backend(
      backends, op, forced, prob.device,
      [&](const Backend& b, Plan* plan) { return b.plan_fwd(prob, plan); }, s);
}

Status select_bwd(const std::vector<const Backend*>& backends, const fp_attn_bwd_params& p,
                  const BwdProblem& prob, const char* op, Selected* s) {
  fp_backend forced;
  FP_RETURN_IF_ERROR(forced_backend(p.fwd.backend, &forced));
  return choose_backend(
      backends, op, forced, prob.fwd.device,
      [&](const Backend& b, Plan* plan) { return b.plan_bwd(prob, plan); }, s);
}

Status select_merge(const fp_merge_params& p, const MergeProblem& prob, const char* op,
                    Selected* s) {
  fp_backend forced;
  FP_RETURN_IF_ERROR(forced_backend(p.backend, &forced));
  return choose_backend(
      registered_backends(), op, forced, prob.device,
      [&](const Backend& b, Plan* plan) { return b.plan_merge(prob, plan); }, s);
}

// Runs `body`, logging a failure under FLASHPORT_LOG.
template <class F>
Status logged(const char* op, F&& body) {
  Status st = body();
  if (!st.is_ok()) log_error(op, st);
  return st;
}

}  // namespace

Status forced_backend(fp_backend requested, fp_backend* forced) {
  if (requested != FP_BACKEND_AUTO) {
    *forced = requested;
    return Status::ok();
  }
  *forced = FP_BACKEND_AUTO;
  const char* env = runtime_config().backend.c_str();
  if (!*env || std::strcmp(env, "auto") == 0) return Status::ok();
  static const struct { const char* name; fp_backend id; } kNames[] = {
      {"reference", FP_BACKEND_REFERENCE}, {"cpu", FP_BACKEND_CPU},
      {"cuda", FP_BACKEND_CUDA}, {"hip", FP_BACKEND_HIP}};
  for (const auto& n : kNames)
    if (std::strcmp(env, n.name) == 0) {
      *forced = n.id;
      return Status::ok();
    }
  return invalid(std::string("FLASHPORT_BACKEND: must be reference, cpu, cuda, hip or auto (got \"") +
                 env + "\")");
}

Status choose_backend(const std::vector<const Backend*>& backends, const char* op,
                      fp_backend forced, fp_device_type device, const PlanFn& plan_fn,
                      Selected* out) {
  Selected s;
  if (forced != FP_BACKEND_AUTO) {
    const Backend* b = nullptr;
    for (const Backend* c : backends)
      if (c->id() == forced) b = c;
    if (!b)
      return {FP_ERR_BACKEND_UNAVAILABLE,
              std::string("backend: ") + name_of(forced) +
                  " is not compiled into this build of flashport (" + op + ")"};
    if (!b->available())
      return {FP_ERR_BACKEND_UNAVAILABLE, std::string("backend: ") + name_of(forced) +
                                              " is compiled in but no device is available (" +
                                              op + ")"};
    if (!b->handles_device(device))
      return unsupported(std::string("backend: ") + name_of(forced) + " cannot run on " +
                         device_name(device) + " tensors (" + op + ")");
    Plan plan;
    Status st = plan_fn(*b, &plan);
    if (!st.is_ok())
      return unsupported(std::string("backend ") + name_of(forced) + " (forced) declines " + op +
                         ": " + st.message());
    s.backend = b;
    s.plan = plan;
    *out = s;
    return Status::ok();
  }
  bool any_for_device = false;
  for (const Backend* b : backends) {
    if (!b->handles_device(device)) continue;
    if (!b->available()) {
      s.skipped += std::string(s.skipped.empty() ? "" : "; ") + name_of(b->id()) +
                   ": no device available";
      continue;
    }
    any_for_device = true;
    Plan plan;
    Status st = plan_fn(*b, &plan);
    if (st.is_ok()) {
      s.backend = b;
      s.plan = plan;
      *out = s;
      return Status::ok();
    }
    s.skipped += std::string(s.skipped.empty() ? "" : "; ") + name_of(b->id()) + ": " +
                 st.message();
  }
  if (!any_for_device)
    return {FP_ERR_BACKEND_UNAVAILABLE, std::string("no backend for ") + device_name(device) +
                                            " tensors is compiled in or available (" + op + ")" +
                                            (s.skipped.empty() ? "" : ": " + s.skipped)};
  return unsupported(std::string("no backend can run this ") + op + ": " + s.skipped);
}

Status attn_fwd_select_op(const fp_attn_params& p, fp_selection* sel) {
  return logged("attn_fwd_select", [&] {
    Problem prob;
    FP_RETURN_IF_ERROR(resolve_fwd(p, &prob));
    Selected s;
    FP_RETURN_IF_ERROR(select_fwd(registered_backends(), p, prob, "attn_fwd", &s));
    log_call("attn_fwd_select", s);
    fill_selection(s, sel);
    return Status::ok();
  });
}

Status attn_bwd_select_op(const fp_attn_bwd_params& p, fp_selection* sel) {
  return logged("attn_bwd_select", [&] {
    BwdProblem prob;
    FP_RETURN_IF_ERROR(resolve_bwd(p, &prob));
    Selected s;
    FP_RETURN_IF_ERROR(select_bwd(registered_backends(), p, prob, "attn_bwd", &s));
    log_call("attn_bwd_select", s);
    fill_selection(s, sel);
    return Status::ok();
  });
}

Status attn_fwd_with(const std::vector<const Backend*>& backends, const fp_attn_params& p) {
  return logged("attn_fwd", [&] {
    Problem prob;
    FP_RETURN_IF_ERROR(resolve_fwd(p, &prob));
    Selected s;
    FP_RETURN_IF_ERROR(select_fwd(backends, p, prob, "attn_fwd", &s));
    void* workspace;
    FP_RETURN_IF_ERROR(take_workspace(s, p.workspace, p.workspace_bytes, p.workspace_alloc,
                                      p.workspace_alloc_ctx, &workspace));
    log_call("attn_fwd", s);
    return s.backend->run_fwd(prob, s.plan, workspace);
  });
}

Status attn_bwd_with(const std::vector<const Backend*>& backends, const fp_attn_bwd_params& p) {
  return logged("attn_bwd", [&] {
    BwdProblem prob;
    FP_RETURN_IF_ERROR(resolve_bwd(p, &prob));
    Selected s;
    FP_RETURN_IF_ERROR(select_bwd(backends, p, prob, "attn_bwd", &s));
    void* workspace;
    FP_RETURN_IF_ERROR(take_workspace(s, p.fwd.workspace, p.fwd.workspace_bytes,
                                      p.fwd.workspace_alloc, p.fwd.workspace_alloc_ctx,
                                      &workspace));
    log_call("attn_bwd", s);
    return s.backend->run_bwd(prob, s.plan, workspace);
  });
}

Status attn_fwd_op(const fp_attn_params& p) { return attn_fwd_with(registered_backends(), p); }

Status attn_bwd_op(const fp_attn_bwd_params& p) { return attn_bwd_with(registered_backends(), p); }

Status attn_probs_op(const fp_attn_params& p, const fp_tensor& probs) {
  return logged("attn_probs", [&] {
    ProbsProblem prob;
    FP_RETURN_IF_ERROR(resolve_probs(p, probs, &prob));
    fp_backend forced;
    FP_RETURN_IF_ERROR(forced_backend(p.backend, &forced));
    Selected s;
    FP_RETURN_IF_ERROR(choose_backend(
        registered_backends(), "attn_probs", forced, prob.fwd.device,
        [&](const Backend& b, Plan* plan) { return b.plan_probs(prob, plan); }, &s));
    log_call("attn_probs", s);
    return s.backend->run_probs(prob, s.plan);
  });
}

Status merge_fwd_op(const fp_merge_params& p) {
  return logged("merge_fwd", [&] {
    MergeProblem prob;
    FP_RETURN_IF_ERROR(resolve_merge(p, &prob));
    Selected s;
    FP_RETURN_IF_ERROR(select_merge(p, prob, "merge_fwd", &s));
    log_call("merge_fwd", s);
    return s.backend->run_merge(prob, s.plan);
  });
}

Status merge_bwd_op(const fp_merge_bwd_params& p) {
  return logged("merge_bwd", [&] {
    MergeBwdProblem prob;
    FP_RETURN_IF_ERROR(resolve_merge_bwd(p, &prob));
    Selected s;
    // The merge plan decides for both directions (the backend interface has one plan_merge).
    FP_RETURN_IF_ERROR(select_merge(p.fwd, prob.fwd, "merge_bwd", &s));
    log_call("merge_bwd", s);
    return s.backend->run_merge_bwd(prob, s.plan);
  });
}

}  // namespace flashport
