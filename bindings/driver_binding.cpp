// Python view of the drivers: the simulated one is built and steered (fault injection, call
// counts) from tests; both can be installed as the process driver.
#include <pybind11/stl.h>

#include <cstdint>

#include "allocator/driver/cuda_driver.h"
#include "allocator/driver/sim_driver.h"
#include "bindings/bindings.h"
#include "bindings/region_args.h"

namespace py = pybind11;

namespace tus::bindings {

void bind_drivers(py::module_& module) {
  py::class_<Driver, std::shared_ptr<Driver>>(module, "Driver",
                                              "A CUDA driver implementation (real or simulated).")
      .def_property_readonly("name", &Driver::name)
      .def("device_count", &Driver::device_count, py::call_guard<py::gil_scoped_release>())
      .def(
          "mem_get_info",
          [](Driver& driver, int device) {
            MemInfo info;
            {
              py::gil_scoped_release release;
              info = driver.mem_get_info(device);
            }
            return py::make_tuple(info.free_bytes, info.total_bytes);
          },
          py::arg("device") = 0, "(free, total) device memory in bytes.")
      .def("granularity", &Driver::granularity, py::arg("device") = 0,
           py::call_guard<py::gil_scoped_release>())
      // The raw VMM and allocation primitives, for tests and tools that check a driver against
      // the contract in driver.h. Nothing tracks what is made through them: the caller undoes it.
      .def("reserve_address", &Driver::reserve_address, py::arg("device"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("free_address", &Driver::free_address, py::arg("device"), py::arg("ptr"),
           py::arg("size"), py::call_guard<py::gil_scoped_release>())
      .def("create_physical", &Driver::create_physical, py::arg("device"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_physical", &Driver::release_physical, py::arg("device"), py::arg("handle"),
           py::call_guard<py::gil_scoped_release>())
      .def("map", &Driver::map, py::arg("device"), py::arg("ptr"), py::arg("size"),
           py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def("unmap", &Driver::unmap, py::arg("device"), py::arg("ptr"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_access", &Driver::set_access, py::arg("device"), py::arg("ptr"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "stream_create",
          [](Driver& driver, int device) {
            return reinterpret_cast<std::uintptr_t>(driver.stream_create(device));
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def(
          "stream_destroy",
          [](Driver& driver, int device, std::uintptr_t stream) {
            driver.stream_destroy(device, reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "event_create",
          [](Driver& driver, int device) {
            return reinterpret_cast<std::uintptr_t>(driver.event_create(device));
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def(
          "event_destroy",
          [](Driver& driver, int device, std::uintptr_t event) {
            driver.event_destroy(device, reinterpret_cast<EventHandle>(event));
          },
          py::arg("device"), py::arg("event"), py::call_guard<py::gil_scoped_release>())
      .def("mem_alloc", &Driver::mem_alloc, py::arg("device"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("mem_free", &Driver::mem_free, py::arg("device"), py::arg("ptr"),
           py::call_guard<py::gil_scoped_release>())
      .def("mem_alloc_managed", &Driver::mem_alloc_managed, py::arg("device"), py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "mem_prefetch",
          [](Driver& driver, int device, std::uintptr_t ptr, std::size_t size,
             const std::string& location) {
            const MemLocation to = parse_location(location);
            py::gil_scoped_release release;
            driver.mem_prefetch(device, ptr, size, to, nullptr);
          },
          py::arg("device"), py::arg("ptr"), py::arg("size"), py::arg("location"))
      .def("is_managed", &Driver::is_managed, py::arg("device"), py::arg("ptr"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<CudaDriver, Driver, std::shared_ptr<CudaDriver>>(module, "CudaDriver")
      .def(py::init<>());

  py::class_<SimDriver, Driver, std::shared_ptr<SimDriver>>(
      module, "SimDriver",
      "Simulated driver on host memory: VMM semantics, a capacity, and fault injection.")
      .def(py::init<std::size_t, int, std::size_t>(), py::arg("capacity"),
           py::arg("device_count") = 1, py::arg("granularity") = 2 * kMiB)
      .def("fail_on", &SimDriver::fail_on, py::arg("call"), py::arg("nth") = 1,
           py::arg("error_code") = SimDriver::kDefaultErrorCode,
           py::call_guard<py::gil_scoped_release>(),
           "Make the nth call of `call` from now fail (error_code 2 = out of memory).")
      .def("clear_faults", &SimDriver::clear_faults, py::call_guard<py::gil_scoped_release>())
      .def("call_counts", &SimDriver::call_counts, py::call_guard<py::gil_scoped_release>())
      .def("reset_call_counts", &SimDriver::reset_call_counts,
           py::call_guard<py::gil_scoped_release>())
      .def("used_bytes", &SimDriver::used_bytes, py::arg("device") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("mapped_ranges", &SimDriver::mapped_ranges, py::call_guard<py::gil_scoped_release>())
      .def("pinned_host_bytes", &SimDriver::pinned_host_bytes,
           py::call_guard<py::gil_scoped_release>())
      .def("held", &SimDriver::held, py::call_guard<py::gil_scoped_release>(),
           "Objects still alive, by kind (Note [What the driver holds] in sim_driver.h).")
      .def("hold_events", &SimDriver::hold_events, py::arg("held"),
           py::call_guard<py::gil_scoped_release>(),
           "While held, event_query says recorded events are still running.")
      .def("hold_copies", &SimDriver::hold_copies, py::arg("held"),
           py::call_guard<py::gil_scoped_release>(),
           "While held, copies on the allocator's own streams stay in flight (Note [Held "
           "copies] in sim_driver.h): unmapping their memory fails, as it faults on a GPU.")
      .def("set_call_delay", &SimDriver::set_call_delay, py::arg("call"), py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>(),
           "Make every call of `call` ('*': any) take `seconds` longer, counted first and slow "
           "outside the driver's lock (Note [Slow calls] in sim_driver.h); 0 removes it.")
      .def_property_readonly("capacity", &SimDriver::capacity_bytes);
}

}  // namespace tus::bindings
