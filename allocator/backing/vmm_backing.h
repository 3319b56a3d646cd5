// VmmBacking: CUDA virtual memory management. A segment is a reserved address range cut into
// chunks, each backed by its own physical handle; pausing a chunk unmaps and releases its handle
// while the address range stays reserved, resuming creates a new handle and maps it at the same
// address, so pointers held by tensors stay valid across a pause.
#pragma once

#include "allocator/backing/address_range_cache.h"
#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"

namespace tus {

class VmmBacking final : public Backing {
 public:
  // `chunk_bytes` bounds one physical handle; it is rounded to the driver's granularity.
  VmmBacking(Driver& driver, int device, std::size_t chunk_bytes);

  const char* name() const override { return "vmm"; }
  Capabilities capabilities() const override {
    return {/*pause=*/true, /*migrate=*/false, /*share=*/true};
  }
  std::size_t rounded_size(std::size_t requested) override;
  void allocate(PhysicalRange& range) override;
  void deallocate(PhysicalRange& range) override;
  void release_chunk(PhysicalRange& range, Chunk& chunk) override;
  void restore_chunk(PhysicalRange& range, Chunk& chunk) override;

 private:
  std::size_t granularity();

  Driver& driver_;
  const int device_;
  const std::size_t requested_chunk_bytes_;
  std::size_t granularity_ = 0;
  AddressRangeCache address_ranges_;
};

}  // namespace tus
