// Backend selection: the one routine behind select, workspace and launch; forced backends, the
// FLASHPORT_BACKEND override, unavailable backends, workspace errors and FLASHPORT_LOG.
// Selection logic is exercised with local test backends; the C API with the registered ones.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/dispatch.hpp"
#include "validate_fixtures.hpp"

namespace flashport::test {
namespace {

// Sets an environment variable for one scope (the library reads the environment once, so the
// cached settings are re-read on entry and exit).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) setenv(name, value, 1); else unsetenv(name);
    reload_runtime_config();
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1); else unsetenv(name_);
    reload_runtime_config();
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// A local test backend for the selection rule (not part of the library).
class TestBackend final : public Backend {
 public:
  TestBackend(fp_backend id, fp_device_type dev, bool available, const char* reject,
              size_t workspace = 0)
      : id_(id), dev_(dev), available_(available), reject_(reject), workspace_(workspace) {}
  fp_backend id() const override { return id_; }
  bool available() const override { return available_; }
  bool handles_device(fp_device_type d) const override { return d == dev_; }
  Status plan_fwd(const Problem&, Plan* plan) const override { return plan_any(plan); }
  Status run_fwd(const Problem&, const Plan& plan, void* ws) const override {
    return record_run(plan, ws);
  }
  Status plan_bwd(const BwdProblem&, Plan* plan) const override { return plan_any(plan); }
  Status run_bwd(const BwdProblem&, const Plan& plan, void* ws) const override {
    return record_run(plan, ws);
  }
  Status plan_merge(const MergeProblem&, Plan* plan) const override { return plan_any(plan); }
  Status run_merge(const MergeProblem&, const Plan&) const override { return Status::ok(); }
  Status run_merge_bwd(const MergeBwdProblem&, const Plan&) const override { return Status::ok(); }
  mutable int plans = 0;
  mutable int runs = 0;
  mutable void* run_workspace = nullptr;  // what the last run got
  mutable std::string run_kernel;

 private:
  Status record_run(const Plan& plan, void* ws) const {
    ++runs;
    run_workspace = ws;
    run_kernel = plan.kernel;
    return Status::ok();
  }
  Status plan_any(Plan* plan) const {
    ++plans;
    if (reject_) return unsupported(reject_);
    std::snprintf(plan->kernel, sizeof(plan->kernel), "test_kernel_%s", fp_backend_name(id_));
    plan->workspace_bytes = workspace_;
    plan->num_splits = 3;
    return Status::ok();
  }
  fp_backend id_;
  fp_device_type dev_;
  bool available_;
  const char* reject_;
  size_t workspace_;
};

Status choose(const std::vector<const Backend*>& list, fp_backend forced, fp_device_type dev,
              Selected* s) {
  Problem prob;
  return choose_backend(list, "attn_fwd", forced, dev,
                        [&](const Backend& b, Plan* plan) { return b.plan_fwd(prob, plan); }, s);
}

TEST(Dispatch, FirstAcceptingBackendInPriorityOrderWins) {
  TestBackend cuda(FP_BACKEND_CUDA, FP_DEVICE_CUDA, true, nullptr);
  TestBackend cpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, "cpu: softcap with dropout not supported");
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  Selected s;
  ASSERT_TRUE(choose({&cuda, &cpu, &ref}, FP_BACKEND_AUTO, FP_DEVICE_CPU, &s).is_ok());
  EXPECT_EQ(s.backend, &ref);
  EXPECT_EQ(cuda.plans, 0);  // never asked about CPU tensors
  EXPECT_EQ(cpu.plans, 1);
  EXPECT_STREQ(s.plan.kernel, "test_kernel_reference");
  EXPECT_NE(s.skipped.find("cpu: cpu: softcap with dropout not supported"), std::string::npos);
}

TEST(Dispatch, NoBackendAcceptsListsEveryReason) {
  TestBackend cpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, "reason one");
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, "reason two");
  Selected s;
  Status st = choose({&cpu, &ref}, FP_BACKEND_AUTO, FP_DEVICE_CPU, &s);
  EXPECT_EQ(st.code(), FP_ERR_UNSUPPORTED);
  EXPECT_NE(st.message().find("cpu: reason one"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("reference: reason two"), std::string::npos) << st.message();
  EXPECT_EQ(s.backend, nullptr);
}

