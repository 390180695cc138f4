// flashport._C: the one compiled extension. Typed, positional functions that turn tensors into
// fp_tensor views and call the C API once; torch- and jax-specific logic lives in Python
// (flashport/torch.py, jax.py), so the extension is compiled against no framework and works with
// any torch (>= 2.4) or jax version.
//
// How a tensor crosses (read_tensor):
//   * torch >= 2.9: torch's C-level DLPack exchange table (`__dlpack_c_exchange_api__`): a
//     non-owning DLTensor per tensor, the current stream and the workspace from torch's caching
//     allocator, all without a Python object;
//   * older torch: the tensor's data_ptr(), shape, stride(), dtype and device attributes;
//   * anything else (numpy, ...): a DLPack capsule through nanobind (CPU only).
// flashport.torch tells the extension which route torch offers once, at import (set_torch).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dlpack_exchange.hpp"
#include "flashport/flashport.h"
#include "tensor_view.hpp"

namespace nb = nanobind;
namespace dlx = flashport_py::dlx;
using flashport_py::dlpack_device_to_fp;
using flashport_py::dlpack_dtype_to_fp;

namespace {

// ---- what torch offers (set once by flashport.torch) -----------------------------------------
// Python objects held here are strong references that are never released: they live as long as
// the process (releasing them at interpreter teardown would run after Python has finalized).
struct TorchBridge {
  PyTypeObject* tensor_type = nullptr;  // torch.Tensor; subclasses are read the same way
  const dlx::Api* api = nullptr;        // the C exchange table (torch >= 2.9), else null
  // Attribute route (older torch): dtype objects in fp_dtype order, and two callables.
  PyObject* dtypes[5] = {};             // torch.float16, bfloat16, float32, float64, int32
  PyObject* current_stream = nullptr;   // device index -> raw stream handle (int)
  PyObject* empty = nullptr;            // (shape, dtype code, device index) -> new tensor
  fp_device_type gpu_device = FP_DEVICE_CUDA;  // FP_DEVICE_HIP under a ROCm build of torch
  int32_t gpu_dlpack = dlx::kDLCUDA;
  PyObject* s_data_ptr = nullptr;       // interned attribute names
  PyObject* s_shape = nullptr;
  PyObject* s_stride = nullptr;
  PyObject* s_dtype = nullptr;
  PyObject* s_is_cuda = nullptr;
  PyObject* s_get_device = nullptr;
};
TorchBridge g_torch;

// Raise the C API's error as a Python exception: bad arguments are ValueError, the rest
// RuntimeError; the message is the library's own (plus the allocator's, if it failed).
[[noreturn]] void raise_status(fp_status s, const std::string& extra = std::string()) {
  std::string msg = std::string("flashport: ") + fp_status_name(s) + ": " + fp_last_error();
  if (!extra.empty()) msg += " (" + extra + ")";
  if (s == FP_ERR_INVALID_ARGUMENT) throw nb::value_error(msg.c_str());
  throw std::runtime_error(msg);
}

[[noreturn]] void bad_argument(const char* name, const std::string& rule) {
  throw nb::value_error((std::string("flashport: argument '") + name + "' " + rule).c_str());
}

// ---- one call's state: where it runs, what it holds -------------------------------------------
struct Call {
  bool torch_inputs = false;            // every given tensor came through the torch bridge
  bool on_gpu = false;
  int32_t gpu_index = 0;
  std::vector<nb::ndarray<>> capsules;  // the non-torch inputs' DLPack views (kept alive)
  std::vector<nb::object> copies;       // contiguous copies of strided inputs
  dlx::ManagedTensor* workspace = nullptr;  // from torch's allocator (C route), freed after
  nb::object workspace_tensor;          // from torch's allocator (attribute route)
  std::string alloc_error;

  Call() = default;
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  ~Call() {
    // Stream-ordered caching allocator: freeing after the launch is safe (work queued on the
    // call's stream runs before any reuse of the block on that stream).
    if (workspace && workspace->deleter) workspace->deleter(workspace);
  }

  // The device of new outputs and workspace: that of the call's GPU tensors, else the CPU.
  int32_t dlpack_device() const { return on_gpu ? g_torch.gpu_dlpack : dlx::kDLCPU; }
  int32_t device_index() const { return on_gpu ? gpu_index : -1; }

  void note_device(const fp_tensor& t) {
    if (t.device_type != FP_DEVICE_CPU && !on_gpu) {
      on_gpu = true;
      gpu_index = t.device_index;
    }
  }
};

void shape_from(const char* name, int32_t ndim, const int64_t* shape, const int64_t* strides,
                fp_tensor* t) {
  if (ndim <= 0 || ndim > FP_MAX_DIMS)
    bad_argument(name, "has " + std::to_string(ndim) + " dimensions; between 1 and " +
                           std::to_string(FP_MAX_DIMS) + " are allowed");
  t->ndim = ndim;
  int64_t compact = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    t->shape[i] = shape[i];
    t->stride[i] = strides ? strides[i] : compact;  // no strides: compact row-major
    compact *= shape[i] > 0 ? shape[i] : 1;
  }
}

void dtype_from_dlpack(const char* name, uint8_t code, uint8_t bits, uint16_t lanes,
                       fp_tensor* t) {
  if (lanes != 1 || !dlpack_dtype_to_fp(code, bits, &t->dtype))
    bad_argument(name, "has an unsupported dtype (need float16, bfloat16, float32, float64 or "
                       "int32)");
}

