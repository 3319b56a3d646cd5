// Python view of one device's Allocator. The GIL is released around every call that takes the
// allocator's lock (which a pause holds while its copies run) or reaches the driver, so a pause
// on one thread never blocks Python on another. Python objects are built only with the GIL held.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "allocator/allocator.h"
#include "allocator/errors.h"
#include "bindings/arguments.h"
#include "bindings/bindings.h"
#include "bindings/region_args.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

using Location = std::optional<std::string>;

Advice parse_advice(const std::string& name) {
  if (name == "set_read_mostly") return Advice::kSetReadMostly;
  if (name == "unset_read_mostly") return Advice::kUnsetReadMostly;
  if (name == "set_preferred_location") return Advice::kSetPreferredLocation;
  if (name == "unset_preferred_location") return Advice::kUnsetPreferredLocation;
  if (name == "set_accessed_by") return Advice::kSetAccessedBy;
  if (name == "unset_accessed_by") return Advice::kUnsetAccessedBy;
  TUS_THROW(InvalidArgument, "unknown advice '" << name << "'");
}

py::dict attributes_dict(const RangeAttributes& attributes) {
  py::dict out;
  out["preferred_location"] = location_text(attributes.preferred);
  out["last_prefetch_location"] = location_text(attributes.last_prefetch);
  out["read_mostly"] = attributes.read_mostly;
  py::list accessed;
  for (const MemLocation& location : attributes.accessed_by) {
    accessed.append(location_name(location));
  }
  out["accessed_by"] = accessed;
  return out;
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

// Python's malloc/block_malloc: region arguments as the Python side spells them, GIL released
// around the call (it takes the allocator's lock).
using AllocateMethod = DevicePtr (Allocator::*)(std::size_t, StreamHandle, const RegionConfig&);
auto allocating(const char* call, AllocateMethod method) {
  return [call, method](Allocator& self, const IntArgument& size, const std::string& tag,
                        const std::string& mode, bool cpu_backup, std::uintptr_t stream,
                        const Location& preferred, const Location& accessed_by, bool read_mostly) {
    const std::size_t bytes = requested_size(call, size);
    const RegionConfig region =
        make_region(call, tag, mode, cpu_backup, preferred, accessed_by, read_mostly);
    py::gil_scoped_release release;
    return (self.*method)(bytes, reinterpret_cast<StreamHandle>(stream), region);
  };
}

}  // namespace

