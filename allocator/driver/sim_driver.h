// SimDriver: the Driver contract on host memory, so that CI and machines without a GPU run the
// same allocator code paths as a GPU does.
//
// Note [Simulated VMM]
//  - Each simulated device has a capacity; physical handles and plain allocations count against
//    it and fail with out-of-memory past it, like cuMemCreate/cuMemAlloc.
//  - A reservation is an mmap(PROT_NONE) range: touching it faults, as touching an unmapped
//    device address does on a GPU.
//  - A physical handle is a memfd; mapping it is mmap(MAP_SHARED | MAP_FIXED) of that memfd inside
//    the reservation, unmapping puts PROT_NONE back. Releasing a handle that is no longer mapped
//    closes the memfd, which gives the memory back to the host for real.
//  - Mapping rules are checked more strictly than CUDA does (a map must lie inside one
//    reservation and not overlap another mapping; an unmap must match one mapping exactly), so a
//    bookkeeping bug in the allocator fails loudly here.
//  - Managed memory is host memory whose advice and prefetch locations are recorded per page
//    (sim_managed_space.h); it does not count against the capacity.
//  - Streams are synchronous: a copy has finished when its call returns, unless copies are held.
//
// Note [Held copies]
//  hold_copies(true) models copies still running on the streams the allocator creates
//  (stream_create): such a copy moves its bytes at once but counts as in flight, and events
//  recorded behind it on its stream stay incomplete, until event_synchronize on one of them (which
//  completes everything before it on that stream), device_synchronize or hold_copies(false).
//  Unmapping memory that a copy in flight still reads or writes fails like the fault it is on a
//  GPU, where the copy engine hits an unmapped address and the context is lost.
//  - Fault injection: fail_on("unmap", 3) makes the 3rd unmap from now throw, as a driver error
//    would. "*" counts calls of every function.
//
// Note [Slow calls]
//  set_call_delay("device_synchronize", 0.5) makes every such call take half a second longer, so
//  a test of who waits for whom (a pause that stalls nothing else, a fork while a thread is inside
//  the allocator, a pause waiting for a slow pin) sees a long call on any machine, however fast.
//  The call is counted first (call_counts() shows that a thread is inside it), then sleeps with
//  the driver's lock released, as a slow driver call blocks its caller and not other threads'
//  calls, and then does its work. An injected fault fires before the delay.
//
// Note [What the driver holds]
//  held() counts what the process still holds of the driver, by kind: reservations, physical
//  handles (released ones still mapped included), mappings, plain and managed allocations, pinned
//  host buffers, streams and events. Tests tear an allocator down and expect every count at 0, so
//  a failure path that forgets an event or a host buffer shows as a leak. Destroying a stream or
//  an event the driver did not make (or made and destroyed already) fails, as a double destroy is
//  a bookkeeping bug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "allocator/driver/driver.h"
#include "allocator/driver/sim_managed_space.h"
#include "allocator/fork_guard.h"

namespace tus {

class SimDriver final : public Driver {
 public:
  static constexpr int kDefaultErrorCode = 999;  // CUDA_ERROR_UNKNOWN
  static constexpr int kOutOfMemoryCode = 2;     // CUDA_ERROR_OUT_OF_MEMORY

  explicit SimDriver(std::size_t capacity_bytes, int device_count = 1,
                     std::size_t granularity = 2 * kMiB);
  ~SimDriver() override;

  // Makes the `nth` (1-based) call of `call` from now on fail with `error_code`; `call` is a
  // method name of Driver or "*" for any. An error code of 2 raises OutOfMemory.
  void fail_on(const std::string& call, int nth, int error_code = kDefaultErrorCode);
  void clear_faults();
  // Calls made per method name since construction (or reset_call_counts).
  std::map<std::string, long> call_counts() const;
  void reset_call_counts();
  std::size_t used_bytes(int device) const;
  std::size_t capacity_bytes() const { return capacity_; }
  std::size_t mapped_ranges() const;
  std::size_t pinned_host_bytes() const;
  // Note [What the driver holds]: every object still alive, by kind.
  std::map<std::string, std::size_t> held() const;
  // While held, event_query reports recorded events as not yet complete (work "in flight" on
  // other streams); event_synchronize and device_synchronize still complete them.
  void hold_events(bool held);
  // Note [Held copies].
  void hold_copies(bool held);
  // Note [Slow calls]: every call of `call` ("*": of any function without a delay of its own)
  // takes `seconds` longer; 0 removes the delay. Negative seconds throw InvalidArgument.
  void set_call_delay(const std::string& call, double seconds);

  std::string name() const override { return "sim"; }
  int device_count() override;
  MemInfo mem_get_info(int device) override;
  std::size_t granularity(int device) override;

