#include "bindings/arguments.h"

#include <pybind11/stl.h>

#include <string>

#include "allocator/errors.h"
#include "bindings/bindings.h"
#include "bindings/region_args.h"

namespace py = pybind11;

namespace tus::bindings {

namespace {

constexpr std::size_t kLongestShown = 60;  // characters of a value's repr in a message

// "1.5 (float)", "'no' (str)", "None": what came, for messages.
std::string shown(py::handle value) {
  if (value.is_none()) return "None";
  std::string text = py::repr(value).cast<std::string>();
  if (text.size() > kLongestShown) text = text.substr(0, kLongestShown - 3) + "...";
  return text + " (" + Py_TYPE(value.ptr())->tp_name + ")";
}

std::string where(Argument argument) {
  return std::string(argument.call) + "(" + argument.name + ")";
}

[[noreturn]] void wrong_type(Argument argument, const std::string& expected, py::handle value) {
  throw py::type_error(where(argument) + ": expected " + expected + ", got " + shown(value));
}

bool is_numpy_bool(py::handle value) {
  const std::string type = Py_TYPE(value.ptr())->tp_name;
  return type == "numpy.bool_" || type == "numpy.bool";
}

// The integer `value` stands for; TypeError for anything that is not one (a bool neither).
py::int_ integer(Argument argument, py::handle value, const std::string& expected) {
  if (PyBool_Check(value.ptr()) || is_numpy_bool(value) || !PyIndex_Check(value.ptr())) {
    wrong_type(argument, expected, value);
  }
  return py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
}

// The integer as a size_t; nullopt when it is past 2**64 - 1. Negative ones are the caller's.
std::optional<std::size_t> as_size(const py::int_& number) {
  const std::size_t converted = PyLong_AsSize_t(number.ptr());
  if (converted == static_cast<std::size_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return std::nullopt;
  }
  return converted;
}

std::string counted(const char* unit, bool none_allowed) {
  return std::string("an int (a number of ") + unit + ")" + (none_allowed ? " or None" : "");
}

// The int `value` stands for, once it is known to be one and >= 0; nullopt when it is past
// 2**64 - 1, which each caller reports in its own way.
std::optional<std::size_t> non_negative(Argument argument, py::handle value, const char* unit,
                                        bool none_allowed) {
  const py::int_ number = integer(argument, value, counted(unit, none_allowed));
  if (!number) throw py::error_already_set();
  if (number < py::int_(0)) {
    TUS_THROW(InvalidArgument, where(argument) << ": expected a number of " << unit << " >= 0, got "
                                               << py::str(number).cast<std::string>());
  }
  return as_size(number);
}

std::size_t checked_whole_number(Argument argument, py::handle value, const char* unit,
                                 bool none_allowed) {
  const std::optional<std::size_t> number = non_negative(argument, value, unit, none_allowed);
  if (!number) {
    TUS_THROW(InvalidArgument, where(argument)
                                   << ": expected a number of " << unit << " up to 2**64 - 1, got "
                                   << py::str(value).cast<std::string>());
  }
  return *number;
}

}  // namespace

std::size_t whole_number(Argument argument, py::handle value, const char* unit) {
  return checked_whole_number(argument, value, unit, false);
}

std::optional<std::size_t> optional_whole_number(Argument argument, py::handle value,
                                                 const char* unit) {
  if (value.is_none()) return std::nullopt;
  return checked_whole_number(argument, value, unit, true);
}

std::size_t requested_size(const char* call, py::handle value) {
  const std::optional<std::size_t> size = non_negative({call, "size"}, value, "bytes", false);
  if (!size) {
    TUS_THROW(SizeOverflow, call << " of " << py::str(value).cast<std::string>()
                                 << " bytes: the size cannot be represented (past 2**64 - 1)");
  }
  return *size;
}

bool flag(Argument argument, py::handle value) {
  if (PyBool_Check(value.ptr())) return value.ptr() == Py_True;
  if (is_numpy_bool(value)) return PyObject_IsTrue(value.ptr()) == 1;
  wrong_type(argument, "True or False", value);
}

std::string tag(const char* call, py::handle value) {
  const Argument argument{call, "tag"};
  if (!PyUnicode_Check(value.ptr())) wrong_type(argument, "a non-empty string (a tag)", value);
  return checked_tag(call, value.cast<std::string>());
}

std::string text(Argument argument, py::handle value) {
  if (!PyUnicode_Check(value.ptr())) wrong_type(argument, "a string", value);
  return value.cast<std::string>();
}

void bind_arguments(py::module_& module) {
  module.def(
      "check_tag",
      [](const std::string& call, const TextArgument& value) { return tag(call.c_str(), value); },
      py::arg("call"), py::arg("tag"),
      "`tag` if it is a tag (a non-empty string); else TypeError or InvalidArgumentError naming "
      "`call` (Note [Argument errors] in bindings/arguments.h).");
  module.def(
      "check_flag",
      [](const std::string& call, const std::string& name, const FlagArgument& value) {
        return flag({call.c_str(), name.c_str()}, value);
      },
      py::arg("call"), py::arg("name"), py::arg("value"),
      "`value` if it is True or False; else a TypeError naming `call` and `name`.");
  module.def(
      "check_whole_number",
      [](const std::string& call, const std::string& name, const IntArgument& value,
         const std::string& unit) {
        return whole_number({call.c_str(), name.c_str()}, value, unit.c_str());
      },
      py::arg("call"), py::arg("name"), py::arg("value"), py::arg("unit") = "bytes",
      "`value` if it is a whole number from 0 to 2**64 - 1 counting `unit`; else TypeError or "
      "InvalidArgumentError naming `call` and `name`.");
  module.def(
      "check_region",
      [](const std::string& call, const TextArgument& mode, const TextArgument& tag_value,
         const FlagArgument& cpu_backup, const OptionalTextArgument& preferred,
         const OptionalTextArgument& accessed_by, const FlagArgument& read_mostly) {
        const char* name = call.c_str();
        const auto location = [name](const char* argument, const OptionalTextArgument& value) {
          return value.is_none() ? std::nullopt
                                 : std::optional<std::string>(text({name, argument}, value));
        };
        const RegionConfig region = make_region(
            name, tag(name, tag_value), text({name, "mode"}, mode),
            flag({name, "enable_cpu_backup"}, cpu_backup),
            location("preferred_location", preferred), location("accessed_by", accessed_by),
            flag({name, "read_mostly"}, read_mostly));
        return py::make_tuple(
            mode_name(region.mode), region.tag, region.cpu_backup,
            location_text(region.advice.preferred),
            region.advice.accessed_by ? location_text(*region.advice.accessed_by) : std::nullopt,
            region.advice.read_mostly);
      },
      py::arg("call"), py::arg("mode"), py::arg("tag"), py::arg("enable_cpu_backup"),
      py::arg("preferred_location"), py::arg("accessed_by"), py::arg("read_mostly"),
      "The region's arguments checked and in the form set_thread_region takes: (mode, tag, "
      "cpu_backup, preferred_location, accessed_by, read_mostly). Locations are None, 'cpu' or "
      "'cuda:<index>'.");
}

}  // namespace tus::bindings
