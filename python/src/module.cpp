// flashport._C: the one compiled extension. It turns DLPack tensors into fp_tensor views and
// calls the C API; torch- and jax-specific logic lives in Python (flashport/torch.py, jax.py),
// so the extension is compiled against no framework and works with any torch or jax version.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "flashport/flashport.h"
#include "tensor_view.hpp"

namespace nb = nanobind;
using flashport_py::dlpack_device_to_fp;
using flashport_py::dlpack_dtype_to_fp;

namespace {

// Raise the C API's error as a Python exception: bad arguments are ValueError, the rest
// RuntimeError; the message is the library's own.
void raise_status(fp_status s) {
  std::string msg = std::string("flashport: ") + fp_status_name(s) + ": " + fp_last_error();
  if (s == FP_ERR_INVALID_ARGUMENT) throw nb::value_error(msg.c_str());
  throw std::runtime_error(msg);
}

// Holds the ndarrays (and so the producers' memory) alive for the duration of a call.
using KeepAlive = std::vector<nb::ndarray<>>;

fp_tensor to_fp_tensor(const std::string& name, nb::handle obj, KeepAlive& keep) {
  fp_tensor t;
  std::memset(&t, 0, sizeof(t));
  if (obj.is_none()) return t;
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a, /*convert=*/false))
    throw nb::value_error(("flashport: argument '" + name +
                           "' is not a DLPack tensor (pass a torch/jax/numpy array)").c_str());
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes != 1 || !dlpack_dtype_to_fp(dt.code, dt.bits, &t.dtype))
    throw nb::value_error(("flashport: argument '" + name +
                           "' has an unsupported dtype (need float16, bfloat16, float32, "
                           "float64 or int32)").c_str());
  if (a.ndim() > FP_MAX_DIMS || a.ndim() == 0)
    throw nb::value_error(("flashport: argument '" + name + "' has " + std::to_string(a.ndim()) +
                           " dimensions; between 1 and " + std::to_string(FP_MAX_DIMS) +
                           " are allowed").c_str());
  if (!dlpack_device_to_fp(a.device_type(), &t.device_type))
    throw nb::value_error(("flashport: argument '" + name +
                           "' lives on a device flashport does not support").c_str());
  t.device_index = a.device_id();
  t.ndim = static_cast<int32_t>(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  t.data = const_cast<void*>(a.data());
  keep.push_back(std::move(a));
  return t;
}

fp_tensor* fwd_tensor_field(fp_attn_params& p, const std::string& n) {
  if (n == "q") return &p.q;
  if (n == "k") return &p.k;
  if (n == "v") return &p.v;
  if (n == "out") return &p.out;
  if (n == "lse") return &p.lse;
  if (n == "cu_seqlens_q") return &p.cu_seqlens_q;
  if (n == "cu_seqlens_k") return &p.cu_seqlens_k;
  if (n == "seqused_k") return &p.seqused_k;
  if (n == "block_table") return &p.block_table;
  if (n == "cache_batch_idx") return &p.cache_batch_idx;
  if (n == "k_new") return &p.k_new;
  if (n == "v_new") return &p.v_new;
  if (n == "rotary_cos") return &p.rotary_cos;
  if (n == "rotary_sin") return &p.rotary_sin;
  if (n == "alibi_slopes") return &p.alibi_slopes;
  if (n == "sinks") return &p.sinks;
  // int32 [4] {seed lo, seed hi, offset lo, offset hi}, on the tensors' device: the kernels read
  // the dropout (seed, offset) from it (graph-safe RNG state). Backward reaches it through here too.
  if (n == "dropout_rng") return &p.dropout_rng;
  return nullptr;
}

fp_tensor* bwd_tensor_field(fp_attn_bwd_params& p, const std::string& n) {
  if (n == "dout") return &p.dout;
  if (n == "dq") return &p.dq;
  if (n == "dk") return &p.dk;
  if (n == "dv") return &p.dv;
  if (n == "d_sinks") return &p.d_sinks;
  return fwd_tensor_field(p.fwd, n);
}

