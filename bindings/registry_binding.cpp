// The process-wide side: the registry of per-device allocators that PyTorch's calls reach, and
// the calling thread's region configuration.
#include <pybind11/stl.h>

#include "allocator/errors.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"
#include "bindings/bindings.h"
#include "bindings/pluggable_entry.h"

namespace py = pybind11;

namespace tus::bindings {

void bind_registry(py::module_& module) {
  module.def(
      "get_allocator", [](int device) { return Registry::instance().shared_allocator(device); },
      py::arg("device"), "The process allocator of `device`, created on first use.");
  module.def(
      "allocators", [] { return Registry::instance().allocators(); },
      "Process allocators created so far.");
  module.def("get_driver", [] { return Registry::instance().driver(); });
  module.def(
      "install_driver",
      [](std::shared_ptr<Driver> driver, std::size_t chunk_bytes) {
        Registry::instance().install_driver(std::move(driver), AllocatorOptions{chunk_bytes});
      },
      py::arg("driver"), py::arg("chunk_bytes") = AllocatorOptions{}.chunk_bytes,
      py::call_guard<py::gil_scoped_release>(),
      "Use `driver` for the process allocators (refused while they hold memory).");
  module.def(
      "set_thread_region",
      [](const std::string& mode, const std::string& tag, bool cpu_backup) {
        if (tag.empty()) throw InvalidArgument("a tag must be a non-empty string");
        thread_region() = RegionConfig{parse_mode(mode), tag, cpu_backup};
      },
      py::arg("mode"), py::arg("tag"), py::arg("cpu_backup"),
      "Set the region the calling thread's allocations through PyTorch belong to.");
  module.def(
      "get_thread_region",
      [] {
        const RegionConfig& region = thread_region();
        return py::make_tuple(mode_name(region.mode), region.tag, region.cpu_backup);
      },
      "(mode, tag, cpu_backup) of the calling thread.");
  module.def("last_malloc_error", &last_malloc_error,
             "Why the last allocation PyTorch asked of us on this thread failed ('' if none).");
  module.attr("MALLOC_SYMBOL") = kMallocSymbol;
  module.attr("FREE_SYMBOL") = kFreeSymbol;
}

}  // namespace tus::bindings