void read_exchange(const char* name, PyObject* obj, fp_tensor* t) {
  dlx::DLTensor dl;
  if (g_torch.api->dltensor_from_py_object_no_sync(obj, &dl) != 0) throw nb::python_error();
  dtype_from_dlpack(name, dl.dtype.code, dl.dtype.bits, dl.dtype.lanes, t);
  if (!dlpack_device_to_fp(dl.device.device_type, &t->device_type))
    bad_argument(name, "lives on a device flashport does not support");
  t->device_index = dl.device.device_id;
  shape_from(name, dl.ndim, dl.shape, dl.strides, t);
  t->data = static_cast<char*>(dl.data) + dl.byte_offset;
}

nb::object attr(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

nb::object call_method(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodObjArgs(obj, name, nullptr);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

void read_int_tuple(const char* name, PyObject* tup, int64_t* out, Py_ssize_t n) {
  if (!PyTuple_Check(tup) || PyTuple_GET_SIZE(tup) != n) bad_argument(name, "has a bad shape");
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tup, i));
    if (out[i] == -1 && PyErr_Occurred()) throw nb::python_error();
  }
}

// Older torch: the attributes a tensor has had since torch 1.x.
void read_attributes(const char* name, PyObject* obj, fp_tensor* t) {
  nb::object dtype = attr(obj, g_torch.s_dtype);
  bool known = false;
  for (int i = 0; i < 5; ++i)
    if (dtype.ptr() == g_torch.dtypes[i]) {
      t->dtype = static_cast<fp_dtype>(i);
      known = true;
    }
  if (!known)
    bad_argument(name, "has an unsupported dtype (need float16, bfloat16, float32, float64 or "
                       "int32)");
  nb::object shape = attr(obj, g_torch.s_shape);
  const Py_ssize_t ndim = PyTuple_Check(shape.ptr()) ? PyTuple_GET_SIZE(shape.ptr()) : -1;
  if (ndim <= 0 || ndim > FP_MAX_DIMS)
    bad_argument(name, "has " + std::to_string(ndim) + " dimensions; between 1 and " +
                           std::to_string(FP_MAX_DIMS) + " are allowed");
  int64_t dims[FP_MAX_DIMS], strides[FP_MAX_DIMS];
  read_int_tuple(name, shape.ptr(), dims, ndim);
  read_int_tuple(name, call_method(obj, g_torch.s_stride).ptr(), strides, ndim);
  shape_from(name, static_cast<int32_t>(ndim), dims, strides, t);
  t->data = PyLong_AsVoidPtr(call_method(obj, g_torch.s_data_ptr).ptr());
  if (!t->data && PyErr_Occurred()) throw nb::python_error();
  const bool gpu = attr(obj, g_torch.s_is_cuda).ptr() == Py_True;
  t->device_type = gpu ? g_torch.gpu_device : FP_DEVICE_CPU;
  t->device_index = gpu ? nb::cast<int32_t>(call_method(obj, g_torch.s_get_device)) : 0;
}