bool set_fwd_scalar(fp_attn_params& p, const std::string& n, nb::handle v) {
  auto i32 = [&] { return nb::cast<int32_t>(v); };
  auto f32 = [&] { return nb::cast<float>(v); };
  if (n == "max_seqlen_q") p.max_seqlen_q = nb::cast<int64_t>(v);
  else if (n == "max_seqlen_k") p.max_seqlen_k = nb::cast<int64_t>(v);
  else if (n == "rotary_interleaved") p.rotary_interleaved = i32();
  else if (n == "softmax_scale")
    p.softmax_scale = v.is_none() ? std::numeric_limits<float>::quiet_NaN() : f32();
  else if (n == "causal") p.causal = i32();
  else if (n == "causal_align") p.causal_align = static_cast<fp_causal_align>(i32());
  else if (n == "window_left") p.window_left = i32();
  else if (n == "window_right") p.window_right = i32();
  else if (n == "softcap") p.softcap = f32();
  else if (n == "dropout_p") p.dropout_p = f32();
  else if (n == "dropout_seed") p.dropout_seed = nb::cast<uint64_t>(v);
  else if (n == "dropout_offset") p.dropout_offset = nb::cast<uint64_t>(v);
  else if (n == "num_splits") p.num_splits = i32();
  else if (n == "backend") p.backend = static_cast<fp_backend>(i32());
  else if (n == "num_threads") p.num_threads = i32();
  else return false;
  return true;
}

[[noreturn]] void unknown(const char* what, const std::string& n) {
  throw nb::value_error((std::string("flashport: unknown ") + what + " '" + n + "'").c_str());
}

void fill_fwd(fp_attn_params& p, nb::dict tensors, nb::dict scalars, KeepAlive& keep) {
  for (auto [key, val] : tensors) {
    const std::string n = nb::cast<std::string>(key);
    fp_tensor* f = fwd_tensor_field(p, n);
    if (!f) unknown("tensor argument", n);
    *f = to_fp_tensor(n, val, keep);
  }
  for (auto [key, val] : scalars) {
    const std::string n = nb::cast<std::string>(key);
    if (!set_fwd_scalar(p, n, val)) unknown("scalar argument", n);
  }
}

nb::dict selection_dict(const fp_selection& s) {
  nb::dict d;
  d["backend"] = fp_backend_name(s.backend);
  d["kernel"] = std::string(s.kernel);
  d["workspace_bytes"] = s.workspace_bytes;
  d["num_splits"] = s.num_splits;
  return d;
}

void set_exec(void*& stream, uintptr_t stream_ptr) { stream = reinterpret_cast<void*>(stream_ptr); }

// ---- forward ------------------------------------------------------------------------------
nb::dict attn_fwd_select(nb::dict tensors, nb::dict scalars, uintptr_t stream) {
  KeepAlive keep;
  fp_attn_params p;
  fp_attn_params_init(&p);
  fill_fwd(p, tensors, scalars, keep);
  set_exec(p.stream, stream);
  fp_selection sel;
  const fp_status s = fp_attn_fwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  return selection_dict(sel);
}

// Selects, asks `alloc(nbytes) -> int pointer` for the workspace (the caller's allocator, e.g.
// torch's caching allocator; it keeps the memory alive), then runs.
void* workspace_from(nb::handle alloc, size_t bytes) {
  if (bytes == 0) return nullptr;
  if (alloc.is_none())
    throw std::runtime_error("flashport: the call needs " + std::to_string(bytes) +
                             " bytes of workspace but no allocator was given");
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(alloc(bytes)));
}

void attn_fwd(nb::dict tensors, nb::dict scalars, uintptr_t stream, nb::handle alloc) {
  KeepAlive keep;
  fp_attn_params p;
  fp_attn_params_init(&p);
  fill_fwd(p, tensors, scalars, keep);
  set_exec(p.stream, stream);
  fp_selection sel;
  fp_status s = fp_attn_fwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  p.workspace = workspace_from(alloc, sel.workspace_bytes);
  p.workspace_bytes = sel.workspace_bytes;
  {
    nb::gil_scoped_release release;
    s = fp_attn_fwd(&p);
  }
  if (s != FP_OK) raise_status(s);
}

// ---- backward -----------------------------------------------------------------------------
void fill_bwd(fp_attn_bwd_params& p, nb::dict tensors, nb::dict scalars, KeepAlive& keep) {
  for (auto [key, val] : tensors) {
    const std::string n = nb::cast<std::string>(key);
    fp_tensor* f = bwd_tensor_field(p, n);
    if (!f) unknown("tensor argument", n);
    *f = to_fp_tensor(n, val, keep);
  }
  for (auto [key, val] : scalars) {
    const std::string n = nb::cast<std::string>(key);
    if (n == "deterministic") p.deterministic = nb::cast<int32_t>(val);
    else if (!set_fwd_scalar(p.fwd, n, val)) unknown("scalar argument", n);
  }
}