TEST(Dispatch, NoBackendForTheDeviceIsUnavailable) {
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  TestBackend cuda(FP_BACKEND_CUDA, FP_DEVICE_CUDA, false, nullptr);  // compiled, no GPU
  Selected s;
  Status st = choose({&cuda, &ref}, FP_BACKEND_AUTO, FP_DEVICE_CUDA, &s);
  EXPECT_EQ(st.code(), FP_ERR_BACKEND_UNAVAILABLE);
  EXPECT_NE(st.message().find("no backend for cuda tensors"), std::string::npos) << st.message();
  EXPECT_EQ(cuda.plans, 0);
}

TEST(Dispatch, ForcedBackendIsUsedEvenIfAnotherComesFirst) {
  TestBackend cpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr);
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  Selected s;
  ASSERT_TRUE(choose({&cpu, &ref}, FP_BACKEND_REFERENCE, FP_DEVICE_CPU, &s).is_ok());
  EXPECT_EQ(s.backend, &ref);
  EXPECT_EQ(cpu.plans, 0);
}

TEST(Dispatch, ForcedBackendThatDeclinesIsUnsupportedWithItsReason) {
  TestBackend cpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, "head dim 200 not compiled");
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  Selected s;
  Status st = choose({&cpu, &ref}, FP_BACKEND_CPU, FP_DEVICE_CPU, &s);
  EXPECT_EQ(st.code(), FP_ERR_UNSUPPORTED);  // no silent fallback to the reference
  EXPECT_NE(st.message().find("head dim 200 not compiled"), std::string::npos);
  EXPECT_NE(st.message().find("cpu"), std::string::npos);
}

TEST(Dispatch, ForcedBackendMissingOrWithoutDeviceIsUnavailable) {
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  TestBackend hip(FP_BACKEND_HIP, FP_DEVICE_HIP, false, nullptr);
  Selected s;
  Status st = choose({&hip, &ref}, FP_BACKEND_CUDA, FP_DEVICE_CUDA, &s);
  EXPECT_EQ(st.code(), FP_ERR_BACKEND_UNAVAILABLE);
  EXPECT_NE(st.message().find("cuda is not compiled"), std::string::npos) << st.message();
  st = choose({&hip, &ref}, FP_BACKEND_HIP, FP_DEVICE_HIP, &s);
  EXPECT_EQ(st.code(), FP_ERR_BACKEND_UNAVAILABLE);
  EXPECT_NE(st.message().find("no device is available"), std::string::npos) << st.message();
}

TEST(Dispatch, ForcedBackendForAnotherDeviceIsUnsupported) {
  TestBackend ref(FP_BACKEND_REFERENCE, FP_DEVICE_CPU, true, nullptr);
  Selected s;
  Status st = choose({&ref}, FP_BACKEND_REFERENCE, FP_DEVICE_CUDA, &s);
  EXPECT_EQ(st.code(), FP_ERR_UNSUPPORTED);
  EXPECT_NE(st.message().find("reference cannot run on cuda tensors"), std::string::npos);
}

TEST(Dispatch, WorkspaceTooSmallNamesTheRequiredSize) {
  TestBackend gpu(FP_BACKEND_CUDA, FP_DEVICE_CUDA, true, nullptr, 4096);
  Selected s;
  ASSERT_TRUE(choose({&gpu}, FP_BACKEND_AUTO, FP_DEVICE_CUDA, &s).is_ok());
  EXPECT_EQ(s.plan.workspace_bytes, 4096u);
  Status st = check_workspace(s, 4095);
  EXPECT_EQ(st.code(), FP_ERR_WORKSPACE);
  EXPECT_NE(st.message().find("needs 4096 bytes (got 4095)"), std::string::npos) << st.message();
  EXPECT_TRUE(check_workspace(s, 4096).is_ok());
  EXPECT_TRUE(check_workspace(s, 1 << 20).is_ok());
}