// Anything else that speaks DLPack (numpy, ...), through a capsule: CPU memory only, since the
// stream such a producer runs on is not known here.
void read_capsule(const char* name, PyObject* obj, fp_tensor* t, Call& call) {
  nb::ndarray<> a;
  if (!nb::try_cast(nb::handle(obj), a, /*convert=*/false))
    bad_argument(name, "is not a tensor (pass a torch tensor or a DLPack array)");
  const nb::dlpack::dtype dt = a.dtype();
  dtype_from_dlpack(name, dt.code, dt.bits, dt.lanes, t);
  if (!dlpack_device_to_fp(a.device_type(), &t->device_type) || t->device_type != FP_DEVICE_CPU)
    bad_argument(name, "is a non-torch array outside CPU memory (pass torch tensors for GPU "
                       "calls: their stream and allocator are torch's)");
  int64_t dims[FP_MAX_DIMS] = {}, strides[FP_MAX_DIMS] = {};
  const size_t ndim = a.ndim();
  for (size_t i = 0; i < ndim && i < FP_MAX_DIMS; ++i) {
    dims[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = a.stride(i);
  }
  shape_from(name, static_cast<int32_t>(ndim), dims, strides, t);
  t->data = const_cast<void*>(a.data());
  call.capsules.push_back(std::move(a));
}

// How the call uses an argument. An input's last dimension is made contiguous (a copy, as
// flash_attn does) when it is not; an output or an in-place argument is used as given.
enum class Role { input, output, in_place };

void read_tensor(const char* name, nb::handle h, fp_tensor* t, Call& call,
                 Role role = Role::input);

// A torch tensor whose last dimension is strided: `obj.contiguous()` for an input (held by the
// call), a named error for an argument written in place.
void make_last_dim_contiguous(const char* name, PyObject* obj, fp_tensor* t, Call& call,
                              Role role) {
  if (role == Role::in_place)
    bad_argument(name, "must have a contiguous last dimension (it is written in place)");
  PyObject* c = PyObject_CallMethod(obj, "contiguous", nullptr);
  if (!c) throw nb::python_error();
  call.copies.push_back(nb::steal(c));
  read_tensor(name, call.copies.back(), t, call, Role::output);
}

// One argument: None (absent) or a tensor.
void read_tensor(const char* name, nb::handle h, fp_tensor* t, Call& call, Role role) {
  std::memset(t, 0, sizeof(*t));
  PyObject* obj = h.ptr();
  if (obj == Py_None) return;
  const bool is_torch = g_torch.tensor_type &&
                        (Py_TYPE(obj) == g_torch.tensor_type ||
                         PyType_IsSubtype(Py_TYPE(obj), g_torch.tensor_type));
  if (is_torch && g_torch.api) {
    read_exchange(name, obj, t);
  } else if (is_torch) {
    read_attributes(name, obj, t);
  } else {
    read_capsule(name, obj, t, call);
  }
  call.torch_inputs = call.capsules.empty();
  call.note_device(*t);
  if (is_torch && role != Role::output && t->stride[t->ndim - 1] != 1 && t->shape[t->ndim - 1] > 1)
    make_last_dim_contiguous(name, obj, t, call, role);
}

// The stream a GPU call runs on: torch's current stream of the tensors' device.
void* current_stream(const Call& call) {
  if (!call.on_gpu) return nullptr;
  if (!call.torch_inputs)
    throw nb::value_error("flashport: GPU calls take torch tensors (their current stream and "
                          "caching allocator are used)");
  if (g_torch.api) {
    void* stream = nullptr;
    if (g_torch.api->current_work_stream(g_torch.gpu_dlpack, call.gpu_index, &stream) != 0)
      throw nb::python_error();
    return stream;
  }
  nb::object s = nb::steal(PyObject_CallFunction(g_torch.current_stream, "i", call.gpu_index));
  if (!s.is_valid()) throw nb::python_error();
  return PyLong_AsVoidPtr(s.ptr());
}

void record_alloc_error(void* ctx, const char* kind, const char* message) {
  *static_cast<std::string*>(ctx) = std::string(kind ? kind : "error") + ": " +
                                    (message ? message : "");
}

// DLPack dtype codes of the fp_dtypes (fp_dtype order) and of the workspace's bytes (last).
constexpr nb::dlpack::dtype kDlpackDtypes[6] = {{2, 16, 1}, {4, 16, 1}, {2, 32, 1},
                                                {2, 64, 1}, {0, 32, 1}, {dlx::kDLUInt, 8, 1}};
constexpr int kBytesCode = 5;

// A new contiguous tensor from torch's allocator (the C table; may run without the GIL), or null
// with the reason in `error`.
dlx::ManagedTensor* managed_empty(int code, int32_t ndim, const int64_t* shape, const Call& call,
                                  std::string* error) noexcept {
  dlx::DLTensor proto;
  proto.data = nullptr;
  proto.device = {call.dlpack_device(), call.on_gpu ? call.gpu_index : 0};
  proto.ndim = ndim;
  proto.dtype = kDlpackDtypes[code];
  proto.shape = const_cast<int64_t*>(shape);
  proto.strides = nullptr;
  proto.byte_offset = 0;
  dlx::ManagedTensor* mt = nullptr;
  if (g_torch.api->managed_tensor_allocator(&proto, &mt, error, &record_alloc_error) != 0)
    return nullptr;
  return mt;
}

// A tensor shape.
struct Dims {
  int32_t ndim = 0;
  int64_t d[FP_MAX_DIMS] = {};
};

// A new contiguous torch tensor on the call's device (GIL held).
nb::object new_tensor(int code, const Dims& dims, const Call& call) {
  if (!call.torch_inputs)
    throw nb::value_error("flashport: outputs must be given when the inputs are not torch tensors");
  const int64_t* shape = dims.d;
  const int32_t ndim = dims.ndim;
  if (g_torch.api) {
    std::string error;
    dlx::ManagedTensor* mt = managed_empty(code, ndim, shape, call, &error);
    if (!mt) throw std::runtime_error("flashport: allocating an output failed: " + error);
    void* obj = nullptr;
    if (g_torch.api->managed_tensor_to_py_object_no_sync(mt, &obj) != 0) throw nb::python_error();
    return nb::steal(static_cast<PyObject*>(obj));
  }
  nb::tuple shape_tuple = nb::steal<nb::tuple>(PyTuple_New(ndim));
  for (int32_t i = 0; i < ndim; ++i)
    PyTuple_SET_ITEM(shape_tuple.ptr(), i, PyLong_FromLongLong(shape[i]));
  PyObject* t = PyObject_CallFunction(g_torch.empty, "Oii", shape_tuple.ptr(), code,
                                      call.device_index());
  if (!t) throw nb::python_error();
  return nb::steal(t);
}

// The C API's workspace_alloc: called once per call, after planning, only when the plan needs
// workspace; the memory comes from torch's caching allocator on the tensors' device.
void* workspace_alloc(void* ctx, size_t bytes) noexcept {
  auto* call = static_cast<Call*>(ctx);
  if (!call->torch_inputs) {
    call->alloc_error = "this call needs workspace; pass torch tensors so that torch's "
                        "allocator provides it";
    return nullptr;
  }
  const int64_t shape = static_cast<int64_t>(bytes);
  if (g_torch.api) {  // runs with the GIL released, as torch's table allows
    dlx::ManagedTensor* mt = managed_empty(kBytesCode, 1, &shape, *call, &call->alloc_error);
    if (!mt) return nullptr;
    call->workspace = mt;
    return static_cast<char*>(mt->dl_tensor.data) + mt->dl_tensor.byte_offset;
  }
  nb::gil_scoped_acquire gil;
  try {
    call->workspace_tensor = new_tensor(kBytesCode, Dims{1, {shape}}, *call);
    // Raw bytes (no fp_dtype describes them): only the address is needed.
    nb::object ptr = call->workspace_tensor.attr("data_ptr")();
    return PyLong_AsVoidPtr(ptr.ptr());
  } catch (const std::exception& e) {
    call->alloc_error = e.what();
    return nullptr;
  }
}

void set_execution(fp_attn_params& p, Call& call) {
  p.stream = current_stream(call);
  p.workspace_alloc = &workspace_alloc;
  p.workspace_alloc_ctx = &call;
}

float scale_or_default(double softmax_scale) {
  return std::isnan(softmax_scale) ? std::numeric_limits<float>::quiet_NaN()
                                   : static_cast<float>(softmax_scale);
}

// ---- forward and backward ---------------------------------------------------------------------
// The argument order of each function is that of the custom op in flashport/torch.py (outputs
// after the inputs they are shaped like), so Python passes its arguments straight through.

struct FwdArgs {
  nb::handle q, k, v, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  nb::handle block_table, seqused_k, alibi_slopes, sinks, dropout_rng;
  double dropout_p, softmax_scale;
  int32_t causal;
  int32_t window_left, window_right;
  double softcap;
  int32_t causal_align, num_splits, backend;
};

void fill_fwd(fp_attn_params& p, const FwdArgs& a, Call& call) {
  read_tensor("q", a.q, &p.q, call);
  read_tensor("k", a.k, &p.k, call);
  read_tensor("v", a.v, &p.v, call);
  read_tensor("cu_seqlens_q", a.cu_seqlens_q, &p.cu_seqlens_q, call);
  read_tensor("cu_seqlens_k", a.cu_seqlens_k, &p.cu_seqlens_k, call);
  read_tensor("block_table", a.block_table, &p.block_table, call);
  read_tensor("seqused_k", a.seqused_k, &p.seqused_k, call);
  read_tensor("alibi_slopes", a.alibi_slopes, &p.alibi_slopes, call);
  read_tensor("sinks", a.sinks, &p.sinks, call);
  // int32 [4] {seed lo, seed hi, offset lo, offset hi} on the tensors' device (graph-safe RNG).
  read_tensor("dropout_rng", a.dropout_rng, &p.dropout_rng, call);
  if (p.cu_seqlens_q.ndim) p.max_seqlen_q = a.max_seqlen_q;
  if (p.cu_seqlens_k.ndim) p.max_seqlen_k = a.max_seqlen_k;
  p.dropout_p = static_cast<float>(a.dropout_p);
  p.softmax_scale = scale_or_default(a.softmax_scale);
  p.causal = a.causal;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.softcap = static_cast<float>(a.softcap);
  p.causal_align = static_cast<fp_causal_align>(a.causal_align);
  p.num_splits = a.num_splits;
  p.backend = static_cast<fp_backend>(a.backend);
}

// An output argument: the caller's tensor, or (None) a new contiguous one of `dims` from torch's
// allocator.
nb::object output(const char* name, nb::handle given, int code, const Dims& dims, fp_tensor* t,
                  Call& call) {
  nb::object obj = given.is_none() ? new_tensor(code, dims, call) : nb::borrow(given);
  read_tensor(name, obj, t, call, Role::output);
  return obj;
}

Dims dims_like(const fp_tensor& t) {
  Dims d;
  d.ndim = t.ndim;
  for (int32_t i = 0; i < t.ndim; ++i) d.d[i] = t.shape[i];
  return d;
}

// out [.., Hq, Dv] like q; lse fp32 (fp64 with fp64 q): [B, Hq, Sq] batched, [Hq, Tq] varlen.
nb::tuple fwd_outputs(nb::handle out, nb::handle lse, fp_attn_params& p, Call& call) {
  const fp_tensor& q = p.q;
  const bool varlen = p.cu_seqlens_q.ndim != 0;
  Dims out_dims, lse_dims;
  if (out.is_none() || lse.is_none()) {
    if (q.ndim != (varlen ? 3 : 4))
      bad_argument("q", std::string("must be ") +
                            (varlen ? "[Tq, Hq, D] with cu_seqlens_q" : "[B, Sq, Hq, D]") +
                            " (got " + std::to_string(q.ndim) + " dimensions)");
    if (p.v.ndim == 0) bad_argument("v", "must be given");
    out_dims = dims_like(q);
    out_dims.d[q.ndim - 1] = p.v.shape[p.v.ndim - 1];
    lse_dims = varlen ? Dims{2, {q.shape[1], q.shape[0]}}
                      : Dims{3, {q.shape[0], q.shape[2], q.shape[1]}};
  }
  nb::object o = output("out", out, q.dtype, out_dims, &p.out, call);
  nb::object l = output("lse", lse, q.dtype == FP_F64 ? FP_F64 : FP_F32, lse_dims, &p.lse, call);
  return nb::make_tuple(o, l);
}

void run_fwd(fp_attn_params& p, Call& call) {
  set_execution(p, call);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = fp_attn_fwd(&p);
  }
  if (s != FP_OK) raise_status(s, call.alloc_error);
}

