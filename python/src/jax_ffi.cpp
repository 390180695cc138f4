// XLA FFI handlers for flashport.jax, one set per platform (CPU, CUDA). They are built from
// jaxlib's header-only FFI API, so nothing here links against jax. Rules kept here:
//   * workspace comes from a result buffer or XLA's scratch allocator, never malloc, through the
//     C API's workspace_alloc (one resolve and one plan per call);
//   * no device buffer is read on the host (dropout keys go to the kernels as the dropout_rng tensor);
//   * no C++ exception leaves a handler: every failure is returned as an ffi::Error.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <string>

#include "flashport/flashport.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// Presence flags of the optional inputs, which follow the fixed arguments in this order.
enum ExtraFlags : int32_t {
  kHasVarlen = 1,  // cu_seqlens_q, cu_seqlens_k (int32 [B+1])
  kHasAlibi = 2,   // alibi_slopes (fp32 [Hq] or [B, Hq])
  kHasSinks = 4,   // sinks (fp32 [Hq])
  kHasRng = 8,     // dropout seed/offset: uint32 [4] = seed lo, seed hi, offset lo, offset hi
};

bool to_fp_dtype(ffi::DataType t, fp_dtype* out) {
  switch (t) {
    case ffi::DataType::F16: *out = FP_F16; return true;
    case ffi::DataType::BF16: *out = FP_BF16; return true;
    case ffi::DataType::F32: *out = FP_F32; return true;
    case ffi::DataType::F64: *out = FP_F64; return true;
    case ffi::DataType::S32: *out = FP_I32; return true;
    default: return false;
  }
}

// XLA buffers are dense row-major (jax passes the default layout). `dtype`: how flashport reads
// the elements.
ffi::Error view_as(const char* name, const ffi::AnyBuffer& b, fp_dtype dtype, fp_device_type dev,
                   int32_t ordinal, fp_tensor* t) {
  std::memset(t, 0, sizeof(*t));
  t->dtype = dtype;
  const auto dims = b.dimensions();
  if (dims.size() == 0 || dims.size() > FP_MAX_DIMS)
    return ffi::Error::InvalidArgument(std::string("flashport: '") + name + "' has a bad rank");
  t->ndim = static_cast<int32_t>(dims.size());
  int64_t stride = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    t->shape[i] = dims[i];
    t->stride[i] = stride;
    stride *= dims[i];
  }
  t->data = b.untyped_data();
  t->device_type = dev;
  t->device_index = ordinal;
  return ffi::Error::Success();
}

ffi::Error view(const char* name, const ffi::AnyBuffer& b, fp_device_type dev, int32_t ordinal,
                fp_tensor* t) {
  fp_dtype dtype;
  if (!to_fp_dtype(b.element_type(), &dtype))
    return ffi::Error::InvalidArgument(std::string("flashport: '") + name +
                                       "' has an unsupported dtype");
  return view_as(name, b, dtype, dev, ordinal, t);
}

ffi::Error status_error(fp_status s) {
  std::string msg = std::string("flashport: ") + fp_status_name(s) + ": " + fp_last_error();
  return ffi::Error(s == FP_ERR_INVALID_ARGUMENT ? ffi::ErrorCode::kInvalidArgument
                                                 : ffi::ErrorCode::kInternal,
                    msg);
}

#define FP_TRY(expr)                           \
  do {                                         \
    ffi::Error e_ = (expr);                    \
    if (!e_.success()) return e_;              \
  } while (0)

struct ScalarAttrs {
  float softmax_scale, softcap, dropout_p;
  int32_t causal, causal_align, window_left, window_right, num_splits, backend, flags;
  int64_t max_seqlen_q, max_seqlen_k;
};

