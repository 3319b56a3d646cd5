// Aliases: a tensor over memory that already exists, viewed from a device of our choosing. Managed
// memory is valid on the host and on every GPU at the same address, so `tus.to(t, "cpu")` hands
// out a CPU tensor over a CUDA tensor's managed bytes (and back) without copying. The tensor is
// made by torch.from_dlpack from a DLPack capsule built here; the capsule keeps a Python owner
// (the original storage) alive until PyTorch releases the alias, so a view never outlives the
// memory it uses.
//
// The structs below are DLPack's stable C ABI (dlpack.h, version 0.x "dltensor" capsules), which
// every PyTorch since 1.x consumes; we declare the few fields we fill rather than depend on
// PyTorch's headers (ARCHITECTURE.md, decision 1).
#include <Python.h>

#include <cstdint>
#include <string>

#include "allocator/errors.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

struct DLDevice {
  std::int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;  // kDLUInt = 1
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // null: compact row-major
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

struct AliasContext {
  DLManagedTensor managed;
  std::int64_t shape[1];
  PyObject* owner;  // strong reference, dropped by the deleter
};

// PyTorch calls this when the alias's storage dies, possibly on a thread without the GIL (an
// autograd worker) or during interpreter exit, when Python may already be gone.
void release_alias(DLManagedTensor* self) {
  auto* context = static_cast<AliasContext*>(self->manager_ctx);
  if (Py_IsInitialized()) {
    PyGILState_STATE state = PyGILState_Ensure();
    Py_XDECREF(context->owner);
    PyGILState_Release(state);
  }
  delete context;
}

// A capsule nobody consumed still owns its DLManagedTensor.
void release_unused_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

py::capsule alias_capsule(std::uintptr_t ptr, std::int64_t nbytes, const std::string& device_type,
                          int device_index, py::object owner) {
  if (nbytes < 0) TUS_THROW(InvalidArgument, "alias: negative size " << nbytes);
  std::int32_t type = 0;
  if (device_type == "cpu") {
    type = kDLCPU;
    device_index = 0;
  } else if (device_type == "cuda") {
    type = kDLCUDA;
  } else {
    TUS_THROW(InvalidArgument,
              "alias: device type must be 'cpu' or 'cuda', got '" << device_type << "'");
  }
  auto* context = new AliasContext();
  context->shape[0] = nbytes;
  context->owner = owner.release().ptr();
  DLTensor& tensor = context->managed.dl_tensor;
  tensor.data = reinterpret_cast<void*>(ptr);
  tensor.device = DLDevice{type, device_index};
  tensor.ndim = 1;
  tensor.dtype = DLDataType{1, 8, 1};
  tensor.shape = context->shape;
  tensor.strides = nullptr;
  tensor.byte_offset = 0;
  context->managed.manager_ctx = context;
  context->managed.deleter = release_alias;
  PyObject* capsule = PyCapsule_New(&context->managed, kCapsuleName, release_unused_capsule);
  if (capsule == nullptr) {
    release_alias(&context->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace

void bind_alias(py::module_& module) {
  module.def("alias_capsule", &alias_capsule, py::arg("ptr"), py::arg("nbytes"),
             py::arg("device_type"), py::arg("device_index"), py::arg("owner"),
             "A DLPack capsule of `nbytes` uint8 at `ptr` on ('cpu' | 'cuda', index) that keeps "
             "`owner` alive until the tensor made from it is freed.");
  module.attr("USED_CAPSULE_NAME") = kUsedCapsuleName;
}

}  // namespace tus::bindings
