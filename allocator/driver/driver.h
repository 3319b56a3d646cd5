// The Driver contract: the only place the core reaches CUDA. Two implementations honour it:
// CudaDriver (libcuda loaded at run time) and SimDriver (host memory, for machines without a GPU).
//
// Contract, for every method:
//  - On failure it throws CudaError naming the call and the error (OutOfMemory for out-of-memory),
//    and leaves the object it was given as it was: a failed map maps nothing, a failed create
//    returns no handle.
//  - `device` is the ordinal the call is about; implementations make that device current for the
//    duration of the call and restore the caller's context afterwards.
//  - Virtual memory follows CUDA's VMM rules: reserve an address range, create physical handles,
//    map a whole handle at an address inside a reservation, grant access, unmap exactly what was
//    mapped. A handle's memory goes back to the device once it is released and no longer mapped.
//  - Streams order copies; an event recorded on a stream completes after everything before it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "allocator/types.h"

namespace tus {

// cuMemAdvise's advice values, in CUDA's order.
enum class Advice : int {
  kSetReadMostly = 1,
  kUnsetReadMostly = 2,
  kSetPreferredLocation = 3,
  kUnsetPreferredLocation = 4,
  kSetAccessedBy = 5,
  kUnsetAccessedBy = 6,
};

// What the driver says about a managed range (cuMemRangeGetAttribute). A location is kNone where
// it is unset or differs across the range.
struct RangeAttributes {
  MemLocation preferred;
  MemLocation last_prefetch;
  bool read_mostly = false;
  std::vector<MemLocation> accessed_by;
};

class Driver {
 public:
  virtual ~Driver() = default;

  virtual std::string name() const = 0;
  virtual int device_count() = 0;
  virtual MemInfo mem_get_info(int device) = 0;
  // Size and alignment every VMM reservation and physical handle is a multiple of.
  virtual std::size_t granularity(int device) = 0;

  // Virtual memory.
  virtual DevicePtr reserve_address(int device, std::size_t size) = 0;
  virtual void free_address(int device, DevicePtr ptr, std::size_t size) = 0;
  virtual PhysHandle create_physical(int device, std::size_t size) = 0;
  virtual void release_physical(int device, PhysHandle handle) = 0;
  virtual void map(int device, DevicePtr ptr, std::size_t size, PhysHandle handle) = 0;
  virtual void unmap(int device, DevicePtr ptr, std::size_t size) = 0;
  virtual void set_access(int device, DevicePtr ptr, std::size_t size) = 0;
  // Sharing physical memory with another process (Note [Sharing] in sharing/shared_mapping.h):
  // a POSIX file descriptor for `handle`'s memory, owned by the caller (throws where the device
  // cannot export); and a handle to the memory behind a descriptor another process exported,
  // mapped and released like any handle (the descriptor stays the caller's).
  virtual int export_physical(int device, PhysHandle handle) = 0;
  virtual PhysHandle import_physical(int device, int fd) = 0;

  // Plain device memory (the baseline `device` mode).
  virtual DevicePtr mem_alloc(int device, std::size_t size) = 0;
  virtual void mem_free(int device, DevicePtr ptr) = 0;

  // Managed (unified) memory: one address valid on the host and every device, migrated by the
  // driver. Allocated attached globally; freed with mem_free, which synchronizes.
  virtual DevicePtr mem_alloc_managed(int device, std::size_t size) = 0;
  virtual void mem_advise(int device, DevicePtr ptr, std::size_t size, Advice advice,
                          MemLocation location) = 0;
  // Migrates the range to `location`, ordered on `stream`.
  virtual void mem_prefetch(int device, DevicePtr ptr, std::size_t size, MemLocation location,
                            StreamHandle stream) = 0;
  virtual RangeAttributes range_attributes(int device, DevicePtr ptr, std::size_t size) = 0;
  // True for any managed memory of the process (ours or another library's), false for host,
  // pinned, ordinary device memory and addresses CUDA does not know.
  virtual bool is_managed(int device, DevicePtr ptr) = 0;

  // Page-locked host memory, usable by every device.
  virtual void* host_alloc_pinned(int device, std::size_t size) = 0;
  virtual void host_free_pinned(int device, void* ptr) = 0;

  // Streams, events, copies.
  virtual StreamHandle stream_create(int device) = 0;
  virtual void stream_destroy(int device, StreamHandle stream) = 0;
  virtual void stream_synchronize(int device, StreamHandle stream) = 0;
  virtual EventHandle event_create(int device) = 0;
  virtual void event_destroy(int device, EventHandle event) = 0;
  virtual void event_record(int device, EventHandle event, StreamHandle stream) = 0;
  virtual void event_synchronize(int device, EventHandle event) = 0;
  // An event that can time: event_elapsed_ms between two of them once both completed.
  virtual EventHandle event_create_timed(int device) = 0;
  virtual float event_elapsed_ms(int device, EventHandle start, EventHandle end) = 0;
  // True once everything the event waits for has finished; never blocks.
  virtual bool event_query(int device, EventHandle event) = 0;
  // Work queued on `stream` after this call starts only once `event` has completed (no host wait).
  virtual void stream_wait_event(int device, StreamHandle stream, EventHandle event) = 0;
  // Waits for all work queued on the device by any stream of this process.
  virtual void device_synchronize(int device) = 0;
  virtual void copy_device_to_host(int device, void* dst, DevicePtr src, std::size_t size,
                                   StreamHandle stream) = 0;
  virtual void copy_host_to_device(int device, DevicePtr dst, const void* src, std::size_t size,
                                   StreamHandle stream) = 0;
  // Both addresses on `device` (named weight snapshots kept on the GPU).
  virtual void copy_device_to_device(int device, DevicePtr dst, DevicePtr src, std::size_t size,
                                     StreamHandle stream) = 0;
};

}  // namespace tus
