// CudaDriver: the Driver contract on the real CUDA driver API. libcuda.so.1 is opened with dlopen
// on first use and every entry point is resolved with cuGetProcAddress, so the build never links
// libcuda and `import torch_uvm_saver` works on machines without a GPU (calls then throw a
// CudaError that says so).
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "allocator/driver/driver.h"
#include "allocator/fork_guard.h"

namespace tus {

struct CudaApi;  // the resolved entry points, defined in cuda_driver.cpp

class CudaDriver final : public Driver {
 public:
  CudaDriver();
  ~CudaDriver() override;

  std::string name() const override { return "cuda"; }
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
  class ContextGuard;
  const CudaApi& api();  // loads libcuda on first use; throws CudaError when it cannot
  void* primary_context(int device);

  std::once_flag load_once_;
  std::unique_ptr<CudaApi> api_;
  std::string load_error_;
  std::mutex context_mutex_;
  ForkGuard fork_guard_{context_mutex_, LockRank::kDriver};  // Note [Fork] in fork_guard.h
  static constexpr int kMaxDevices = 64;
  void* primary_contexts_[kMaxDevices] = {};
  std::size_t granularity_[kMaxDevices] = {};
  // Per device: 0 not asked yet, 1 its memory can be exported as a file descriptor, -1 not.
  int exportable_[kMaxDevices] = {};
};

}  // namespace tus
