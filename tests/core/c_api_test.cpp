// The C API boundary: init values, last error, exceptions, names, version, C++ conveniences.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

#include "core/dispatch.hpp"
#include "flashport/flashport.hpp"
#include "validate_fixtures.hpp"

// tests/core/c_header_check.c: the header compiled as C.
extern "C" {
size_t fp_c_sizeof_params(void);
size_t fp_c_sizeof_bwd_params(void);
size_t fp_c_sizeof_tensor(void);
size_t fp_c_sizeof_enum(void);
size_t fp_c_offsetof_backend(void);
size_t fp_c_offsetof_causal_align(void);
void fp_c_set_raw_enums(fp_attn_params* p, int dtype, int causal_align, int backend);
}

namespace flashport::test {
namespace {

// C and C++ callers share one layout (the enums are int-sized in both: FP_ENUM in flashport.h).
TEST(CHeader, LayoutMatchesCpp) {
  EXPECT_EQ(fp_c_sizeof_params(), sizeof(fp_attn_params));
  EXPECT_EQ(fp_c_sizeof_bwd_params(), sizeof(fp_attn_bwd_params));
  EXPECT_EQ(fp_c_sizeof_tensor(), sizeof(fp_tensor));
  EXPECT_EQ(fp_c_sizeof_enum(), sizeof(fp_dtype));
  EXPECT_EQ(fp_c_offsetof_backend(), offsetof(fp_attn_params, backend));
  EXPECT_EQ(fp_c_offsetof_causal_align(), offsetof(fp_attn_params, causal_align));
}

// Any int a C caller stores in an enum field gets the named error, not undefined behaviour (the
// C++ side reads it as a value of an int-based enum; core_tests runs clean under UBSan).
TEST(CHeader, OutOfRangeEnumsFromCAreNamedErrors) {
  {
    FwdCall c;
    fp_c_set_raw_enums(&c.p, 42, FP_CAUSAL_BOTTOM_RIGHT, FP_BACKEND_AUTO);
    EXPECT_EQ(fp_attn_fwd(&c.p), FP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fp_last_error()).find("q: dtype is not a valid fp_dtype"), std::string::npos)
        << fp_last_error();
  }
  {
    FwdCall c;
    fp_c_set_raw_enums(&c.p, FP_F32, -7, FP_BACKEND_AUTO);
    EXPECT_EQ(fp_attn_fwd(&c.p), FP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fp_last_error()).find("causal_align"), std::string::npos) << fp_last_error();
  }
  {
    FwdCall c;
    fp_c_set_raw_enums(&c.p, FP_F32, FP_CAUSAL_BOTTOM_RIGHT, 1 << 20);
    EXPECT_NE(fp_attn_fwd(&c.p), FP_OK);
    EXPECT_NE(std::string(fp_last_error()).find("backend"), std::string::npos) << fp_last_error();
  }
}

bool tensor_absent(const fp_tensor& t) { return t.ndim == 0 && t.data == nullptr; }

TEST(CApi, AttnParamsInit) {
  fp_attn_params p;
  std::memset(&p, 0xAB, sizeof(p));
  fp_attn_params_init(&p);
  for (const fp_tensor* t : {&p.q, &p.k, &p.v, &p.out, &p.lse, &p.cu_seqlens_q, &p.cu_seqlens_k,
                             &p.seqused_k, &p.block_table, &p.cache_batch_idx, &p.k_new, &p.v_new,
                             &p.rotary_cos, &p.rotary_sin, &p.alibi_slopes, &p.sinks})
    EXPECT_TRUE(tensor_absent(*t));
  EXPECT_TRUE(std::isnan(p.softmax_scale));
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.backend, FP_BACKEND_AUTO);
  EXPECT_EQ(p.causal, 0);
  EXPECT_EQ(p.causal_align, FP_CAUSAL_BOTTOM_RIGHT);
  EXPECT_EQ(p.softcap, 0.0f);
  EXPECT_EQ(p.dropout_p, 0.0f);
  EXPECT_EQ(p.dropout_seed, 0u);
  EXPECT_EQ(p.num_splits, 0);
  EXPECT_EQ(p.max_seqlen_q, 0);
  EXPECT_EQ(p.rotary_interleaved, 0);
  EXPECT_EQ(p.stream, nullptr);
  EXPECT_EQ(p.workspace, nullptr);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_EQ(p.num_threads, 0);
}

