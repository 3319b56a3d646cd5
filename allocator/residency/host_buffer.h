// HostBuffer: a span of host memory that holds a segment's backup. Pinned buffers come from (and
// go back to) the HostBufferPool; pageable ones are mapped for one pause and unmapped at resume.
#pragma once

#include <cstddef>

namespace tus {

struct HostBuffer {
  void* ptr = nullptr;
  std::size_t size = 0;
  bool pinned = true;

  explicit operator bool() const { return ptr != nullptr; }
  char* bytes() const { return static_cast<char*>(ptr); }
};

}  // namespace tus