// -> (out, lse); out/lse None: allocated here.
nb::tuple attn_fwd(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                   nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t max_seqlen_q,
                   int64_t max_seqlen_k, nb::handle block_table, nb::handle seqused_k,
                   nb::handle alibi_slopes, nb::handle sinks, nb::handle dropout_rng,
                   double dropout_p, double softmax_scale, int32_t causal, int32_t window_left,
                   int32_t window_right, double softcap, int32_t causal_align,
                   int32_t num_splits, int32_t backend) {
  Call call;
  fp_attn_params p;
  fp_attn_params_init(&p);
  fill_fwd(p,
           {q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            seqused_k, alibi_slopes, sinks, dropout_rng, dropout_p, softmax_scale, causal,
            window_left, window_right, softcap, causal_align, num_splits, backend},
           call);
  nb::tuple outputs = fwd_outputs(out, lse, p, call);
  run_fwd(p, call);
  return outputs;
}

nb::dict selection_dict(const fp_selection& s) {
  nb::dict d;
  d["backend"] = fp_backend_name(s.backend);
  d["kernel"] = std::string(s.kernel);
  d["workspace_bytes"] = s.workspace_bytes;
  d["num_splits"] = s.num_splits;
  return d;
}

// What attn_fwd with these arguments would run (backend, kernel, workspace, splits); runs nothing.
nb::dict attn_fwd_select(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                         nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t max_seqlen_q,
                         int64_t max_seqlen_k, nb::handle block_table, nb::handle seqused_k,
                         nb::handle alibi_slopes, nb::handle sinks, nb::handle dropout_rng,
                         double dropout_p, double softmax_scale, int32_t causal,
                         int32_t window_left, int32_t window_right, double softcap,
                         int32_t causal_align, int32_t num_splits, int32_t backend) {
  Call call;
  fp_attn_params p;
  fp_attn_params_init(&p);
  fill_fwd(p,
           {q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            seqused_k, alibi_slopes, sinks, dropout_rng, dropout_p, softmax_scale, causal,
            window_left, window_right, softcap, causal_align, num_splits, backend},
           call);
  read_tensor("out", out, &p.out, call, Role::output);
  read_tensor("lse", lse, &p.lse, call, Role::output);
  p.stream = current_stream(call);
  fp_selection sel;
  const fp_status s = fp_attn_fwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  return selection_dict(sel);
}

