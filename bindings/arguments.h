// Python arguments as the core's types: the one place where each kind of argument is checked
// (ARCHITECTURE.md, decision 11). The Python API forwards what its caller passed, and the binding
// converts it here; where Python must hold a value itself (a backup policy kept for allocators
// made later, advise's read_mostly, lms_session's options) it asks through _C.check_tag,
// _C.check_flag, _C.check_whole_number and _C.check_region, which are these same functions.
//
// Note [Argument errors]
//  A value of the wrong type raises TypeError; a value of the right type that the call cannot
//  take raises InvalidArgument. Both messages name the call and the argument as the Python API
//  spells them, say what was expected and show what came ("set_limit_lms(limit): expected an int
//  (a number of bytes), got 1.5 (float)"), and both are raised before anything changes. Nothing is
//  coerced: a float is not truncated to an int, "no" is not a true flag, a bool is not a number.
//  tests/sim/test_bad_inputs.py holds the table of refused inputs that README's is generated from.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/typing.h>

#include <cstddef>
#include <optional>
#include <string>

namespace tus::bindings {

// Parameter types of the bindings that take what Python passed and check it here: each accepts
// any object (the check and its message are ours, not pybind11's) and shows the type expected in
// signatures and in _C.pyi.
using IntArgument = pybind11::typing::Union<pybind11::int_>;
using OptionalIntArgument = pybind11::typing::Optional<pybind11::int_>;
using FlagArgument = pybind11::typing::Union<pybind11::bool_>;
using TextArgument = pybind11::typing::Union<pybind11::str>;
using OptionalTextArgument = pybind11::typing::Optional<pybind11::str>;

// Where an argument is used, as the Python API spells it: {"set_limit_lms", "limit"}.
struct Argument {
  const char* call;
  const char* name;
};

// A whole number from 0 to 2**64 - 1: an int, or anything with __index__ (numpy's integers) but
// a bool. `unit` names what it counts, for messages ("bytes", "operators").
std::size_t whole_number(Argument argument, pybind11::handle value, const char* unit = "bytes");
// The same, or None.
std::optional<std::size_t> optional_whole_number(Argument argument, pybind11::handle value,
                                                 const char* unit = "bytes");
// A size to allocate: as whole_number, but one past 2**64 - 1 is a SizeOverflow, the
// out-of-memory error of a size no device could hold (Note [Sizes past the address space]).
std::size_t requested_size(const char* call, pybind11::handle value);
// True or False (numpy's bool too); nothing else.
bool flag(Argument argument, pybind11::handle value);
// A non-empty str.
std::string tag(const char* call, pybind11::handle value);
// A str.
std::string text(Argument argument, pybind11::handle value);

// _C.check_tag, _C.check_flag, _C.check_whole_number and _C.check_region.
void bind_arguments(pybind11::module_& module);

}  // namespace tus::bindings
