// The C-level DLPack exchange protocol (DLPack >= 1.3, torch >= 2.9): a framework publishes a
// table of C functions as the capsule `type(tensor).__dlpack_c_exchange_api__` (capsule name
// "dlpack_exchange_api"), through which a consumer reads a tensor's data pointer, shape and
// strides, the framework's current stream, and allocates from the framework's allocator, with no
// Python object per tensor. Declared here from the published DLPack ABI (the layouts are fixed by
// that standard), so the extension needs no framework header; nanobind's dltensor is DLTensor.
#pragma once
#include <nanobind/ndarray.h>

#include <cstdint>

namespace flashport_py::dlx {

using DLTensor = nanobind::dlpack::dltensor;

struct Version {
  uint32_t major;
  uint32_t minor;
};

// DLManagedTensorVersioned: an owned tensor; `deleter(self)` releases it.
struct ManagedTensor {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

using SetErrorFn = void (*)(void* error_ctx, const char* kind, const char* message);

struct ApiHeader {
  Version version;
  ApiHeader* prev_api;  // an older version of the table, or null
};

// The table (major version 1). Every function returns 0 on success.
struct Api {
  ApiHeader header;
  // New tensor shaped like `prototype` (dtype, ndim, shape, device) from the framework's allocator.
  int (*managed_tensor_allocator)(DLTensor* prototype, ManagedTensor** out, void* error_ctx,
                                  SetErrorFn set_error);
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, ManagedTensor** out);
  int (*managed_tensor_to_py_object_no_sync)(ManagedTensor* tensor, void** out_py_object);
  // Non-owning view of a Python tensor, valid while the object lives (may be null in a table).
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  // The framework's current stream of a device (torch.cuda.current_stream).
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// DLPack device and dtype codes used here.
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLROCM = 10;
constexpr uint8_t kDLUInt = 1;

// The table of major version 1 in the chain starting at `header`, or null.
inline const Api* find_v1(const ApiHeader* header) {
  for (; header != nullptr; header = header->prev_api)
    if (header->version.major == 1) return reinterpret_cast<const Api*>(header);
  return nullptr;
}

}  // namespace flashport_py::dlx
