// One batch of the LMS session's relocation copies, queued in one call (Note [Copies queued in
// one call] in torch_uvm_saver/queued_copies.py): the session pages storages of PyTorch's own
// allocator out to pinned host buffers and back in, a few at a time, hundreds of times a step,
// and queuing each batch through PyTorch's calls cost the host tens of microseconds a copy.
#pragma once

#include <cstddef>
#include <vector>

#include "allocator/driver/driver.h"

namespace tus {

struct RelocationCopy {
  DevicePtr device = 0;  // the storage's bytes on the device
  void* host = nullptr;  // its pinned host buffer, at least `size` bytes
  std::size_t size = 0;
};

enum class CopyDirection { kToHost, kToDevice };

// Queues `copies` on `stream`, in order, in `direction`, after everything `after_streams` have
// queued so far (each recorded on `handover`, an event the caller owns and may record again at
// once: a wait keeps the record it was queued behind) and after each of `after_events`. Nothing
// waits on the host. A driver error stops the batch there: the copies before it stay queued,
// none after it is, and the error (its type kept) names the copy it stopped at. Every argument is
// checked before anything is queued. Then `done`, unless null, is recorded on `stream`: it
// completes once every copy of the batch has (an error recording it says all were queued).
void queue_relocation_copies(Driver& driver, int device, StreamHandle stream, EventHandle handover,
                             const std::vector<StreamHandle>& after_streams,
                             const std::vector<EventHandle>& after_events,
                             const std::vector<RelocationCopy>& copies, CopyDirection direction,
                             EventHandle done = nullptr);

}  // namespace tus
