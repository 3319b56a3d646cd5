// CopyEngine: asynchronous copies between device and host on a stream of its own, so backups and
// restores never queue behind (or hold up) the client's kernels, plus the events that tell when
// each copy is done. The stream and events are created on first use and reused.
#pragma once

#include <cstddef>
#include <vector>

#include "allocator/driver/driver.h"

namespace tus {

class CopyEngine {
 public:
  CopyEngine(Driver& driver, int device) : driver_(driver), device_(device) {}
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  void to_host(void* dst, DevicePtr src, std::size_t size);
  void to_device(DevicePtr dst, const void* src, std::size_t size);
  void within_device(DevicePtr dst, DevicePtr src, std::size_t size);
  // Marks the point after every copy queued so far; wait(mark) blocks until those are done.
  std::size_t mark();
  void wait(std::size_t mark);
  // Forgets the marks (events are kept for reuse).
  void reset_marks() { marks_used_ = 0; }
  void synchronize();
  // Records `event` after every copy queued so far (for a consumer stream to wait on).
  void record(EventHandle event);
  // Copies queued from now on start only once `event` has completed (no host wait).
  void wait_for(EventHandle event);

 private:
  StreamHandle stream();

  Driver& driver_;
  const int device_;
  StreamHandle stream_ = nullptr;
  bool has_stream_ = false;
  std::vector<EventHandle> events_;
  std::size_t marks_used_ = 0;
};

}  // namespace tus
