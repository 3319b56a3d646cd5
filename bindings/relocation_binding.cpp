// RelocationPlanner for the Python LMS session (torch_uvm_saver/lms_session.py), which calls
// before_use() once per operator: it returns None when there is nothing to do, so the common
// case builds no lists. The GIL stays held: the planner is pure bookkeeping and not thread-safe.
#include <pybind11/stl.h>

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
}

}  // namespace tus::bindings