nb::dict attn_bwd_select(nb::dict tensors, nb::dict scalars, uintptr_t stream) {
  KeepAlive keep;
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  fill_bwd(p, tensors, scalars, keep);
  set_exec(p.fwd.stream, stream);
  fp_selection sel;
  const fp_status s = fp_attn_bwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  return selection_dict(sel);
}

void attn_bwd(nb::dict tensors, nb::dict scalars, uintptr_t stream, nb::handle alloc) {
  KeepAlive keep;
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  fill_bwd(p, tensors, scalars, keep);
  set_exec(p.fwd.stream, stream);
  fp_selection sel;
  fp_status s = fp_attn_bwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  p.fwd.workspace = workspace_from(alloc, sel.workspace_bytes);
  p.fwd.workspace_bytes = sel.workspace_bytes;
  {
    nb::gil_scoped_release release;
    s = fp_attn_bwd(&p);
  }
  if (s != FP_OK) raise_status(s);
}

// ---- workspace from shapes alone (JAX on GPU) ------------------------------------------------
// XLA sizes buffers at trace time, before any data exists. GPU planning reads no device memory
// (a library rule), so a call described by shapes with placeholder pointers selects exactly as
// the real call will; flashport.jax turns the answer into a workspace result buffer.
bool dtype_from_name(const std::string& n, fp_dtype* t) {
  if (n == "float16") *t = FP_F16;
  else if (n == "bfloat16") *t = FP_BF16;
  else if (n == "float32") *t = FP_F32;
  else if (n == "float64") *t = FP_F64;
  else if (n == "int32") *t = FP_I32;
  else return false;
  return true;
}

size_t gpu_workspace_bytes(const std::string& op, nb::dict meta, nb::dict scalars,
                           int32_t device_index) {
  if (op != "fwd" && op != "bwd") throw nb::value_error("flashport: op must be 'fwd' or 'bwd'");
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  for (auto [key, val] : meta) {
    const std::string n = nb::cast<std::string>(key);
    fp_tensor* f = op == "fwd" ? fwd_tensor_field(p.fwd, n) : bwd_tensor_field(p, n);
    if (!f) unknown("tensor argument", n);
    nb::tuple spec = nb::cast<nb::tuple>(val);  // (dtype name, shape)
    std::memset(f, 0, sizeof(*f));
    if (!dtype_from_name(nb::cast<std::string>(spec[0]), &f->dtype))
      throw nb::value_error(("flashport: argument '" + n + "' has an unsupported dtype").c_str());
    nb::tuple shape = nb::cast<nb::tuple>(spec[1]);
    if (shape.size() == 0 || shape.size() > FP_MAX_DIMS)
      throw nb::value_error(("flashport: argument '" + n + "' has a bad rank").c_str());
    f->ndim = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int i = f->ndim - 1; i >= 0; --i) {
      f->shape[i] = nb::cast<int64_t>(shape[i]);
      f->stride[i] = stride;
      stride *= f->shape[i] > 0 ? f->shape[i] : 1;
    }
    f->data = reinterpret_cast<void*>(uintptr_t(256));  // never dereferenced by planning
    f->device_type = FP_DEVICE_CUDA;
    f->device_index = device_index;
  }
  for (auto [key, val] : scalars) {
    const std::string n = nb::cast<std::string>(key);
    if (op == "bwd" && n == "deterministic") p.deterministic = nb::cast<int32_t>(val);
    else if (!set_fwd_scalar(p.fwd, n, val)) unknown("scalar argument", n);
  }
  fp_selection sel;
  const fp_status s = op == "fwd" ? fp_attn_fwd_select(&p.fwd, &sel) : fp_attn_bwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  return sel.workspace_bytes;
}

// ---- merge --------------------------------------------------------------------------------
fp_tensor* merge_field(fp_merge_bwd_params& p, const std::string& n) {
  if (n == "out_partials") return &p.fwd.out_partials;
  if (n == "lse_partials") return &p.fwd.lse_partials;
  if (n == "out") return &p.fwd.out;
  if (n == "lse") return &p.fwd.lse;
  if (n == "dout") return &p.dout;
  if (n == "dlse") return &p.dlse;
  if (n == "d_out_partials") return &p.d_out_partials;
  if (n == "d_lse_partials") return &p.d_lse_partials;
  return nullptr;
}

