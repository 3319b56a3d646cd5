// RelocationPlanner for the Python LMS session (torch_uvm_saver/lms_session.py), which calls
// before_use() once per operator: it returns None when there is nothing to do, so the common
// case builds no lists. The GIL stays held: the planner is pure bookkeeping and not thread-safe.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "allocator/residency/copy_done_event.h"
#include "allocator/residency/relocation_copies.h"
#include "allocator/residency/relocation_planner.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

py::dict counters_dict(const RelocationPlanner& planner) {
  const RelocationPlanner::Counters& c = planner.counters();
  py::dict out;
  out["iterations"] = c.iterations;
  out["pageout_count"] = c.pageout_count;
  out["pageout_bytes"] = c.pageout_bytes;
  out["pagein_count"] = c.pagein_count;
  out["pagein_bytes"] = c.pagein_bytes;
  out["prefetch_count"] = c.prefetch_count;
  out["prefetch_bytes"] = c.prefetch_bytes;
  out["prefetch_hits"] = c.prefetch_hits;
  out["prefetch_wasted"] = c.prefetch_wasted;
  out["prefetch_failed"] = c.prefetch_failed;
  out["oom_events"] = c.oom_events;
  out["over_budget_uses"] = c.over_budget_uses;
  out["ahead_pageout_count"] = c.ahead_pageout_count;
  out["ahead_pageout_bytes"] = c.ahead_pageout_bytes;
  out["budget_bytes"] = planner.budget();
  out["resident_bytes"] = planner.resident_bytes();
  out["peak_resident_bytes"] = planner.peak_resident_bytes();
  out["registered_bytes"] = planner.registered_bytes();
  out["blocks"] = planner.block_count();
  out["operators_per_iteration"] = planner.operators_per_iteration();
  out["capped_positions"] = planner.capped_positions();
  return out;
}

}  // namespace