TEST(Dispatch, EnvironmentOverride) {
  fp_backend forced;
  {
    ScopedEnv e("FLASHPORT_BACKEND", "cpu");
    ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
    EXPECT_EQ(forced, FP_BACKEND_CPU);
    // An explicit params.backend wins over the environment.
    ASSERT_TRUE(forced_backend(FP_BACKEND_REFERENCE, &forced).is_ok());
    EXPECT_EQ(forced, FP_BACKEND_REFERENCE);
  }
  for (const char* name : {"reference", "cuda", "hip"}) {
    ScopedEnv e("FLASHPORT_BACKEND", name);
    ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
    EXPECT_STREQ(fp_backend_name(forced), name);
  }
  {
    ScopedEnv e("FLASHPORT_BACKEND", "auto");
    ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
    EXPECT_EQ(forced, FP_BACKEND_AUTO);
  }
  {
    ScopedEnv e("FLASHPORT_BACKEND", "tpu");
    Status st = forced_backend(FP_BACKEND_AUTO, &forced);
    EXPECT_EQ(st.code(), FP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(st.message().find("FLASHPORT_BACKEND"), std::string::npos);
  }
}

// A caller's workspace allocator that records its calls.
struct RecordingAllocator {
  std::vector<size_t> requests;
  void* answer = nullptr;
  static void* alloc(void* ctx, size_t bytes) {
    auto* self = static_cast<RecordingAllocator*>(ctx);
    self->requests.push_back(bytes);
    return self->answer;
  }
};

TEST(Dispatch, AllocatorIsCalledOnceWithThePlansBytesAfterOnePlan) {
  TestBackend gpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 4096);
  alignas(64) static unsigned char buffer[4096];
  RecordingAllocator a;
  a.answer = buffer;
  FwdCall c;
  c.p.workspace_alloc = &RecordingAllocator::alloc;
  c.p.workspace_alloc_ctx = &a;
  ASSERT_TRUE(attn_fwd_with({&gpu}, c.p).is_ok());
  ASSERT_EQ(a.requests.size(), 1u);
  EXPECT_EQ(a.requests[0], 4096u);
  EXPECT_EQ(gpu.plans, 1);  // one resolve, one plan, one launch
  EXPECT_EQ(gpu.runs, 1);
  EXPECT_EQ(gpu.run_workspace, static_cast<void*>(buffer));

  BwdCall b;
  b.p.fwd.workspace_alloc = &RecordingAllocator::alloc;
  b.p.fwd.workspace_alloc_ctx = &a;
  gpu.plans = 0;
  ASSERT_TRUE(attn_bwd_with({&gpu}, b.p).is_ok());
  ASSERT_EQ(a.requests.size(), 2u);
  EXPECT_EQ(a.requests[1], 4096u);
  EXPECT_EQ(gpu.plans, 1);
  EXPECT_EQ(gpu.run_workspace, static_cast<void*>(buffer));
}

TEST(Dispatch, AllocatorIsNeverAskedForZeroBytes) {
  TestBackend cpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 0);
  RecordingAllocator a;
  FwdCall c;
  c.p.workspace_alloc = &RecordingAllocator::alloc;
  c.p.workspace_alloc_ctx = &a;
  ASSERT_TRUE(attn_fwd_with({&cpu}, c.p).is_ok());
  EXPECT_TRUE(a.requests.empty());
  EXPECT_EQ(cpu.runs, 1);
  EXPECT_EQ(cpu.run_workspace, nullptr);
}

TEST(Dispatch, AllocatorReturningNullFailsWithoutRunning) {
  TestBackend gpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 512);
  RecordingAllocator a;  // answers NULL
  FwdCall c;
  c.p.workspace_alloc = &RecordingAllocator::alloc;
  c.p.workspace_alloc_ctx = &a;
  Status st = attn_fwd_with({&gpu}, c.p);
  EXPECT_EQ(st.code(), FP_ERR_WORKSPACE);
  EXPECT_NE(st.message().find("workspace_alloc"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("512 bytes"), std::string::npos) << st.message();
  EXPECT_EQ(a.requests.size(), 1u);
  EXPECT_EQ(gpu.runs, 0);
  EXPECT_TRUE(untouched({&c.out, &c.lse}));
}