// -> probs [B, Hq, Sq_max, Sk_max] in q's dtype (flash_attn's S_dmask, fp_attn_probs): the
// forward's arguments with its lse as an input; computed on the tensors' device.
nb::object attn_probs(nb::handle q, nb::handle k, nb::handle v, nb::handle lse,
                      nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t max_seqlen_q,
                      int64_t max_seqlen_k, nb::handle block_table, nb::handle seqused_k,
                      nb::handle alibi_slopes, nb::handle sinks, nb::handle dropout_rng,
                      double dropout_p, double softmax_scale, int32_t causal,
                      int32_t window_left, int32_t window_right, double softcap,
                      int32_t causal_align, int32_t backend) {
  Call call;
  fp_attn_params p;
  fp_attn_params_init(&p);
  fill_fwd(p,
           {q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            seqused_k, alibi_slopes, sinks, dropout_rng, dropout_p, softmax_scale, causal,
            window_left, window_right, softcap, causal_align, /*num_splits=*/0, backend},
           call);
  read_tensor("lse", lse, &p.lse, call);
  const bool varlen_q = p.cu_seqlens_q.ndim != 0;
  if (p.q.ndim != (varlen_q ? 3 : 4) || p.k.ndim != 4 - (p.cu_seqlens_k.ndim ? 1 : 0) ||
      (varlen_q && p.cu_seqlens_q.ndim != 1) || (p.block_table.ndim && p.block_table.ndim != 2))
    bad_argument("q", "and k: the layouts of flash_attn_func / flash_attn_varlen_func expected");
  Dims dims{4, {varlen_q ? p.cu_seqlens_q.shape[0] - 1 : p.q.shape[0],
                varlen_q ? p.q.shape[1] : p.q.shape[2],
                varlen_q ? max_seqlen_q : p.q.shape[1],
                p.block_table.ndim ? p.block_table.shape[1] * p.k.shape[1]
                : p.cu_seqlens_k.ndim ? max_seqlen_k
                                      : p.k.shape[1]}};
  fp_tensor probs;
  nb::object obj = output("probs", nb::none(), p.q.dtype, dims, &probs, call);
  p.stream = current_stream(call);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = fp_attn_probs(&p, probs);
  }
  if (s != FP_OK) raise_status(s);
  return obj;
}