void merge(nb::dict tensors, int32_t backend, uintptr_t stream, bool backward) {
  KeepAlive keep;
  fp_merge_bwd_params p;
  fp_merge_bwd_params_init(&p);
  for (auto [key, val] : tensors) {
    const std::string n = nb::cast<std::string>(key);
    fp_tensor* f = merge_field(p, n);
    if (!f || (!backward && n.rfind("d", 0) == 0)) unknown("tensor argument", n);
    *f = to_fp_tensor(n, val, keep);
  }
  p.fwd.backend = static_cast<fp_backend>(backend);
  p.fwd.stream = reinterpret_cast<void*>(stream);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = backward ? fp_merge_bwd(&p) : fp_merge_fwd(&p.fwd);
  }
  if (s != FP_OK) raise_status(s);
}

// The dropout keep pattern of the contract (Philox rule in src/core/philox.hpp), for S_dmask
// (flash_attn's return_attn_probs). Host computation; only used on that testing path.
nb::ndarray<nb::numpy, uint8_t> dropout_keep_mask(uint64_t seed, uint64_t offset, int64_t batch,
                                                  int64_t hq, int64_t sq, int64_t sk,
                                                  float dropout_p) {
  if (batch < 0 || hq < 0 || sq < 0 || sk < 0) throw nb::value_error("negative size");
  const size_t n = static_cast<size_t>(batch * hq * sq * sk);
  uint8_t* buf = new uint8_t[n ? n : 1];
  nb::capsule owner(buf, [](void* ptr) noexcept { delete[] static_cast<uint8_t*>(ptr); });
  const uint32_t threshold = flashport::dropout_threshold(dropout_p);
  size_t idx = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t j = 0; j < sk; ++j)
          buf[idx++] = flashport::dropout_keep(seed, offset, threshold, b, hq, h, i, j) ? 1 : 0;
  size_t shape[4] = {size_t(batch), size_t(hq), size_t(sq), size_t(sk)};
  return nb::ndarray<nb::numpy, uint8_t>(buf, 4, shape, owner);
}

}  // namespace

#ifdef FLASHPORT_WITH_JAX_FFI
nb::dict jax_ffi_targets();  // jax_ffi.cpp
#endif

NB_MODULE(_C, m) {
  m.doc() = "flashport C API over DLPack (framework-independent)";
  m.def("gpu_workspace_bytes", &gpu_workspace_bytes, nb::arg("op"), nb::arg("meta"),
        nb::arg("scalars"), nb::arg("device_index") = 0,
        "Workspace bytes a CUDA call of these shapes needs: meta {name: (dtype, shape)}.");
  m.def("attn_fwd_select", &attn_fwd_select, nb::arg("tensors"), nb::arg("scalars"),
        nb::arg("stream") = 0);
  m.def("attn_fwd", &attn_fwd, nb::arg("tensors"), nb::arg("scalars"), nb::arg("stream") = 0,
        nb::arg("alloc").none() = nb::none());
  m.def("attn_bwd_select", &attn_bwd_select, nb::arg("tensors"), nb::arg("scalars"),
        nb::arg("stream") = 0);
  m.def("attn_bwd", &attn_bwd, nb::arg("tensors"), nb::arg("scalars"), nb::arg("stream") = 0,
        nb::arg("alloc").none() = nb::none());
  m.def("merge_fwd", [](nb::dict t, int32_t backend, uintptr_t stream) {
    merge(t, backend, stream, false);
  }, nb::arg("tensors"), nb::arg("backend") = 0, nb::arg("stream") = 0);
  m.def("merge_bwd", [](nb::dict t, int32_t backend, uintptr_t stream) {
    merge(t, backend, stream, true);
  }, nb::arg("tensors"), nb::arg("backend") = 0, nb::arg("stream") = 0);
  m.def("dropout_keep_mask", &dropout_keep_mask);
  m.def("version", [] { return std::string(fp_version()); });
  m.def("backend_available",
        [](int32_t b) { return fp_backend_available(static_cast<fp_backend>(b)) != 0; });
  m.def("backend_name",
        [](int32_t b) { return std::string(fp_backend_name(static_cast<fp_backend>(b))); });
#ifdef FLASHPORT_WITH_JAX_FFI
  m.def("jax_ffi_targets", &jax_ffi_targets);
  m.attr("has_jax_ffi") = true;
#else
  m.attr("has_jax_ffi") = false;
#endif
}
