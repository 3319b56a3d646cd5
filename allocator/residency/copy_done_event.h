// The end of one batch of the LMS session's relocation copies (Note [Copies queued in one call]
// in torch_uvm_saver/queued_copies.py): made and recorded with the batch, in the same native
// call, and waited for by whoever reads or reuses the blocks it moved. A torch.cuda.Event made
// for each of a step's 200 batches cost 9 us of host time on an H200; this one costs the
// driver's create and record. It owns its driver event and gives it back when the last Python
// reference goes: a record still pending then is released by the driver once it completes.
#pragma once

#include <memory>

#include "allocator/driver/driver.h"

namespace tus {

class CopyDoneEvent {
 public:
  // Creates the driver event (no timing); throws the driver's error, holding nothing.
  CopyDoneEvent(std::shared_ptr<Driver> driver, int device);
  ~CopyDoneEvent();
  CopyDoneEvent(const CopyDoneEvent&) = delete;
  CopyDoneEvent& operator=(const CopyDoneEvent&) = delete;

  // Completes after everything queued on `stream` so far (again: a wait already queued keeps
  // the record it was queued behind).
  void record(StreamHandle stream);
  // Work queued on `stream` from now on runs after the last record.
  void make_wait(StreamHandle stream) const;
  void synchronize() const;
  bool done() const;  // never blocks

  EventHandle handle() const { return event_; }
  int device() const { return device_; }

 private:
  std::shared_ptr<Driver> driver_;
  int device_;
  EventHandle event_ = nullptr;
};

}  // namespace tus