TEST(Dispatch, GivenWorkspaceWinsOverTheAllocator) {
  TestBackend gpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 256);
  alignas(64) static unsigned char mine[256];
  RecordingAllocator a;
  FwdCall c;
  c.p.workspace = mine;
  c.p.workspace_bytes = sizeof(mine);
  c.p.workspace_alloc = &RecordingAllocator::alloc;
  c.p.workspace_alloc_ctx = &a;
  ASSERT_TRUE(attn_fwd_with({&gpu}, c.p).is_ok());
  EXPECT_TRUE(a.requests.empty());
  EXPECT_EQ(gpu.run_workspace, static_cast<void*>(mine));
  c.p.workspace_bytes = 255;  // too small: an error naming the need, the allocator still unused
  Status st = attn_fwd_with({&gpu}, c.p);
  EXPECT_EQ(st.code(), FP_ERR_WORKSPACE);
  EXPECT_NE(st.message().find("needs 256 bytes (got 255)"), std::string::npos) << st.message();
  EXPECT_TRUE(a.requests.empty());
}

TEST(Dispatch, WorkspaceNeededButNeitherGivenNorAllocatorIsAnError) {
  TestBackend gpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 64);
  FwdCall c;
  Status st = attn_fwd_with({&gpu}, c.p);
  EXPECT_EQ(st.code(), FP_ERR_WORKSPACE);
  EXPECT_NE(st.message().find("needs 64 bytes (got 0)"), std::string::npos) << st.message();
  EXPECT_EQ(gpu.runs, 0);
}

TEST(Dispatch, SelectThenRunAndRunWithAllocatorLaunchTheSameKernel) {
  TestBackend declines(FP_BACKEND_CUDA, FP_DEVICE_CPU, true, "not this one");
  TestBackend gpu(FP_BACKEND_CPU, FP_DEVICE_CPU, true, nullptr, 128);
  alignas(64) static unsigned char buffer[128];
  Selected s;
  ASSERT_TRUE(choose({&declines, &gpu}, FP_BACKEND_AUTO, FP_DEVICE_CPU, &s).is_ok());
  FwdCall c;
  c.p.workspace = buffer;
  c.p.workspace_bytes = s.plan.workspace_bytes;
  ASSERT_TRUE(attn_fwd_with({&declines, &gpu}, c.p).is_ok());
  const std::string select_then_run = gpu.run_kernel;
  RecordingAllocator a;
  a.answer = buffer;
  FwdCall d;
  d.p.workspace_alloc = &RecordingAllocator::alloc;
  d.p.workspace_alloc_ctx = &a;
  ASSERT_TRUE(attn_fwd_with({&declines, &gpu}, d.p).is_ok());
  EXPECT_EQ(select_then_run, s.plan.kernel);
  EXPECT_EQ(gpu.run_kernel, s.plan.kernel);
  EXPECT_EQ(gpu.runs, 2);
}

TEST(Dispatch, EnvironmentIsReadOnceUntilReloaded) {
  fp_backend forced;
  ScopedEnv e("FLASHPORT_BACKEND", "reference");
  ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
  EXPECT_EQ(forced, FP_BACKEND_REFERENCE);
  setenv("FLASHPORT_BACKEND", "cpu", 1);  // not seen until the settings are re-read
  ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
  EXPECT_EQ(forced, FP_BACKEND_REFERENCE);
  reload_runtime_config();
  ASSERT_TRUE(forced_backend(FP_BACKEND_AUTO, &forced).is_ok());
  EXPECT_EQ(forced, FP_BACKEND_CPU);
}

// ---- Through the C API with the registered backends ----------------------------------------------

TEST(DispatchCApi, RegisteredBackendsInPriorityOrder) {
  const auto& list = registered_backends();
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.back()->id(), FP_BACKEND_REFERENCE);  // the oracle is always there, last
  auto rank = [](fp_backend b) {
    switch (b) {
      case FP_BACKEND_CUDA: return 0;
      case FP_BACKEND_HIP: return 1;
      case FP_BACKEND_CPU: return 2;
      default: return 3;
    }
  };
  for (size_t i = 1; i < list.size(); ++i) EXPECT_LT(rank(list[i - 1]->id()), rank(list[i]->id()));
#ifdef FLASHPORT_WITH_CPU
  EXPECT_NE(find_backend(FP_BACKEND_CPU), nullptr);
#endif
}