// Fills the forward params from the fixed and optional inputs; `next` walks the optional ones.
ffi::Error fill_common(fp_attn_params& p, const ScalarAttrs& a, ffi::RemainingArgs& extra,
                       size_t& next, fp_device_type dev, int32_t ordinal) {
  p.softmax_scale = std::isnan(a.softmax_scale) || a.softmax_scale <= 0.f
                        ? std::numeric_limits<float>::quiet_NaN() : a.softmax_scale;
  p.causal = a.causal;
  p.causal_align = static_cast<fp_causal_align>(a.causal_align);
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.softcap = a.softcap;
  p.dropout_p = a.dropout_p;
  p.num_splits = a.num_splits;
  p.backend = static_cast<fp_backend>(a.backend);
  auto take = [&](const char* name, fp_tensor* t) -> ffi::Error {
    auto buf = extra.get<ffi::AnyBuffer>(next++);
    if (buf.has_error()) return buf.error();
    return view(name, *buf, dev, ordinal, t);
  };
  if (a.flags & kHasVarlen) {
    FP_TRY(take("cu_seqlens_q", &p.cu_seqlens_q));
    FP_TRY(take("cu_seqlens_k", &p.cu_seqlens_k));
    p.max_seqlen_q = a.max_seqlen_q;
    p.max_seqlen_k = a.max_seqlen_k;
  }
  if (a.flags & kHasAlibi) FP_TRY(take("alibi_slopes", &p.alibi_slopes));
  if (a.flags & kHasSinks) FP_TRY(take("sinks", &p.sinks));
  if (a.flags & kHasRng) {
    // The key's bits stay where XLA put them: the C API takes them as the dropout_rng tensor and,
    // on a GPU, the kernels read them (no host read of device memory).
    auto buf = extra.get<ffi::AnyBuffer>(next++);
    if (buf.has_error()) return buf.error();
    if (buf->element_type() != ffi::DataType::U32 || buf->element_count() != 4)
      return ffi::Error::InvalidArgument("flashport: dropout rng state must be uint32[4]");
    FP_TRY(view_as("dropout_rng", *buf, FP_I32, dev, ordinal, &p.dropout_rng));  // same 32-bit words
  } else if (a.dropout_p > 0.f) {
    return ffi::Error::InvalidArgument("flashport: dropout_p > 0 needs an rng state");
  }
  return ffi::Error::Success();
}

// The workspace, handed to the C API as its workspace_alloc (called once, after the one plan,
// only when the plan needs workspace): a trailing u8 result that flashport.jax sizes at trace time
// on GPUs (XLA's scratch allocator is not available inside command buffers), else XLA's scratch
// allocator. Never malloc'ed here.
struct WorkspaceSource {
  ffi::ScratchAllocator* scratch;
  ffi::RemainingRets* rets;
  size_t index;  // of the workspace result among the remaining results
  std::string error;
};

void* take_workspace(void* ctx, size_t bytes) noexcept {
  auto* src = static_cast<WorkspaceSource*>(ctx);
  if (src->rets->size() > src->index) {
    auto buf = src->rets->get<ffi::AnyBuffer>(src->index);
    // Sized for another platform's plan: fall back to the scratch allocator.
    if (!buf.has_error() && (*buf)->size_bytes() >= bytes) return (*buf)->untyped_data();
  }
  auto mem = src->scratch->Allocate(bytes, 256);
  if (!mem.has_value()) {
    src->error = "XLA scratch allocation of " + std::to_string(bytes) + " workspace bytes failed";
    return nullptr;
  }
  return *mem;
}

ffi::Error run_error(fp_status s, const WorkspaceSource& ws) {
  if (s == FP_ERR_WORKSPACE && !ws.error.empty())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "flashport: " + ws.error);
  return status_error(s);
}

