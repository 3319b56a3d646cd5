// Turns the core's typed errors into Python exceptions. The classes are defined in Python
// (torch_uvm_saver/errors.py, where OutOfMemoryError can subclass torch.OutOfMemoryError without
// this module importing torch) and handed over with _set_exception_types at import; until then
// built-in exceptions stand in.
#include <Python.h>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

struct ExceptionTypes {
  PyObject* error = PyExc_RuntimeError;
  PyObject* out_of_memory = PyExc_MemoryError;
  PyObject* cuda_error = PyExc_RuntimeError;
  PyObject* invalid_argument = PyExc_ValueError;
  PyObject* invalid_state = PyExc_RuntimeError;
};

ExceptionTypes& exception_types() {
  static auto* types = new ExceptionTypes();  // leaked: translations may run during exit
  return *types;
}

PyObject* keep(const py::object& type) {
  PyObject* raw = type.ptr();
  Py_INCREF(raw);
  return raw;
}

}  // namespace

void bind_errors(py::module_& module) {
  module.def(
      "_set_exception_types",
      [](const py::object& error, const py::object& out_of_memory, const py::object& cuda_error,
         const py::object& invalid_argument, const py::object& invalid_state) {
        ExceptionTypes& types = exception_types();
        types.error = keep(error);
        types.out_of_memory = keep(out_of_memory);
        types.cuda_error = keep(cuda_error);
        types.invalid_argument = keep(invalid_argument);
        types.invalid_state = keep(invalid_state);
      },
      py::arg("error"), py::arg("out_of_memory"), py::arg("cuda_error"),
      py::arg("invalid_argument"), py::arg("invalid_state"));

  // Paths that cannot raise (free, destructors, best-effort placement) report through log_once;
  // tests of injected failures check that every failure was either raised or reported.
  module.def("logged_count", &logged_count,
             "Failures reported on stderr so far (repeats of one kind, printed once, included).");

  py::register_exception_translator([](std::exception_ptr raised) {
    if (!raised) return;
    const ExceptionTypes& types = exception_types();
    try {
      std::rethrow_exception(raised);
    } catch (const OutOfMemory& error) {
      PyErr_SetString(types.out_of_memory, error.what());
    } catch (const CudaError& error) {
      PyErr_SetString(types.cuda_error, error.what());
    } catch (const InvalidArgument& error) {
      PyErr_SetString(types.invalid_argument, error.what());
    } catch (const InvalidState& error) {
      PyErr_SetString(types.invalid_state, error.what());
    } catch (const Error& error) {
      PyErr_SetString(types.error, error.what());
    }
  });
}

}  // namespace tus::bindings