// -> (out, lse); appends k/v into the caches in place first.
nb::tuple attn_fwd_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                           nb::handle lse, nb::handle k_new, nb::handle v_new,
                           nb::handle rotary_cos, nb::handle rotary_sin, nb::handle cache_seqlens,
                           nb::handle cache_batch_idx, nb::handle cache_leftpad,
                           nb::handle block_table, nb::handle alibi_slopes, nb::handle sinks,
                           double softmax_scale, int32_t causal, int32_t window_left,
                           int32_t window_right, double softcap, int32_t rotary_interleaved,
                           int32_t num_splits, int32_t causal_align, int32_t backend) {
  Call call;
  fp_attn_params p;
  fp_attn_params_init(&p);
  read_tensor("q", q, &p.q, call);
  read_tensor("k_cache", k_cache, &p.k, call, Role::in_place);
  read_tensor("v_cache", v_cache, &p.v, call, Role::in_place);
  read_tensor("k", k_new, &p.k_new, call);
  read_tensor("v", v_new, &p.v_new, call);
  read_tensor("rotary_cos", rotary_cos, &p.rotary_cos, call);
  read_tensor("rotary_sin", rotary_sin, &p.rotary_sin, call);
  read_tensor("cache_seqlens", cache_seqlens, &p.seqused_k, call);
  read_tensor("cache_batch_idx", cache_batch_idx, &p.cache_batch_idx, call);
  read_tensor("cache_leftpad", cache_leftpad, &p.cache_leftpad, call);
  read_tensor("block_table", block_table, &p.block_table, call);
  read_tensor("alibi_slopes", alibi_slopes, &p.alibi_slopes, call);
  read_tensor("sinks", sinks, &p.sinks, call);
  p.softmax_scale = scale_or_default(softmax_scale);
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = static_cast<float>(softcap);
  p.rotary_interleaved = rotary_interleaved;
  p.num_splits = num_splits;
  p.causal_align = static_cast<fp_causal_align>(causal_align);
  p.backend = static_cast<fp_backend>(backend);
  nb::tuple outputs = fwd_outputs(out, lse, p, call);
  run_fwd(p, call);
  return outputs;
}

// -> (dq, dk, dv, d_sinks); None outputs are allocated here (d_sinks only with sinks).
nb::tuple attn_bwd(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                   nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv,
                   nb::handle d_sinks, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                   int64_t max_seqlen_q, int64_t max_seqlen_k, nb::handle block_table,
                   nb::handle seqused_k, nb::handle alibi_slopes, nb::handle sinks,
                   nb::handle dropout_rng, double dropout_p, double softmax_scale, int32_t causal,
                   int32_t window_left, int32_t window_right, double softcap,
                   int32_t causal_align, int32_t deterministic, int32_t backend) {
  Call call;
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  fill_fwd(p.fwd,
           {q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            seqused_k, alibi_slopes, sinks, dropout_rng, dropout_p, softmax_scale, causal,
            window_left, window_right, softcap, causal_align, /*num_splits=*/0, backend},
           call);
  read_tensor("out", out, &p.fwd.out, call);
  read_tensor("lse", lse, &p.fwd.lse, call);
  read_tensor("dout", dout, &p.dout, call);
  nb::object gq = output("dq", dq, p.fwd.q.dtype, dims_like(p.fwd.q), &p.dq, call);
  nb::object gk = output("dk", dk, p.fwd.k.dtype, dims_like(p.fwd.k), &p.dk, call);
  nb::object gv = output("dv", dv, p.fwd.v.dtype, dims_like(p.fwd.v), &p.dv, call);
  nb::object gs = p.fwd.sinks.ndim
                      ? output("d_sinks", d_sinks, FP_F32, dims_like(p.fwd.sinks), &p.d_sinks, call)
                      : nb::none();
  p.deterministic = deterministic;
  set_execution(p.fwd, call);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = fp_attn_bwd(&p);
  }
  if (s != FP_OK) raise_status(s, call.alloc_error);
  return nb::make_tuple(gq, gk, gv, gs);
}

// ---- merge --------------------------------------------------------------------------------------
Dims without_first(const fp_tensor& t) {
  Dims d;
  d.ndim = t.ndim > 0 ? t.ndim - 1 : 0;
  for (int32_t i = 0; i < d.ndim; ++i) d.d[i] = t.shape[i + 1];
  return d;
}

// -> (out, lse) = merge of the partials along their first dimension.
nb::tuple merge_fwd(nb::handle out_partials, nb::handle lse_partials, nb::handle out,
                    nb::handle lse, int32_t backend) {
  Call call;
  fp_merge_params p;
  fp_merge_params_init(&p);
  read_tensor("out_partials", out_partials, &p.out_partials, call);
  read_tensor("lse_partials", lse_partials, &p.lse_partials, call);
  nb::object o = output("out", out, p.out_partials.dtype, without_first(p.out_partials), &p.out,
                        call);
  nb::object l = output("lse", lse, p.lse_partials.dtype, without_first(p.lse_partials), &p.lse,
                        call);
  p.backend = static_cast<fp_backend>(backend);
  p.stream = current_stream(call);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = fp_merge_fwd(&p);
  }
  if (s != FP_OK) raise_status(s);
  return nb::make_tuple(o, l);
}

// -> (d_out_partials, d_lse_partials).
nb::tuple merge_bwd(nb::handle out_partials, nb::handle lse_partials, nb::handle out,
                    nb::handle lse, nb::handle dout, nb::handle dlse, nb::handle d_out_partials,
                    nb::handle d_lse_partials, int32_t backend) {
  Call call;
  fp_merge_bwd_params p;
  fp_merge_bwd_params_init(&p);
  read_tensor("out_partials", out_partials, &p.fwd.out_partials, call);
  read_tensor("lse_partials", lse_partials, &p.fwd.lse_partials, call);
  read_tensor("out", out, &p.fwd.out, call);
  read_tensor("lse", lse, &p.fwd.lse, call);
  read_tensor("dout", dout, &p.dout, call);
  read_tensor("dlse", dlse, &p.dlse, call);
  nb::object go = output("d_out_partials", d_out_partials, p.fwd.out_partials.dtype,
                         dims_like(p.fwd.out_partials), &p.d_out_partials, call);
  nb::object gl = output("d_lse_partials", d_lse_partials, p.fwd.lse_partials.dtype,
                         dims_like(p.fwd.lse_partials), &p.d_lse_partials, call);
  p.fwd.backend = static_cast<fp_backend>(backend);
  p.fwd.stream = current_stream(call);
  fp_status s;
  {
    nb::gil_scoped_release release;
    s = fp_merge_bwd(&p);
  }
  if (s != FP_OK) raise_status(s);
  return nb::make_tuple(go, gl);
}