  DevicePtr reserve_address(int device, std::size_t size) override;
  void free_address(int device, DevicePtr ptr, std::size_t size) override;
  PhysHandle create_physical(int device, std::size_t size) override;
  int export_physical(int device, PhysHandle handle) override;
  PhysHandle import_physical(int device, int fd) override;
  void release_physical(int device, PhysHandle handle) override;
  void map(int device, DevicePtr ptr, std::size_t size, PhysHandle handle) override;
  void unmap(int device, DevicePtr ptr, std::size_t size) override;
  void set_access(int device, DevicePtr ptr, std::size_t size) override;

  DevicePtr mem_alloc(int device, std::size_t size) override;
  void mem_free(int device, DevicePtr ptr) override;
  DevicePtr mem_alloc_managed(int device, std::size_t size) override;
  void mem_advise(int device, DevicePtr ptr, std::size_t size, Advice advice,
                  MemLocation location) override;
  void mem_prefetch(int device, DevicePtr ptr, std::size_t size, MemLocation location,
                    StreamHandle stream) override;
  RangeAttributes range_attributes(int device, DevicePtr ptr, std::size_t size) override;
  bool is_managed(int device, DevicePtr ptr) override;
  void* host_alloc_pinned(int device, std::size_t size) override;
  void host_free_pinned(int device, void* ptr) override;

  StreamHandle stream_create(int device) override;
  void stream_destroy(int device, StreamHandle stream) override;
  void stream_synchronize(int device, StreamHandle stream) override;
  EventHandle event_create(int device) override;
  void event_destroy(int device, EventHandle event) override;
  void event_record(int device, EventHandle event, StreamHandle stream) override;
  void event_synchronize(int device, EventHandle event) override;
  bool event_query(int device, EventHandle event) override;
  EventHandle event_create_timed(int device) override;
  float event_elapsed_ms(int device, EventHandle start, EventHandle end) override;
  void stream_wait_event(int device, StreamHandle stream, EventHandle event) override;
  void device_synchronize(int device) override;
  void copy_device_to_host(int device, void* dst, DevicePtr src, std::size_t size,
                           StreamHandle stream) override;
  void copy_host_to_device(int device, DevicePtr dst, const void* src, std::size_t size,
                           StreamHandle stream) override;
  void copy_device_to_device(int device, DevicePtr dst, DevicePtr src, std::size_t size,
                             StreamHandle stream) override;

 private:
  struct Physical {
    int device;
    int fd;
    std::size_t size;
    int map_count = 0;
    bool released = false;
    bool imported = false;  // another process's memory: never charged to this one's devices
  };
  struct Mapping {
    std::size_t size;
    PhysHandle handle;
  };
  struct Fault {
    std::string call;
    long remaining;  // calls of `call` still to pass before the failing one
    int error_code;
  };

  // Every Driver method starts here: takes mutex_, enter_locked(), then the call's delay (Note
  // [Slow calls]); returns with mutex_ held.
  std::unique_lock<std::mutex> enter(const char* call, int device);
  // Counts the call, fires a pending fault, validates `device` (every value but the "no device"
  // marker of device_count, negative ones included). Caller holds mutex_.
  void enter_locked(const char* call, int device);
  void check_device_locked(int device) const;
  void charge_locked(int device, std::size_t size, const char* call);
  void drop_physical_if_unused_locked(PhysHandle handle);
  std::map<DevicePtr, std::size_t>::const_iterator reservation_containing_locked(
      DevicePtr ptr, std::size_t size) const;

  mutable std::mutex mutex_;
  ForkGuard fork_guard_{mutex_, LockRank::kDriver};  // Note [Fork] in fork_guard.h
  const std::size_t capacity_;
  const int device_count_;
  const std::size_t granularity_;
  std::vector<std::size_t> used_;                  // per device
  std::map<DevicePtr, std::size_t> reservations_;  // start -> size
  std::map<DevicePtr, Mapping> mappings_;          // start -> mapping
  std::map<PhysHandle, Physical> physicals_;
  std::map<DevicePtr, std::pair<int, std::size_t>> plain_allocations_;  // ptr -> (device, size)
  std::map<void*, std::size_t> pinned_;
  SimManagedSpace managed_;
  bool events_held_ = false;
  std::map<std::string, double> delays_;  // Note [Slow calls]: call -> seconds
  // Note [Held copies]
  struct CopyInFlight {
    StreamHandle stream;
    DevicePtr ptr;
    std::size_t size;
    std::uint64_t order;
  };
  struct HeldEvent {
    StreamHandle stream;
    std::uint64_t order;
  };
  void note_copy_locked(StreamHandle stream, DevicePtr ptr, std::size_t size);
  void complete_copies_locked(StreamHandle stream, std::uint64_t through);
  bool copies_held_ = false;
  std::uint64_t copy_order_ = 0;
  std::vector<StreamHandle> own_streams_;  // created and not yet destroyed
  std::set<EventHandle> live_events_;
  std::vector<CopyInFlight> copies_in_flight_;
  std::map<EventHandle, HeldEvent> held_events_;
  PhysHandle next_handle_ = 1;
  std::uintptr_t next_object_ = 1;
  std::map<std::string, long> calls_;
  std::vector<Fault> faults_;
};

}  // namespace tus