void bind_relocation(py::module_& module) {
  using Planner = RelocationPlanner;
  py::class_<Planner>(module, "RelocationPlanner",
                      "Which storages go out and come back in (Note [Relocating LMS]).")
      .def(py::init<std::size_t>(), py::arg("budget"))
      .def_property("budget", &Planner::budget, &Planner::set_budget)
      .def_property("prefetch_depth", &Planner::prefetch_depth, &Planner::set_prefetch_depth)
      .def_property("page_out_ahead", &Planner::page_out_ahead, &Planner::set_page_out_ahead,
                    "Note [Paging out ahead]: on by default; off, it forgets what it learned.")
      .def("add", &Planner::add, py::arg("id"), py::arg("nbytes"), py::arg("persistent"))
      .def("remove", &Planner::remove, py::arg("id"))
      .def("make_persistent", &Planner::make_persistent, py::arg("id"))
      .def("__contains__", &Planner::contains)
      .def("is_out", &Planner::is_out, py::arg("id"))
      .def(
          "before_use",
          [](Planner& planner, const std::vector<Planner::BlockId>& ids) -> py::object {
            Planner::Plan plan = planner.before_use(ids);
            if (plan.empty()) return py::none();
            return py::make_tuple(std::move(plan.page_out), std::move(plan.page_in),
                                  std::move(plan.prefetch));
          },
          py::arg("ids"), "(page_out, page_in, prefetch) lists of ids, or None.")
      .def(
          "bring_in",
          [](Planner& planner, const std::vector<Planner::BlockId>& ids) -> py::object {
            Planner::Plan plan = planner.bring_in(ids);
            if (plan.empty()) return py::none();
            return py::make_tuple(std::move(plan.page_out), std::move(plan.page_in),
                                  std::move(plan.prefetch));
          },
          py::arg("ids"), "Like before_use for a view: pages in, reads nothing.")
      .def("make_room", &Planner::make_room, py::arg("nbytes"), py::arg("keep"))
      .def("prefetch_failed", &Planner::prefetch_failed, py::arg("id"))
      .def("pageout_failed", &Planner::pageout_failed, py::arg("id"))
      .def("cap_here", &Planner::cap_here, py::arg("nbytes"))
      .def("evict_all", &Planner::evict_all, py::arg("keep"))
      .def("bring_all_in", &Planner::bring_all_in)
      .def("end_iteration", &Planner::end_iteration)
      .def("coarsen", &Planner::coarsen, py::arg("to"),
           "After end_iteration: position p of the last iteration becomes to[p].")
      .def_property_readonly("position", &Planner::position)
      .def("budget_at", &Planner::budget_at, py::arg("position"))
      .def_property_readonly("resident_bytes", &Planner::resident_bytes)
      .def_property_readonly("registered_bytes", &Planner::registered_bytes)
      .def("counters", &counters_dict);

  py::class_<CopyDoneEvent, std::shared_ptr<CopyDoneEvent>>(
      module, "CopyDoneEvent",
      "The end of a batch of relocation copies (Note [Copies queued in one call]); stream "
      "arguments are raw handles (torch.cuda.Stream.cuda_stream).")
      .def(py::init<std::shared_ptr<Driver>, int>(), py::arg("driver"), py::arg("device"))
      .def(
          "record",
          [](CopyDoneEvent& event, std::uintptr_t stream) {
            event.record(reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("stream"), "Completes after what `stream` has queued so far.")
      .def(
          "wait",
          [](const CopyDoneEvent& event, std::uintptr_t stream) {
            event.make_wait(reinterpret_cast<StreamHandle>(stream));
          },
          py::arg("stream"), "Work queued on `stream` from now on runs after the last record.")
      .def("synchronize", &CopyDoneEvent::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &CopyDoneEvent::done, "Whether the last record has completed; never blocks.")
      .def_property_readonly("device", &CopyDoneEvent::device);

  // Raw handles and addresses, as torch gives them (Stream.cuda_stream, Event.cuda_event,
  // data_ptr()): the session checks what they belong to. The GIL stays held: a batch is a few
  // asynchronous calls, and the caller's buffers stay alive while it runs.
  module.def(
      "queue_relocation_copies",
      [](const std::shared_ptr<Driver>& driver, int device, std::uintptr_t stream,
         std::uintptr_t handover, const std::vector<std::uintptr_t>& after_streams,
         const std::vector<std::shared_ptr<CopyDoneEvent>>& after_events,
         const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>>& copies,
         bool to_host) {
        // StreamHandle and EventHandle are both void*.
        auto handle = [](std::uintptr_t raw) { return reinterpret_cast<void*>(raw); };
        std::vector<StreamHandle> streams;
        streams.reserve(after_streams.size());
        for (std::uintptr_t raw : after_streams) streams.push_back(handle(raw));
        std::vector<EventHandle> events;
        events.reserve(after_events.size());
        for (const auto& event : after_events) {
          events.push_back(event == nullptr ? nullptr : event->handle());
        }
        std::vector<RelocationCopy> batch;
        batch.reserve(copies.size());
        for (const auto& [device_ptr, host_ptr, size] : copies) {
          batch.push_back(RelocationCopy{device_ptr, handle(host_ptr), size});
        }
        // Made first: a batch whose end cannot be recorded queues nothing.
        auto done = std::make_shared<CopyDoneEvent>(driver, device);
        queue_relocation_copies(*driver, device, handle(stream), handle(handover), streams, events,
                                batch, to_host ? CopyDirection::kToHost : CopyDirection::kToDevice,
                                done->handle());
        return done;
      },
      py::arg("driver"), py::arg("device"), py::arg("stream"), py::arg("handover"),
      py::arg("after_streams"), py::arg("after_events"), py::arg("copies"), py::arg("to_host"),
      "Queues (device address, host address, bytes) copies on `stream` after `after_streams` "
      "(through the `handover` event) and the CopyDoneEvents `after_events`; returns a new "
      "CopyDoneEvent recorded after them (Note [Copies queued in one call]).");
}

}  // namespace tus::bindings