TEST(DispatchCApi, ForcedReferenceSelectReportsKernel) {
  FwdCall c;
  c.p.backend = FP_BACKEND_REFERENCE;
  fp_selection sel{};
  ASSERT_EQ(fp_attn_fwd_select(&c.p, &sel), FP_OK) << fp_last_error();
  EXPECT_EQ(sel.backend, FP_BACKEND_REFERENCE);
  EXPECT_GT(std::strlen(sel.kernel), 0u);
  EXPECT_GE(sel.num_splits, 1);
  EXPECT_STREQ(fp_last_error(), "");
  size_t bytes = 12345;
  ASSERT_EQ(fp_attn_fwd_workspace(&c.p, &bytes), FP_OK);
  EXPECT_EQ(bytes, sel.workspace_bytes);
  EXPECT_TRUE(untouched({&c.out, &c.lse}));  // select runs nothing
}

TEST(DispatchCApi, EnvironmentSelectsTheReference) {
  ScopedEnv e("FLASHPORT_BACKEND", "reference");
  FwdCall c;
  fp_selection sel{};
  ASSERT_EQ(fp_attn_fwd_select(&c.p, &sel), FP_OK) << fp_last_error();
  EXPECT_EQ(sel.backend, FP_BACKEND_REFERENCE);
}

TEST(DispatchCApi, LaunchRunsTheSelectedBackend) {
  FwdCall c;
  c.p.backend = FP_BACKEND_REFERENCE;
  ASSERT_EQ(fp_attn_fwd(&c.p), FP_OK) << fp_last_error();
  EXPECT_TRUE(c.out.all_written());
  EXPECT_TRUE(c.lse.all_written());
  EXPECT_TRUE(c.out.guards_intact());
  EXPECT_TRUE(c.lse.guards_intact());
  EXPECT_STREQ(fp_last_error(), "");
}

TEST(DispatchCApi, EveryOpLaunchesThroughTheSameSelection) {
  BwdCall b;
  b.p.fwd.backend = FP_BACKEND_REFERENCE;
  fp_selection sel{};
  ASSERT_EQ(fp_attn_bwd_select(&b.p, &sel), FP_OK) << fp_last_error();
  EXPECT_EQ(sel.backend, FP_BACKEND_REFERENCE);
  size_t bytes = 1;
  ASSERT_EQ(fp_attn_bwd_workspace(&b.p, &bytes), FP_OK);
  EXPECT_EQ(bytes, sel.workspace_bytes);
  ASSERT_EQ(fp_attn_bwd(&b.p), FP_OK) << fp_last_error();
  for (const HostTensor* t : {&b.dq, &b.dk, &b.dv}) {
    EXPECT_TRUE(t->all_written());
    EXPECT_TRUE(t->guards_intact());
  }
  MergeBwdCall m;
  m.m.p.backend = FP_BACKEND_REFERENCE;
  m.m.out.fill_poison();
  m.m.lse.fill_poison();
  ASSERT_EQ(fp_merge_fwd(&m.m.p), FP_OK) << fp_last_error();
  EXPECT_TRUE(m.m.out.all_written());
  EXPECT_TRUE(m.m.lse.all_written());
  m.p.fwd = m.m.p;
  m.p.fwd.backend = FP_BACKEND_REFERENCE;
  ASSERT_EQ(fp_merge_bwd(&m.p), FP_OK) << fp_last_error();
  EXPECT_TRUE(m.d_parts.all_written());
  EXPECT_TRUE(m.d_lse_parts.all_written());
  EXPECT_TRUE(m.d_parts.guards_intact());
}

TEST(DispatchCApi, UncompiledBackendIsUnavailable) {
  for (fp_backend b : {FP_BACKEND_CUDA, FP_BACKEND_HIP, FP_BACKEND_CPU}) {
    if (find_backend(b) != nullptr && fp_backend_available(b)) continue;
    FwdCall c;
    c.p.backend = b;
    fp_selection sel{};
    EXPECT_TRUE(c_call_matches([&] { return fp_attn_fwd_select(&c.p, &sel); },
                               FP_ERR_BACKEND_UNAVAILABLE, fp_backend_name(b)));
    EXPECT_TRUE(c_call_matches([&] { return fp_attn_fwd(&c.p); }, FP_ERR_BACKEND_UNAVAILABLE,
                               fp_backend_name(b)));
    EXPECT_TRUE(untouched({&c.out, &c.lse}));
    ScopedEnv e("FLASHPORT_BACKEND", fp_backend_name(b));
    FwdCall d;
    EXPECT_TRUE(c_call_matches([&] { return fp_attn_fwd(&d.p); }, FP_ERR_BACKEND_UNAVAILABLE,
                               fp_backend_name(b)));
  }
}