// ---- the torch bridge ---------------------------------------------------------------------------
// exchange_api: the capsule torch.Tensor.__dlpack_c_exchange_api__, or None (older torch, or a
// test of the attribute route). dtypes: (float16, bfloat16, float32, float64, int32) of torch.
// The attribute route calls current_stream(device index) -> int and
// empty(shape, dtype code, device index) -> tensor (code: fp_dtype order, 5 = uint8; index -1 = CPU).
// Returns whether the C route is in use.
bool set_torch(nb::handle tensor_type, nb::handle exchange_api, nb::tuple dtypes,
               nb::handle current_stream_fn, nb::handle empty_fn, bool rocm) {
  if (!PyType_Check(tensor_type.ptr())) throw nb::type_error("tensor_type must be a type");
  if (dtypes.size() != 5) throw nb::value_error("dtypes: five torch dtypes expected");
  const dlx::Api* api = nullptr;
  if (!exchange_api.is_none()) {
    void* ptr = PyCapsule_GetPointer(exchange_api.ptr(), "dlpack_exchange_api");
    if (!ptr) throw nb::python_error();
    api = dlx::find_v1(static_cast<const dlx::ApiHeader*>(ptr));
    // A table without the non-owning view or the stream query is not used (attribute route).
    if (api && (!api->dltensor_from_py_object_no_sync || !api->current_work_stream ||
                !api->managed_tensor_allocator))
      api = nullptr;
  }
  auto keep = [](nb::handle h) { return h.inc_ref().ptr(); };  // process lifetime (see above)
  TorchBridge b;
  b.tensor_type = reinterpret_cast<PyTypeObject*>(keep(tensor_type));
  b.api = api;
  for (int i = 0; i < 5; ++i) b.dtypes[i] = keep(dtypes[i]);
  b.current_stream = keep(current_stream_fn);
  b.empty = keep(empty_fn);
  b.gpu_device = rocm ? FP_DEVICE_HIP : FP_DEVICE_CUDA;
  b.gpu_dlpack = rocm ? dlx::kDLROCM : dlx::kDLCUDA;
  for (auto [slot, name] : {std::pair{&b.s_data_ptr, "data_ptr"}, {&b.s_shape, "shape"},
                            {&b.s_stride, "stride"}, {&b.s_dtype, "dtype"},
                            {&b.s_is_cuda, "is_cuda"}, {&b.s_get_device, "get_device"}})
    *slot = PyUnicode_InternFromString(name);
  g_torch = b;
  return api != nullptr;
}

// ---- workspace from shapes alone (JAX on GPU) ----------------------------------------------------
// XLA sizes buffers at trace time, before any data exists. GPU planning reads no device memory
// (a library rule), so a call described by shapes with placeholder pointers selects exactly as
// the real call will; flashport.jax turns the answer into a workspace result buffer.
fp_tensor* tensor_field(fp_attn_bwd_params& p, const std::string& n) {
  fp_attn_params& f = p.fwd;
  for (auto [name, field] : {std::pair{"q", &f.q}, {"k", &f.k}, {"v", &f.v}, {"out", &f.out},
                             {"lse", &f.lse}, {"cu_seqlens_q", &f.cu_seqlens_q},
                             {"cu_seqlens_k", &f.cu_seqlens_k}, {"alibi_slopes", &f.alibi_slopes},
                             {"sinks", &f.sinks}, {"dout", &p.dout}, {"dq", &p.dq},
                             {"dk", &p.dk}, {"dv", &p.dv}, {"d_sinks", &p.d_sinks}})
    if (n == name) return field;
  return nullptr;
}

bool dtype_from_name(const std::string& n, fp_dtype* t) {
  static const char* const kNames[] = {"float16", "bfloat16", "float32", "float64", "int32"};
  for (int i = 0; i < 5; ++i)
    if (n == kNames[i]) {
      *t = static_cast<fp_dtype>(i);
      return true;
    }
  return false;
}