TEST(CApi, BwdAndMergeInit) {
  fp_attn_bwd_params b;
  std::memset(&b, 0xCD, sizeof(b));
  fp_attn_bwd_params_init(&b);
  EXPECT_TRUE(std::isnan(b.fwd.softmax_scale));
  EXPECT_EQ(b.fwd.window_left, -1);
  for (const fp_tensor* t : {&b.dout, &b.dq, &b.dk, &b.dv, &b.d_sinks}) EXPECT_TRUE(tensor_absent(*t));
  EXPECT_EQ(b.deterministic, 0);
  fp_merge_bwd_params m;
  std::memset(&m, 0xCD, sizeof(m));
  fp_merge_bwd_params_init(&m);
  for (const fp_tensor* t : {&m.fwd.out_partials, &m.fwd.lse_partials, &m.fwd.out, &m.fwd.lse,
                             &m.dout, &m.dlse, &m.d_out_partials, &m.d_lse_partials})
    EXPECT_TRUE(tensor_absent(*t));
  EXPECT_EQ(m.fwd.backend, FP_BACKEND_AUTO);
  EXPECT_EQ(m.fwd.stream, nullptr);
  EXPECT_EQ(m.fwd.num_threads, 0);
}

TEST(CApi, CppParamsAreInitialised) {
  AttnParams p;
  EXPECT_TRUE(std::isnan(p.softmax_scale));
  EXPECT_EQ(p.window_right, -1);
  AttnBwdParams b;
  EXPECT_EQ(b.fwd.window_left, -1);
  MergeParams m;
  EXPECT_EQ(m.backend, FP_BACKEND_AUTO);
  MergeBwdParams mb;
  EXPECT_TRUE(tensor_absent(mb.dout));
  static_assert(sizeof(AttnParams) == sizeof(fp_attn_params));
}

TEST(CApi, LastErrorIsEmptyAfterSuccessAndPerThread) {
  FwdCall c;
  c.p.window_left = -9;
  EXPECT_EQ(fp_attn_fwd(&c.p), FP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp_last_error()).find("window_left"), std::string::npos);
  std::string other_thread = "unset";
  std::thread([&] { other_thread = fp_last_error(); }).join();
  EXPECT_EQ(other_thread, "");
  c.p.window_left = -1;
  c.p.backend = FP_BACKEND_REFERENCE;
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd_select(&c.p, &sel), FP_OK);
  EXPECT_STREQ(fp_last_error(), "");
}

TEST(CApi, NullArgumentsAreInvalid) {
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd(nullptr), FP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp_last_error()).find("params"), std::string::npos);
  EXPECT_EQ(fp_attn_bwd(nullptr), FP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fp_merge_fwd(nullptr), FP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fp_merge_bwd(nullptr), FP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fp_attn_fwd_select(nullptr, &sel), FP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fp_attn_bwd_select(nullptr, &sel), FP_ERR_INVALID_ARGUMENT);
  AttnParams p;
  EXPECT_EQ(fp_attn_fwd_select(&p, nullptr), FP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp_last_error()).find("selection"), std::string::npos);
  EXPECT_EQ(fp_attn_fwd_workspace(&p, nullptr), FP_ERR_INVALID_ARGUMENT);
  fp_attn_params_init(nullptr);  // tolerated
}

