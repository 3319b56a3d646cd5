// torch_uvm_saver._C: the pybind11 module. It imports neither torch nor anything else from
// Python; the Python package layers the PyTorch hook-up and the exception classes on top.
#include "bindings/bindings.h"

PYBIND11_MODULE(_C, module) {
  module.doc() = "torch_uvm_saver native core (allocator, drivers, stats).";
  tus::bindings::bind_errors(module);
  tus::bindings::bind_drivers(module);
  tus::bindings::bind_allocator(module);
  tus::bindings::bind_snapshots(module);
  tus::bindings::bind_sharing(module);
  tus::bindings::bind_registry(module);
  tus::bindings::bind_alias(module);
  tus::bindings::bind_relocation(module);
  tus::bindings::bind_arguments(module);
}