TEST(DispatchCApi, GpuTensorsWithoutAGpuBackendAreUnavailable) {
  if (fp_backend_available(FP_BACKEND_CUDA)) GTEST_SKIP() << "a CUDA device is present";
  FwdCall c;
  for (fp_tensor* t : {&c.p.q, &c.p.k, &c.p.v, &c.p.out, &c.p.lse}) t->device_type = FP_DEVICE_CUDA;
  fp_selection sel{};
  EXPECT_TRUE(c_call_matches([&] { return fp_attn_fwd_select(&c.p, &sel); },
                             FP_ERR_BACKEND_UNAVAILABLE, "cuda"));
  c.p.backend = FP_BACKEND_REFERENCE;
  EXPECT_TRUE(c_call_matches([&] { return fp_attn_fwd_select(&c.p, &sel); }, FP_ERR_UNSUPPORTED,
                             "reference cannot run on cuda tensors"));
}

TEST(DispatchCApi, SelectRunAndAllocatorRunLogTheSameKernel) {
  ScopedEnv e("FLASHPORT_LOG", "1");
  auto kernel_in = [](const std::string& log, const char* op) {
    const std::string key = std::string("flashport: ") + op + " backend=";
    const size_t at = log.find(key);
    if (at == std::string::npos) return std::string("<missing>");
    const size_t end = log.find(" splits=", at);
    return log.substr(at + std::strlen("flashport: ") + std::strlen(op) + 1,
                      end - at - std::strlen("flashport: ") - std::strlen(op) - 1);
  };
  RecordingAllocator a;
  FwdCall c;  // AUTO: the fastest compiled CPU backend
  fp_selection sel{};
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(fp_attn_fwd_select(&c.p, &sel), FP_OK) << fp_last_error();
  ASSERT_EQ(fp_attn_fwd(&c.p), FP_OK) << fp_last_error();
  c.p.workspace_alloc = &RecordingAllocator::alloc;
  c.p.workspace_alloc_ctx = &a;
  const std::string first = ::testing::internal::GetCapturedStderr();
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(fp_attn_fwd(&c.p), FP_OK) << fp_last_error();
  const std::string second = ::testing::internal::GetCapturedStderr();
  const std::string selected = kernel_in(first, "attn_fwd_select");
  EXPECT_NE(selected.find(std::string("kernel=") + sel.kernel), std::string::npos) << first;
  EXPECT_EQ(kernel_in(first, "attn_fwd"), selected) << first;
  EXPECT_EQ(kernel_in(second, "attn_fwd"), selected) << second;
  EXPECT_EQ(std::count(second.begin(), second.end(), '\n'), 1);  // one line: one selection
  if (sel.workspace_bytes == 0) {
    EXPECT_TRUE(a.requests.empty());
  } else {
    EXPECT_EQ(a.requests.size(), 1u);
  }
  EXPECT_TRUE(c.out.all_written());
}

TEST(DispatchCApi, LogLinePerCall) {
  ScopedEnv e("FLASHPORT_LOG", "1");
  FwdCall c;
  c.p.backend = FP_BACKEND_REFERENCE;
  fp_selection sel{};
  ::testing::internal::CaptureStderr();
  const fp_status st = fp_attn_fwd_select(&c.p, &sel);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(st, FP_OK);
  EXPECT_NE(err.find("flashport: attn_fwd_select backend=reference kernel=" + std::string(sel.kernel)),
            std::string::npos) << err;
  EXPECT_NE(err.find("splits="), std::string::npos);
  EXPECT_NE(err.find("workspace="), std::string::npos);
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1);
}

TEST(DispatchCApi, NoLogByDefault) {
  ScopedEnv e("FLASHPORT_LOG", nullptr);
  FwdCall c;
  c.p.backend = FP_BACKEND_REFERENCE;
  fp_selection sel{};
  ::testing::internal::CaptureStderr();
  fp_attn_fwd_select(&c.p, &sel);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace flashport::test