TEST(CApi, ExceptionsBecomeRuntimeErrors) {
  EXPECT_EQ(call_at_c_boundary("fp_test", []() -> Status { throw std::bad_alloc(); }), FP_ERR_RUNTIME);
  EXPECT_NE(std::string(fp_last_error()).find("fp_test: out of host memory"), std::string::npos);
  EXPECT_EQ(call_at_c_boundary("fp_test", []() -> Status { throw std::runtime_error("boom"); }),
            FP_ERR_RUNTIME);
  EXPECT_STREQ(fp_last_error(), "fp_test: boom");
  EXPECT_EQ(call_at_c_boundary("fp_test", []() -> Status { throw 42; }), FP_ERR_RUNTIME);
  EXPECT_NE(std::string(fp_last_error()).find("unknown exception"), std::string::npos);
  EXPECT_EQ(call_at_c_boundary("fp_test", [] { return unsupported("nope"); }), FP_ERR_UNSUPPORTED);
  EXPECT_STREQ(fp_last_error(), "nope");
  EXPECT_EQ(call_at_c_boundary("fp_test", [] { return Status::ok(); }), FP_OK);
  EXPECT_STREQ(fp_last_error(), "");
}

TEST(CApi, NamesAndVersion) {
  EXPECT_STREQ(fp_version(), "0.1.0");
  EXPECT_STREQ(fp_status_name(FP_OK), "FP_OK");
  EXPECT_STREQ(fp_status_name(FP_ERR_WORKSPACE), "FP_ERR_WORKSPACE");
  EXPECT_STREQ(fp_status_name(FP_ERR_BACKEND_UNAVAILABLE), "FP_ERR_BACKEND_UNAVAILABLE");
  EXPECT_STREQ(fp_status_name(static_cast<fp_status>(99)), "FP_ERR_UNKNOWN");
  EXPECT_STREQ(fp_backend_name(FP_BACKEND_REFERENCE), "reference");
  EXPECT_STREQ(fp_backend_name(FP_BACKEND_CPU), "cpu");
  EXPECT_STREQ(fp_backend_name(FP_BACKEND_CUDA), "cuda");
  EXPECT_STREQ(fp_backend_name(FP_BACKEND_HIP), "hip");
  EXPECT_STREQ(fp_backend_name(FP_BACKEND_AUTO), "auto");
}

TEST(CApi, BackendAvailability) {
  EXPECT_EQ(fp_backend_available(FP_BACKEND_REFERENCE), 1);
  EXPECT_EQ(fp_backend_available(FP_BACKEND_AUTO), 0);
  EXPECT_EQ(fp_backend_available(static_cast<fp_backend>(50)), 0);
#ifndef FLASHPORT_WITH_CUDA
  EXPECT_EQ(fp_backend_available(FP_BACKEND_CUDA), 0);
#endif
#ifndef FLASHPORT_WITH_HIP
  EXPECT_EQ(fp_backend_available(FP_BACKEND_HIP), 0);
#endif
}

TEST(CppApi, MakeTensorContiguousAndStrided) {
  float buf[24];
  fp_tensor t = make_tensor(buf, FP_F32, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.stride[0], 12);
  EXPECT_EQ(t.stride[1], 4);
  EXPECT_EQ(t.stride[2], 1);
  EXPECT_EQ(t.device_type, FP_DEVICE_CPU);
  fp_tensor g = make_tensor(buf, FP_F16, {4, 3}, {1, 4}, Device::cuda(1));
  EXPECT_EQ(g.stride[0], 1);
  EXPECT_EQ(g.stride[1], 4);
  EXPECT_EQ(g.device_type, FP_DEVICE_CUDA);
  EXPECT_EQ(g.device_index, 1);
  EXPECT_THROW(make_tensor(buf, FP_F32, {2, 3}, {1}), Error);
}

TEST(CppApi, CheckThrowsWithStatusAndMessage) {
  FwdCall c;
  c.p.softcap = -1.0f;
  try {
    attn_fwd(c.p);
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), FP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("softcap"), std::string::npos);
  }
  EXPECT_NO_THROW(check(FP_OK));
  c.p.softcap = 0.0f;
  c.p.backend = FP_BACKEND_REFERENCE;
  fp_selection s = select(c.p);
  EXPECT_EQ(s.backend, FP_BACKEND_REFERENCE);
  EXPECT_EQ(workspace_bytes(c.p), s.workspace_bytes);
  EXPECT_TRUE(backend_available(FP_BACKEND_REFERENCE));
  c.p.backend = static_cast<fp_backend>(77);
  EXPECT_THROW(workspace_bytes(c.p), Error);
}

}  // namespace
}  // namespace flashport::test
