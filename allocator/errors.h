// Typed errors of the allocator core. Every failure the library can report is one of these; they
// become Python exceptions in the bindings. Nothing in the core calls exit() or abort().
#pragma once

#include "allocator/message.h"

#include <initializer_list>
#include <stdexcept>
#include <string>

namespace tus {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Device (or pinned host) memory could not be had. Becomes torch.OutOfMemoryError in Python.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A driver call failed. `code` is the CUresult (or the simulated driver's stand-in for it).
// Note [Sizes past the address space]
//  A request whose size, rounded up to a granularity, a size class or a segment size, would pass
//  2**64 - 1 bytes cannot be represented: the rounding would wrap to a small number and the
//  request would get a tiny block (or reach the driver as size 0). It is an out-of-memory error,
//  as PyTorch's is for an absurd size, but one no device could satisfy: it is raised before
//  anything changes, is not counted in num_ooms (the device never refused anything), and no
//  out-of-memory ladder frees caches or pages memory out for it.
class SizeOverflow : public OutOfMemory {
 public:
  using OutOfMemory::OutOfMemory;
};

class CudaError : public Error {
 public:
  CudaError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The call is valid in general but not in the current state (a tag with an open region, ...).
class InvalidState : public Error {
 public:
  using Error::Error;
};

// A file operation failed (disk backup). `code` is the errno; the message names the path, the
// operation and the bytes done.
class IoError : public Error {
 public:
  IoError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// Builds "file:line: message" so every error says where it was raised.
inline std::string located(const char* file, int line, const std::string& message) {
  std::string path(file);
  for (const char* root : {"allocator/", "bindings/"}) {
    const auto slash = path.rfind(root);
    if (slash != std::string::npos) {
      path = path.substr(slash);
      break;
    }
  }
  Message out;
  out << message << " [" << path << ":" << line << "]";
  return out.str();
}

}  // namespace tus

// TUS_THROW(InvalidArgument, "pause: unknown tag '" << tag << "'")
#define TUS_THROW(Type, stream_expr)                                                 \
  do {                                                                               \
    Message tus_throw_message_;                                                      \
    tus_throw_message_ << stream_expr;                                               \
    throw ::tus::Type(::tus::located(__FILE__, __LINE__, tus_throw_message_.str())); \
  } while (0)

#include <exception>

namespace tus {

// Rethrows `error` as the same type with "<context>: " in front of its message (and `suffix`
// after it), so a driver error deep in pause/resume says which call and tag it belongs to.
[[noreturn]] inline void rethrow_with_context(std::exception_ptr error, const std::string& context,
                                              const std::string& suffix = "") {
  try {
    std::rethrow_exception(error);
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(context + ": " + e.what() + suffix);
  } catch (const CudaError& e) {
    throw CudaError(context + ": " + e.what() + suffix, e.code());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(context + ": " + e.what() + suffix);
  } catch (const InvalidState& e) {
    throw InvalidState(context + ": " + e.what() + suffix);
  } catch (const IoError& e) {
    throw IoError(context + ": " + e.what() + suffix, e.code());
  } catch (const std::exception& e) {
    throw Error(context + ": " + e.what() + suffix);
  }
}

}  // namespace tus
