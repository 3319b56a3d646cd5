// The process-wide side: the registry of per-device allocators that PyTorch's calls reach, and
// the calling thread's region configuration.
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "allocator/errors.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"
#include "allocator/residency/host_buffer_pool.h"
#include "allocator/stats/stats.h"
#include "bindings/arguments.h"
#include "bindings/bindings.h"
#include "bindings/pluggable_entry.h"
#include "bindings/region_args.h"

namespace py = pybind11;

namespace tus::bindings {

void bind_registry(py::module_& module) {
  module.def(
      "get_allocator", [](int device) { return Registry::instance().shared_allocator(device); },
      py::arg("device"), "The process allocator of `device`, created on first use.");
  module.def(
      "check_device", [](int device) { Registry::instance().check_device(device); },
      py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "InvalidArgumentError unless the driver has `device`; makes no allocator.");
  module.def(
      "allocators", [] { return Registry::instance().allocators(); },
      "Process allocators created so far.");
  module.def("get_driver", [] { return Registry::instance().driver(); });
  module.def(
      "set_disk_backup_dir",
      [](const std::optional<std::string>& path) {
        Registry::instance().set_disk_backup_dir(path);
      },
      py::arg("path"), py::call_guard<py::gil_scoped_release>(),
      "Directory of every allocator's disk backups, now and later (None unsets it).");
  module.def(
      "disk_backup_dir", [] { return Registry::instance().disk_backup_settings().directory; },
      py::call_guard<py::gil_scoped_release>());
  module.def(
      "set_disk_backup_chunk_bytes",
      [](const IntArgument& size) {
        const std::size_t bytes = whole_number({"set_disk_backup_chunk_bytes", "nbytes"}, size);
        py::gil_scoped_release release;
        Registry::instance().set_disk_backup_chunk_bytes(bytes);
      },
      py::arg("nbytes"));
  module.def(
      "disk_backup_chunk_bytes",
      [] { return Registry::instance().disk_backup_settings().chunk_bytes; },
      py::call_guard<py::gil_scoped_release>());
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
      [](const std::string& mode, const std::string& tag, bool cpu_backup,
         const std::optional<std::string>& preferred, const std::optional<std::string>& accessed_by,
         bool read_mostly) {
        thread_region() =
            make_region("region", tag, mode, cpu_backup, preferred, accessed_by, read_mostly);
      },
      py::arg("mode"), py::arg("tag"), py::arg("cpu_backup"),
      py::arg("preferred_location") = py::none(), py::arg("accessed_by") = py::none(),
      py::arg("read_mostly") = false,
      "Set the region the calling thread's allocations through PyTorch belong to.");
  py::class_<RegionConfig>(module, "RegionState",
                           "A thread's whole region state, saved to be put back later.");
  module.def(
      "save_thread_region", [] { return thread_region(); },
      "The calling thread's region state (restore_thread_region puts it back).");
  module.def(
      "restore_thread_region", [](const RegionConfig& state) { thread_region() = state; },
      py::arg("state"));
  module.def(
      "set_thread_host_backup",
      [](const std::optional<std::string>& backend) {
        thread_region().host_backup = !backend               ? HostBackup::kTagPolicy
                                      : *backend == "pinned" ? HostBackup::kPinned
                                      : *backend == "mmap"   ? HostBackup::kPageable
                                                             : throw InvalidArgument(
                                                                   "cpu_backup_backend is 'pinned', "
                                                                   "'mmap' or None, got '" +
                                                                   *backend + "'");
      },
      py::arg("backend"),
      "Where the calling thread's backed allocations keep their backup: 'pinned', 'mmap' "
      "(pageable) or None (the tag's policy).");
  module.def(
      "preload_hook", [] { return Registry::instance().preload_hook(); },
      "True when the preload library interposes cudaMalloc in this process.");
  module.def(
      "set_default_backup_policy",
      [](bool retain, bool pinned) {
        BackupPolicy policy = Registry::instance().default_backup_policy();
        policy.retain = retain;
        policy.pinned = pinned;
        Registry::instance().set_default_backup_policy(policy);
      },
      py::arg("retain"), py::arg("pinned"), "The backup policy new tags start with.");
  module.def(
      "default_backup_policy",
      [] {
        const BackupPolicy policy = Registry::instance().default_backup_policy();
        return py::make_tuple(policy.retain, policy.pinned);
      },
      "(retain, pinned) of the policy new tags start with.");
  module.def(
      "set_memory_margin",
      [](const IntArgument& margin) {
        Registry::instance().set_memory_margin(
            whole_number({"memory_margin_bytes", "value"}, margin));
      },
      py::arg("bytes"),
      "Refuse hooked allocations that would leave less than `bytes` free on the device.");
  module.def(
      "clear_thread_region", [] { thread_region() = RegionConfig{}; },
      "The calling thread leaves every region (the global hook then uses its default).");
  module.def(
      "enable_global_hook",
      [](const std::string& default_mode) {
        Registry::instance().enable_global_hook(
            make_region("use_global_allocator", "default", default_mode, false));
      },
      py::arg("default_mode"),
      "Serve every allocation PyTorch makes from the block caches (after "
      "change_current_allocator); outside regions in `default_mode`.");
  module.def(
      "global_hook",
      []() -> std::optional<std::string> {
        Registry& registry = Registry::instance();
        if (!registry.global_hook()) return std::nullopt;
        return std::string(mode_name(registry.global_default().mode));
      },
      "The default mode of the global hook, or None when it is not enabled.");
  module.def(
      "get_thread_region",
      [] {
        const RegionConfig& region = thread_region();
        return py::make_tuple(mode_name(region.mode), region.tag, region.cpu_backup, region.active);
      },
      "(mode, tag, cpu_backup, inside a region) of the calling thread.");
  module.def(
      "set_pin_ahead",
      [](const FlagArgument& enabled) {
        HostBufferPool::set_pin_ahead(flag({"set_pin_ahead", "enabled"}, enabled));
      },
      py::arg("enabled"),
      "Pin backup buffers ahead of the first pause, every allocator (Note [Pinning ahead] in "
      "host_buffer_pool.h).");
  module.def("get_pin_ahead", &HostBufferPool::pin_ahead,
             "Whether backup buffers are pinned ahead (TUS_PIN_AHEAD until set_pin_ahead).");
  module.def("managed_process_total", &ManagedResidency::process_total,
             "Managed bytes allocated by every allocator of the process (the guard's total).");
  module.def("last_malloc_error", &last_malloc_error,
             "Why the last allocation PyTorch asked of us on this thread failed ('' if none).");
  module.def(
      "stat_docs",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> docs;
        for (const StatDoc& doc : stat_docs()) docs.emplace_back(doc.key, doc.kind, doc.doc);
        return docs;
      },
      "Every statistic as (key, kind, doc): kind 'gauge', 'counter' or 'timer' for the families "
      "kept per scope, 'device' for the keys kept once per device (allocator/stats/stat_list.h).");
  module.attr("MALLOC_SYMBOL") = kMallocSymbol;
  module.attr("FREE_SYMBOL") = kFreeSymbol;
  module.attr("HOOK_OUT_OF_MEMORY") = kHookOutOfMemory;
}

}  // namespace tus::bindings