// meta: {name: (dtype name, shape)}; the scalars as in the FFI handlers' attributes.
size_t gpu_workspace_bytes(const std::string& op, nb::dict meta, double softmax_scale, int32_t causal,
                           int32_t causal_align, int32_t window_left, int32_t window_right,
                           double softcap, double dropout_p, int32_t num_splits, int32_t backend,
                           int64_t max_seqlen_q, int64_t max_seqlen_k, int32_t deterministic,
                           int32_t device_index) {
  if (op != "fwd" && op != "bwd") throw nb::value_error("flashport: op must be 'fwd' or 'bwd'");
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  for (auto [key, val] : meta) {
    const std::string n = nb::cast<std::string>(key);
    fp_tensor* f = tensor_field(p, n);
    if (!f) throw nb::value_error(("flashport: unknown tensor argument '" + n + "'").c_str());
    nb::tuple spec = nb::cast<nb::tuple>(val);  // (dtype name, shape)
    std::memset(f, 0, sizeof(*f));
    if (!dtype_from_name(nb::cast<std::string>(spec[0]), &f->dtype))
      bad_argument(n.c_str(), "has an unsupported dtype");
    nb::tuple shape = nb::cast<nb::tuple>(spec[1]);
    int64_t dims[FP_MAX_DIMS] = {};
    for (size_t i = 0; i < shape.size() && i < FP_MAX_DIMS; ++i)
      dims[i] = nb::cast<int64_t>(shape[i]);
    shape_from(n.c_str(), static_cast<int32_t>(shape.size()), dims, nullptr, f);
    f->data = reinterpret_cast<void*>(uintptr_t(256));  // never dereferenced by planning
    f->device_type = FP_DEVICE_CUDA;
    f->device_index = device_index;
  }
  fp_attn_params& f = p.fwd;
  f.softmax_scale = scale_or_default(softmax_scale);
  f.causal = causal;
  f.causal_align = static_cast<fp_causal_align>(causal_align);
  f.window_left = window_left;
  f.window_right = window_right;
  f.softcap = static_cast<float>(softcap);
  f.dropout_p = static_cast<float>(dropout_p);
  f.num_splits = num_splits;
  f.backend = static_cast<fp_backend>(backend);
  if (f.cu_seqlens_q.ndim) f.max_seqlen_q = max_seqlen_q;
  if (f.cu_seqlens_k.ndim) f.max_seqlen_k = max_seqlen_k;
  p.deterministic = deterministic;
  fp_selection sel;
  const fp_status s = op == "fwd" ? fp_attn_fwd_select(&p.fwd, &sel) : fp_attn_bwd_select(&p, &sel);
  if (s != FP_OK) raise_status(s);
  return sel.workspace_bytes;
}

}  // namespace

#ifdef FLASHPORT_WITH_JAX_FFI
nb::dict jax_ffi_targets();  // jax_ffi.cpp
#endif

NB_MODULE(_C, m) {
  m.doc() = "flashport C API for Python (framework-independent; see module.cpp)";
  const auto t = [](const char* name) { return nb::arg(name).none(); };  // a tensor or None
  m.def("set_torch", &set_torch, nb::arg("tensor_type"), nb::arg("exchange_api").none(),
        nb::arg("dtypes"), nb::arg("current_stream"), nb::arg("empty"), nb::arg("rocm"),
        "Tell the extension how torch tensors cross (called by flashport.torch at import); "
        "returns True when torch's C DLPack exchange table is used.");
  m.def("uses_c_exchange", [] { return g_torch.api != nullptr; });
  m.def("attn_fwd", &attn_fwd, t("q"), t("k"), t("v"), t("out"), t("lse"), t("cu_seqlens_q"),
        t("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), t("block_table"),
        t("seqused_k"), t("alibi_slopes"), t("sinks"), t("dropout_rng"), nb::arg("dropout_p"),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("causal_align"),
        nb::arg("num_splits"), nb::arg("backend"));
  m.def("attn_fwd_select", &attn_fwd_select, t("q"), t("k"), t("v"), t("out"), t("lse"),
        t("cu_seqlens_q"), t("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
        t("block_table"), t("seqused_k"), t("alibi_slopes"), t("sinks"), t("dropout_rng"),
        nb::arg("dropout_p"), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("causal_align"), nb::arg("num_splits"), nb::arg("backend"));
  m.def("attn_probs", &attn_probs, t("q"), t("k"), t("v"), t("lse"), t("cu_seqlens_q"),
        t("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), t("block_table"),
        t("seqused_k"), t("alibi_slopes"), t("sinks"), t("dropout_rng"), nb::arg("dropout_p"),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("causal_align"),
        nb::arg("backend"));
  m.def("attn_fwd_kvcache", &attn_fwd_kvcache, t("q"), t("k_cache"), t("v_cache"), t("out"),
        t("lse"), t("k"), t("v"), t("rotary_cos"), t("rotary_sin"), t("cache_seqlens"),
        t("cache_batch_idx"), t("cache_leftpad"), t("block_table"), t("alibi_slopes"), t("sinks"),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("rotary_interleaved"),
        nb::arg("num_splits"), nb::arg("causal_align"), nb::arg("backend"));
  m.def("attn_bwd", &attn_bwd, t("dout"), t("q"), t("k"), t("v"), t("out"), t("lse"), t("dq"),
        t("dk"), t("dv"), t("d_sinks"), t("cu_seqlens_q"), t("cu_seqlens_k"),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), t("block_table"), t("seqused_k"),
        t("alibi_slopes"), t("sinks"), t("dropout_rng"), nb::arg("dropout_p"),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("causal_align"),
        nb::arg("deterministic"), nb::arg("backend"));
  m.def("merge_fwd", &merge_fwd, t("out_partials"), t("lse_partials"), t("out"), t("lse"),
        nb::arg("backend"));
  m.def("merge_bwd", &merge_bwd, t("out_partials"), t("lse_partials"), t("out"), t("lse"),
        t("dout"), t("dlse"), t("d_out_partials"), t("d_lse_partials"), nb::arg("backend"));
  m.def("gpu_workspace_bytes", &gpu_workspace_bytes, nb::arg("op"), nb::arg("meta"),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("causal_align"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("dropout_p"), nb::arg("num_splits"), nb::arg("backend"),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("deterministic"),
        nb::arg("device_index") = 0,
        "Workspace bytes a CUDA call of these shapes needs: meta {name: (dtype, shape)}.");
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