void bind_allocator(py::module_& module) {
  using Tag = std::optional<std::string>;
  py::class_<Allocator, std::shared_ptr<Allocator>>(module, "Allocator",
                                                    "The allocator of one device.")
      .def(py::init([](std::shared_ptr<Driver> driver, int device, std::size_t chunk_bytes,
                       std::size_t snapshot_slab_bytes) {
             return std::make_shared<Allocator>(std::move(driver), device,
                                                AllocatorOptions{chunk_bytes, snapshot_slab_bytes});
           }),
           py::arg("driver"), py::arg("device") = 0,
           py::arg("chunk_bytes") = AllocatorOptions{}.chunk_bytes,
           py::arg("snapshot_slab_bytes") = AllocatorOptions{}.snapshot_slab_bytes)
      .def_property_readonly("device", &Allocator::device)
      .def_property_readonly("driver", &Allocator::driver)
      .def("malloc", allocating("malloc", &Allocator::malloc), py::arg("size"),
           py::arg("tag") = "default", py::arg("mode") = "vmm", py::arg("cpu_backup") = false,
           py::arg("stream") = 0, py::arg("preferred_location") = py::none(),
           py::arg("accessed_by") = py::none(), py::arg("read_mostly") = false,
           "A segment of its own (what torch hook mode calls).")
      .def("block_malloc", allocating("block_malloc", &Allocator::block_malloc), py::arg("size"),
           py::arg("tag") = "default", py::arg("mode") = "device", py::arg("cpu_backup") = false,
           py::arg("stream") = 0, py::arg("preferred_location") = py::none(),
           py::arg("accessed_by") = py::none(), py::arg("read_mostly") = false,
           "A block from the global-mode cache (what the global hook calls).")
      .def("block_free", &Allocator::block_free, py::arg("ptr"),
           py::call_guard<py::gil_scoped_release>(),
           "Return a block to the global-mode cache; False if `ptr` is not a live block.")
      .def(
          "record_stream",
          [](Allocator& self, std::uintptr_t ptr, std::uintptr_t stream) {
            self.record_stream(ptr, reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("ptr"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("empty_cache", &Allocator::empty_cache, py::call_guard<py::gil_scoped_release>(),
           "Give the global-mode cache's wholly free segments back; returns their bytes.")
      .def(
          "prefetch",
          [](Allocator& self, std::uintptr_t ptr, std::size_t size, const std::string& location,
             std::uintptr_t stream) {
            const MemLocation to = parse_location(location);
            py::gil_scoped_release release;
            return self.prefetch(ptr, size, to, reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("ptr"), py::arg("size"), py::arg("location"), py::arg("stream") = 0,
          "Prefetch managed memory to 'cpu' or 'cuda:N'; returns the bytes scheduled.")
      .def(
          "advise",
          [](Allocator& self, std::uintptr_t ptr, std::size_t size, const std::string& advice,
             const Location& location) {
            const Advice parsed = parse_advice(advice);
            const MemLocation where = parse_location(location);
            py::gil_scoped_release release;
            self.advise(ptr, size, parsed, where);
          },
          py::arg("ptr"), py::arg("size"), py::arg("advice"), py::arg("location") = py::none())
      .def(
          "range_attributes",
          [](Allocator& self, std::uintptr_t ptr, std::size_t size) {
            RangeAttributes attributes;
            {
              py::gil_scoped_release release;
              attributes = self.range_attributes(ptr, size);
            }
            return attributes_dict(attributes);
          },
          py::arg("ptr"), py::arg("size"), "What the driver says about a managed range.")
      .def("is_managed", &Allocator::is_managed, py::arg("ptr"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "set_device_budget",
          [](Allocator& self, const OptionalIntArgument& budget) {
            const auto bytes = optional_whole_number({"set_device_budget", "budget"}, budget);
            py::gil_scoped_release release;
            self.set_device_budget(bytes.value_or(0));
          },
          py::arg("budget"),
          "Keep the managed bytes on the device under `budget` (None or 0: no "
          "budget).")
      .def("device_budget", &Allocator::device_budget, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_managed_limit",
          [](Allocator& self, const OptionalIntArgument& limit) {
            const auto bytes = optional_whole_number({"set_managed_limit", "limit"}, limit);
            py::gil_scoped_release release;
            self.set_managed_limit(bytes);
          },
          py::arg("limit"),
          "Refuse managed allocations past `limit` bytes (None: the default "
          "guard).")
      .def("managed_limit", &Allocator::managed_limit, py::call_guard<py::gil_scoped_release>())
      .def(
          "pin",
          [](Allocator& self, std::uintptr_t ptr, std::uintptr_t stream) {
            return self.pin(ptr, reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("ptr"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "Pin the lms block holding `ptr` (paging it in if it was reclaimed); False if the "
          "address is not lms memory.")
      .def("unpin", &Allocator::unpin, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def(
          "pin_all",
          [](Allocator& self, const std::vector<DevicePtr>& ptrs, std::uintptr_t stream) {
            return self.pin_all(ptrs, reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("ptrs"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "Pin the lms blocks holding `ptrs`, all or none; returns how many were lms blocks.")
      .def("unpin_all", &Allocator::unpin_all, py::arg("ptrs"),
           py::call_guard<py::gil_scoped_release>(),
           "Undo pin_all (blocks freed in between are skipped); returns how many were unpinned.")
      .def("describe_unguarded", &Allocator::describe_unguarded, py::arg("ptrs"),
           py::call_guard<py::gil_scoped_release>(),
           "'' when every address of `ptrs` is safe to touch unpinned; else why the first one is "
           "not (lms_check).")
      .def(
          "set_lms_headroom",
          [](Allocator& self, const OptionalIntArgument& headroom) {
            const auto bytes = optional_whole_number({"set_headroom_lms", "headroom"}, headroom);
            py::gil_scoped_release release;
            self.set_lms_headroom(bytes);
          },
          py::arg("headroom"),
          "Bytes kept free under the LMS limit by paging out ahead (0: off); None: limit / 32.")
      .def("lms_headroom", &Allocator::lms_headroom, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_lms_limit",
          [](Allocator& self, const IntArgument& limit) {
            const std::size_t bytes = whole_number({"set_limit_lms", "limit"}, limit);
            py::gil_scoped_release release;
            self.set_lms_limit(bytes);
          },
          py::arg("limit"),
          "Device memory held before inactive lms blocks are paged out (0: 95% "
          "of free plus held at the first lms allocation).")
      .def("lms_limit", &Allocator::lms_limit, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_lms_size",
          [](Allocator& self, const IntArgument& size) {
            const std::size_t bytes = whole_number({"set_size_lms", "size"}, size);
            py::gil_scoped_release release;
            self.set_lms_size(bytes);
          },
          py::arg("size"), "lms blocks smaller than `size` bytes share segments, never paged out.")
      .def("lms_size", &Allocator::lms_size, py::call_guard<py::gil_scoped_release>())
      .def("reclaim_inactive", &Allocator::reclaim_inactive,
           py::call_guard<py::gil_scoped_release>())
      .def("set_lms_on_managed", &Allocator::set_lms_on_managed, py::arg("managed"),
           py::call_guard<py::gil_scoped_release>())
      .def("lms_on_managed", &Allocator::lms_on_managed, py::call_guard<py::gil_scoped_release>())
      .def("lms_step", &Allocator::lms_step, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_lms_speculation",
          [](Allocator& self, const FlagArgument& enabled) {
            const bool on = flag({"set_speculation_lms", "enabled"}, enabled);
            py::gil_scoped_release release;
            self.set_lms_speculation(on);
          },
          py::arg("enabled"))
      .def(
          "set_lms_prefetch_depth",
          [](Allocator& self, const IntArgument& depth) {
            const std::size_t blocks = whole_number({"set_prefetch_lms", "depth"}, depth, "blocks");
            py::gil_scoped_release release;
            self.set_lms_prefetch_depth(blocks);
          },
          py::arg("depth"))
      .def("free", &Allocator::free, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def(
          "enter_region",
          [](Allocator& self, const std::string& tag, const std::string& mode, bool cpu_backup) {
            self.enter_region(make_region("region", tag, mode, cpu_backup));
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
          [](Allocator& self, const TextArgument& tag_value, const FlagArgument& retain,
             const FlagArgument& pinned, const FlagArgument& disk) {
            constexpr const char* kCall = "set_backup_policy";
            const std::string name = tag(kCall, tag_value);
            const BackupPolicy policy{flag({kCall, "retain"}, retain),
                                      flag({kCall, "pinned"}, pinned), flag({kCall, "disk"}, disk)};
            py::gil_scoped_release release;
            self.set_backup_policy(name, policy);
          },
          py::arg("tag"), py::arg("retain") = false, py::arg("pinned") = true,
          py::arg("disk") = false)
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
             out["disk"] = policy.disk;
             return out;
           })
      .def("set_disk_backup_dir", &Allocator::set_disk_backup_dir, py::arg("path"),
           py::call_guard<py::gil_scoped_release>(),
           "Directory of this allocator's disk backups (None unsets it).")
      .def("disk_backup_dir", &Allocator::disk_backup_dir, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_disk_backup_chunk_bytes",
          [](Allocator& self, const IntArgument& size) {
            const std::size_t bytes = whole_number({"set_disk_backup_chunk_bytes", "nbytes"}, size);
            py::gil_scoped_release release;
            self.set_disk_backup_chunk_bytes(bytes);
          },
          py::arg("nbytes"))
      .def("disk_backup_chunk_bytes", &Allocator::disk_backup_chunk_bytes,
           py::call_guard<py::gil_scoped_release>())
      .def("fail_disk_io_on", &Allocator::fail_disk_io_on, py::arg("op"), py::arg("nth"),
           py::arg("error"), py::call_guard<py::gil_scoped_release>(),
           "Make the nth 'open', 'write', 'sync' or 'read' of disk backup fail with errno `error`.")
      .def("clear_disk_faults", &Allocator::clear_disk_faults,
           py::call_guard<py::gil_scoped_release>())
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
      .def("wait_pin_ahead", &Allocator::wait_for_pin_ahead, py::arg("timeout") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "Wait until the host pool has pinned every backup buffer it expects (or gave up "
           "after a failure); False if `timeout` seconds passed first.")
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
