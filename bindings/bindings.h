// Declarations shared by the binding translation units of torch_uvm_saver._C.
#pragma once

#include <pybind11/pybind11.h>

namespace tus::bindings {

void bind_errors(pybind11::module_& module);
void bind_drivers(pybind11::module_& module);
void bind_allocator(pybind11::module_& module);
void bind_registry(pybind11::module_& module);
void bind_alias(pybind11::module_& module);
void bind_relocation(pybind11::module_& module);
void bind_arguments(pybind11::module_& module);
// Adds the snapshot methods to the Allocator class bind_allocator made.
void bind_snapshots(pybind11::module_& module);
// Adds export_tag to the Allocator class and the SharedMapping class.
void bind_sharing(pybind11::module_& module);

}  // namespace tus::bindings
