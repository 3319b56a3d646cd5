// Python view of one device's Allocator. The GIL is released around every call that takes the
// allocator's lock (which a pause holds while its copies run) or reaches the driver, so a pause
// on one thread never blocks Python on another. Python objects are built only with the GIL held.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "allocator/allocator.h"
#include "allocator/errors.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

RegionConfig make_region(const std::string& tag, const std::string& mode, bool cpu_backup) {
  if (tag.empty()) throw InvalidArgument("a tag must be a non-empty string");
  return RegionConfig{parse_mode(mode), tag, cpu_backup};
}

py::dict segment_dict(const SegmentInfo& info) {
  py::dict out;
  out["ptr"] = info.ptr;
  out["size"] = info.size;
  out["requested"] = info.requested;
  out["resident"] = info.resident;
  out["tag"] = info.tag;
  out["mode"] = mode_name(info.mode);
  out["cpu_backup"] = info.cpu_backup;
  out["has_backup"] = info.has_backup;
  return out;
}

}  // namespace

void bind_allocator(py::module_& module) {
  using Tag = std::optional<std::string>;
  py::class_<Allocator, std::shared_ptr<Allocator>>(module, "Allocator",
                                                    "The allocator of one device.")
      .def(py::init([](std::shared_ptr<Driver> driver, int device, std::size_t chunk_bytes) {
             return std::make_shared<Allocator>(std::move(driver), device,
                                                AllocatorOptions{chunk_bytes});
           }),
           py::arg("driver"), py::arg("device") = 0,
           py::arg("chunk_bytes") = AllocatorOptions{}.chunk_bytes)
      .def_property_readonly("device", &Allocator::device)
      .def_property_readonly("driver", &Allocator::driver)
      .def(
          "malloc",
          [](Allocator& self, std::size_t size, const std::string& tag, const std::string& mode,
             bool cpu_backup, std::uintptr_t stream) {
            const RegionConfig region = make_region(tag, mode, cpu_backup);
            py::gil_scoped_release release;
            return self.malloc(size, reinterpret_cast<StreamHandle>(stream), region);
          },
          py::arg("size"), py::arg("tag") = "default", py::arg("mode") = "vmm",
          py::arg("cpu_backup") = false, py::arg("stream") = 0)
      .def("free", &Allocator::free, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def(
          "enter_region",
          [](Allocator& self, const std::string& tag, const std::string& mode, bool cpu_backup) {
            self.enter_region(make_region(tag, mode, cpu_backup));
          },
          py::arg("tag"), py::arg("mode") = "vmm", py::arg("cpu_backup") = false,
          py::call_guard<py::gil_scoped_release>())
      .def("exit_region", &Allocator::exit_region, py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "pause", [](Allocator& self, const Tag& tag) { return self.pause(tag); },
          py::arg("tag") = py::none(), py::call_guard<py::gil_scoped_release>(),
          "Release the device memory of `tag` (every tag if None); returns bytes released.")
      .def(
          "resume", [](Allocator& self, const Tag& tag) { return self.resume(tag); },
          py::arg("tag") = py::none(), py::call_guard<py::gil_scoped_release>(),
          "Map memory again under `tag` (every tag if None); returns bytes mapped.")
      .def(
          "set_backup_policy",
          [](Allocator& self, const std::string& tag, bool retain, bool pinned) {
            self.set_backup_policy(tag, BackupPolicy{retain, pinned});
          },
          py::arg("tag"), py::arg("retain") = false, py::arg("pinned") = true,
          py::call_guard<py::gil_scoped_release>())
      .def("backup_policy",
           [](const Allocator& self, const std::string& tag) {
             BackupPolicy policy;
             {
               py::gil_scoped_release release;
               policy = self.backup_policy(tag);
             }
             py::dict out;
             out["retain"] = policy.retain;
             out["pinned"] = policy.pinned;
             return out;
           })
      .def(
          "backup_of",
          [](const Allocator& self, std::uintptr_t ptr) -> std::optional<py::tuple> {
            std::optional<BackupView> view;
            {
              py::gil_scoped_release release;
              view = self.backup_of(ptr);
            }
            if (!view) return std::nullopt;
            return py::make_tuple(view->host_address, view->bytes);
          },
          py::arg("ptr"), "(host address, bytes available) of the backup of `ptr`, or None.")
      .def("knows_tag", &Allocator::knows_tag, py::call_guard<py::gil_scoped_release>())
      .def("is_paused", &Allocator::is_paused, py::call_guard<py::gil_scoped_release>())
      .def("tags", &Allocator::tags, py::call_guard<py::gil_scoped_release>())
      .def("segments",
           [](const Allocator& self) {
             std::vector<SegmentInfo> infos;
             {
               py::gil_scoped_release release;
               infos = self.segments();
             }
             py::list out;
             for (const SegmentInfo& info : infos) out.append(segment_dict(info));
             return out;
           })
      .def("stats", &Allocator::stats, py::call_guard<py::gil_scoped_release>())
      .def("reset_peak", &Allocator::reset_peak, py::call_guard<py::gil_scoped_release>())
      .def("release_host_cache", &Allocator::release_host_cache,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "mem_get_info",
          [](Allocator& self) {
            MemInfo info;
            {
              py::gil_scoped_release release;
              info = self.mem_get_info();
            }
            return py::make_tuple(info.free_bytes, info.total_bytes);
          },
          "(free, total) device memory in bytes, as the driver reports it.");
}

}  // namespace tus::bindings
