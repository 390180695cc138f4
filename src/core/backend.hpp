// The backend interface. Each backend answers, for one call, through ONE planning function:
// "can I run this, with which kernel, how much workspace, how many splits" — or the reason it
// can't. dispatch.cpp asks the backends in priority order; "supported", "workspace size" and
// "launch" therefore can never disagree.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "problem.hpp"
#include "status.hpp"

namespace flashport {

struct Plan {
  char kernel[96] = {0};     // human-readable kernel name (FLASHPORT_LOG, fp_selection)
  size_t workspace_bytes = 0;
  int32_t num_splits = 1;
  int32_t kernel_id = 0;     // backend-private
  int32_t num_threads = 0;   // CPU backends: resolved thread count
  int32_t backend_args[4] = {0, 0, 0, 0};  // backend-private decision (GPU: tile, GQA pack), read by run_*
  char passed_over[160] = {0};  // a faster kernel of the backend that declined the call, and why (FLASHPORT_LOG)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual fp_backend id() const = 0;
  // Compiled in and, for a GPU backend, a device present.
  virtual bool available() const = 0;
  virtual bool handles_device(fp_device_type dev) const = 0;

  // Each plan_* returns OK and fills the plan, or FP_ERR_UNSUPPORTED with the reason.
  virtual Status plan_fwd(const Problem& p, Plan* plan) const = 0;
  virtual Status run_fwd(const Problem& p, const Plan& plan, void* workspace) const = 0;
  virtual Status plan_bwd(const BwdProblem& p, Plan* plan) const = 0;
  virtual Status run_bwd(const BwdProblem& p, const Plan& plan, void* workspace) const = 0;
  virtual Status plan_merge(const MergeProblem& p, Plan* plan) const = 0;
  virtual Status run_merge(const MergeProblem& p, const Plan& plan) const = 0;
  virtual Status run_merge_bwd(const MergeBwdProblem& p, const Plan& plan) const = 0;
  // fp_attn_probs (a testing aid): optional; a backend without it declines with this reason.
  virtual Status plan_probs(const ProbsProblem& /*p*/, Plan* /*plan*/) const {
    return unsupported(std::string(fp_backend_name(id())) + " backend: fp_attn_probs is not implemented");
  }
  virtual Status run_probs(const ProbsProblem& p, const Plan& /*plan*/) const {
    Plan unused;
    return plan_probs(p, &unused);
  }
};

// Backends in priority order (fastest first); defined in dispatch.cpp from the compiled set.
const std::vector<const Backend*>& registered_backends();

// Factories, one per backend source folder (only the compiled ones are linked).
const Backend* reference_backend();
const Backend* cpu_backend();
const Backend* cuda_backend();
const Backend* hip_backend();

}  // namespace flashport