ffi::Error fwd_impl(fp_device_type dev, void* stream, int32_t ordinal,
                    ffi::ScratchAllocator& scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> lse, ffi::RemainingRets extra_rets,
                    const ScalarAttrs& a) {
  try {
    fp_attn_params p;
    fp_attn_params_init(&p);
    FP_TRY(view("q", q, dev, ordinal, &p.q));
    FP_TRY(view("k", k, dev, ordinal, &p.k));
    FP_TRY(view("v", v, dev, ordinal, &p.v));
    FP_TRY(view("out", *out, dev, ordinal, &p.out));
    FP_TRY(view("lse", *lse, dev, ordinal, &p.lse));
    size_t next = 0;
    FP_TRY(fill_common(p, a, extra, next, dev, ordinal));
    p.stream = stream;
    WorkspaceSource ws{&scratch, &extra_rets, 0, {}};
    p.workspace_alloc = &take_workspace;
    p.workspace_alloc_ctx = &ws;
    const fp_status s = fp_attn_fwd(&p);  // one resolve, one plan, one launch
    if (s != FP_OK) return run_error(s, ws);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("flashport: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("flashport: unknown C++ exception");
  }
}

ffi::Error bwd_impl(fp_device_type dev, void* stream, int32_t ordinal,
                    ffi::ScratchAllocator& scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                    ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    ffi::RemainingRets extra_rets, const ScalarAttrs& a, int32_t deterministic) {
  try {
    fp_attn_bwd_params p;
    fp_attn_bwd_params_init(&p);
    FP_TRY(view("q", q, dev, ordinal, &p.fwd.q));
    FP_TRY(view("k", k, dev, ordinal, &p.fwd.k));
    FP_TRY(view("v", v, dev, ordinal, &p.fwd.v));
    FP_TRY(view("out", out, dev, ordinal, &p.fwd.out));
    FP_TRY(view("lse", lse, dev, ordinal, &p.fwd.lse));
    FP_TRY(view("dout", dout, dev, ordinal, &p.dout));
    FP_TRY(view("dq", *dq, dev, ordinal, &p.dq));
    FP_TRY(view("dk", *dk, dev, ordinal, &p.dk));
    FP_TRY(view("dv", *dv, dev, ordinal, &p.dv));
    size_t next = 0;
    FP_TRY(fill_common(p.fwd, a, extra, next, dev, ordinal));
    if (a.flags & kHasSinks) {
      auto ds = extra_rets.get<ffi::AnyBuffer>(0);
      if (ds.has_error()) return ds.error();
      FP_TRY(view("d_sinks", **ds, dev, ordinal, &p.d_sinks));
    }
    p.deterministic = deterministic;
    p.fwd.stream = stream;
    WorkspaceSource ws{&scratch, &extra_rets, size_t((a.flags & kHasSinks) ? 1 : 0), {}};
    p.fwd.workspace_alloc = &take_workspace;
    p.fwd.workspace_alloc_ctx = &ws;
    const fp_status s = fp_attn_bwd(&p);
    if (s != FP_OK) return run_error(s, ws);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("flashport: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("flashport: unknown C++ exception");
  }
}

#define FP_SCALAR_ATTR_PARAMS                                                              \
  float softmax_scale, int32_t causal, int32_t causal_align, int32_t window_left,          \
      int32_t window_right, float softcap, float dropout_p, int32_t num_splits,             \
      int32_t backend, int32_t flags, int64_t max_seqlen_q, int64_t max_seqlen_k
#define FP_SCALAR_ATTRS_INIT                                                                \
  ScalarAttrs{softmax_scale, softcap,      dropout_p, causal,       causal_align,           \
              window_left,   window_right, num_splits, backend,     flags,                  \
              max_seqlen_q,  max_seqlen_k}
#define FP_BIND_SCALAR_ATTRS                                                                \
  .Attr<float>("softmax_scale")                                                             \
      .Attr<int32_t>("causal")                                                              \
      .Attr<int32_t>("causal_align")                                                        \
      .Attr<int32_t>("window_left")                                                         \
      .Attr<int32_t>("window_right")                                                        \
      .Attr<float>("softcap")                                                               \
      .Attr<float>("dropout_p")                                                             \
      .Attr<int32_t>("num_splits")                                                          \
      .Attr<int32_t>("backend")                                                             \
      .Attr<int32_t>("flags")                                                               \
      .Attr<int64_t>("max_seqlen_q")                                                        \
      .Attr<int64_t>("max_seqlen_k")

ffi::Error fwd_cpu(ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> lse, ffi::RemainingRets extra_rets,
                   FP_SCALAR_ATTR_PARAMS) {
  return fwd_impl(FP_DEVICE_CPU, nullptr, 0, scratch, q, k, v, extra, out, lse, extra_rets,
                  FP_SCALAR_ATTRS_INIT);
}

ffi::Error fwd_cuda(void* stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> lse, ffi::RemainingRets extra_rets,
                    FP_SCALAR_ATTR_PARAMS) {
  return fwd_impl(FP_DEVICE_CUDA, stream, ordinal, scratch, q, k, v, extra, out, lse, extra_rets,
                  FP_SCALAR_ATTRS_INIT);
}

ffi::Error bwd_cpu(ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                   ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::RemainingRets extra_rets, FP_SCALAR_ATTR_PARAMS, int32_t deterministic) {
  return bwd_impl(FP_DEVICE_CPU, nullptr, 0, scratch, q, k, v, out, lse, dout, extra, dq, dk, dv,
                  extra_rets, FP_SCALAR_ATTRS_INIT, deterministic);
}

ffi::Error bwd_cuda(void* stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                    ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::RemainingArgs extra,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, ffi::RemainingRets extra_rets,
                    FP_SCALAR_ATTR_PARAMS, int32_t deterministic) {
  return bwd_impl(FP_DEVICE_CUDA, stream, ordinal, scratch, q, k, v, out, lse, dout, extra, dq,
                  dk, dv, extra_rets, FP_SCALAR_ATTRS_INIT, deterministic);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportFwdCpu, fwd_cpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets() FP_BIND_SCALAR_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportFwdCuda, fwd_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets() FP_BIND_SCALAR_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportBwdCpu, bwd_cpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets() FP_BIND_SCALAR_ATTRS
                                  .Attr<int32_t>("deterministic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportBwdCuda, bwd_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets() FP_BIND_SCALAR_ATTRS
                                  .Attr<int32_t>("deterministic"));

nb::dict jax_ffi_targets() {
  nb::dict d;
  d["flashport_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(FlashportFwdCpu));
  d["flashport_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(FlashportBwdCpu));
  d["flashport_fwd_cuda"] = nb::capsule(reinterpret_cast<void*>(FlashportFwdCuda));
  d["flashport_bwd_cuda"] = nb::capsule(reinterpret_cast<void*>(FlashportBwdCuda));
  return d;
}
