// Python view of the Allocator's named weight snapshots (residency/snapshot_store.h). Entries
// arrive as (name, address, bytes, layout) tuples that torch_uvm_saver/snapshots.py builds from
// tensors; the GIL is released around each call, which takes the allocator's lock and copies.
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "allocator/allocator.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

using EntryTuple = std::tuple<std::string, std::uintptr_t, std::size_t, std::string>;

std::vector<SnapshotEntry> to_entries(const std::vector<EntryTuple>& tuples) {
  std::vector<SnapshotEntry> entries;
  entries.reserve(tuples.size());
  for (const auto& [name, ptr, bytes, layout] : tuples) {
    entries.push_back(SnapshotEntry{name, ptr, bytes, layout});
  }
  return entries;
}

py::dict info_dict(const SnapshotInfo& info) {
  py::dict out;
  out["name"] = info.name;
  out["bytes"] = info.bytes;
  out["held_bytes"] = info.held_bytes;
  out["entries"] = info.entries;
  out["on_device"] = info.on_device;
  out["tag"] = info.tag.empty() ? py::object(py::none()) : py::object(py::str(info.tag));
  return out;
}

}  // namespace

void bind_snapshots(py::module_& module) {
  auto allocator = py::reinterpret_borrow<py::class_<Allocator, std::shared_ptr<Allocator>>>(
      module.attr("Allocator"));
  allocator
      .def(
          "snapshot",
          [](Allocator& self, const std::string& name, const std::vector<EntryTuple>& entries,
             bool on_device) {
            const std::vector<SnapshotEntry> converted = to_entries(entries);
            py::gil_scoped_release release;
            return self.snapshot(name, converted, on_device);
          },
          py::arg("name"), py::arg("entries"), py::arg("on_device") = false,
          "Copy the (name, address, bytes, layout) entries into a snapshot called `name`, "
          "replacing one of that name once the copies are done; returns the bytes copied.")
      .def("snapshot_tag", &Allocator::snapshot_tag, py::arg("name"), py::arg("tag"),
           py::arg("on_device") = false, py::call_guard<py::gil_scoped_release>(),
           "Snapshot every live allocation of `tag`; returns the bytes copied.")
      .def(
          "restore_snapshot",
          [](Allocator& self, const std::string& name, const std::vector<EntryTuple>& current) {
            const std::vector<SnapshotEntry> converted = to_entries(current);
            py::gil_scoped_release release;
            return self.restore_snapshot(name, converted);
          },
          py::arg("name"), py::arg("current") = std::vector<EntryTuple>{},
          "Write the snapshot back; `current` is what its entries are now, in its order (none "
          "for a tag's snapshot). Returns the bytes written.")
      .def("drop_snapshot", &Allocator::drop_snapshot, py::arg("name"),
           py::call_guard<py::gil_scoped_release>(),
           "Give the snapshot's storage back; returns the bytes it held.")
      .def(
          "snapshots",
          [](const Allocator& self) {
            std::vector<SnapshotInfo> infos;
            {
              py::gil_scoped_release release;
              infos = self.snapshots();
            }
            py::list out;
            for (const SnapshotInfo& info : infos) out.append(info_dict(info));
            return out;
          },
          "The snapshots of this device: name, bytes, held_bytes, entries, on_device, tag.");
}

}  // namespace tus::bindings
