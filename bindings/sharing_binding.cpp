// Python view of sharing a tag across processes (Note [Sharing] in
// allocator/sharing/shared_mapping.h). Chunks cross as (offset, size, fd) tuples; the sockets and
// the protocol are torch_uvm_saver/sharing.py's. Driver calls run without the GIL.
#include <pybind11/stl.h>

#include <memory>
#include <tuple>
#include <vector>

#include "allocator/allocator.h"
#include "allocator/registry.h"
#include "allocator/sharing/shared_mapping.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

using ChunkTuple = std::tuple<std::size_t, std::size_t, int>;
using SegmentTuple = std::tuple<std::uintptr_t, std::size_t, std::vector<ChunkTuple>>;

std::vector<SharedChunk> to_chunks(const std::vector<ChunkTuple>& tuples) {
  std::vector<SharedChunk> chunks;
  chunks.reserve(tuples.size());
  for (const auto& [offset, size, fd] : tuples) chunks.push_back(SharedChunk{offset, size, fd});
  return chunks;
}

std::vector<SegmentTuple> export_tag(Allocator& self, const std::string& tag) {
  std::vector<SharedSegment> segments;
  {
    py::gil_scoped_release release;
    segments = self.export_tag(tag);
  }
  std::vector<SegmentTuple> out;
  for (const SharedSegment& segment : segments) {
    std::vector<ChunkTuple> chunks;
    for (const SharedChunk& chunk : segment.chunks)
      chunks.emplace_back(chunk.offset, chunk.size, chunk.fd);
    out.emplace_back(segment.ptr, segment.size, std::move(chunks));
  }
  return out;
}

}  // namespace

void bind_sharing(py::module_& module) {
  auto allocator = py::reinterpret_borrow<py::class_<Allocator, std::shared_ptr<Allocator>>>(
      module.attr("Allocator"));
  allocator.def("export_tag", &export_tag, py::arg("tag"),
                "(address, size, [(offset, size, fd), ...]) for each segment of `tag`, the fds "
                "exported for another process (the caller closes them).");

  py::class_<SharedMapping, std::shared_ptr<SharedMapping>>(
      module, "SharedMapping",
      "Another process's shared tag, mapped here at addresses of this process's own.")
      .def(py::init([](int device, std::shared_ptr<Driver> driver) {
             if (!driver) driver = Registry::instance().driver();
             return std::make_shared<SharedMapping>(std::move(driver), device);
           }),
           py::arg("device"), py::arg("driver") = nullptr,
           "`driver`: the process driver when None (another for tests of one driver).")
      .def(
          "add",
          [](SharedMapping& self, std::size_t size, const std::vector<ChunkTuple>& chunks) {
            const std::vector<SharedChunk> converted = to_chunks(chunks);
            py::gil_scoped_release release;
            return static_cast<std::uintptr_t>(self.add(size, converted));
          },
          py::arg("size"), py::arg("chunks"),
          "Map one segment's chunks at a new address range; returns its base address.")
      .def("unmap", &SharedMapping::unmap, py::call_guard<py::gil_scoped_release>(),
           "Unmap every segment and release the imported memory; the addresses stay.")
      .def(
          "remap",
          [](SharedMapping& self, const std::vector<std::vector<ChunkTuple>>& segments) {
            std::vector<std::vector<SharedChunk>> converted;
            for (const auto& chunks : segments) converted.push_back(to_chunks(chunks));
            py::gil_scoped_release release;
            self.remap(converted);
          },
          py::arg("segments"), "Map the owner's new memory at the same addresses.")
      .def("close", &SharedMapping::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("mapped", &SharedMapping::mapped)
      .def_property_readonly("device", &SharedMapping::device)
      .def_property_readonly("bytes", &SharedMapping::bytes);
}

}  // namespace tus::bindings
