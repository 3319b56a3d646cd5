// ManagedBacking: cuMemAllocManaged memory (the `managed` mode, RFC-0023). One address valid on
// the host and on every device; the driver migrates pages on access, steered by advice and
// prefetches. This class only talks to the driver; where the bytes should be (tracking,
// budgets, the oversubscription guard) is decided in residency/managed_residency.
#pragma once

#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"
#include "allocator/region_config.h"

namespace tus {

class ManagedBacking final : public Backing {
 public:
  ManagedBacking(Driver& driver, int device) : driver_(driver), device_(device) {}

  const char* name() const override { return "managed"; }
  Capabilities capabilities() const override {
    return {/*pause=*/false, /*migrate=*/true, /*share=*/false};
  }
  // Page-sized below 2 MiB, whole 2 MiB pages above (the driver migrates large pages fastest).
  std::size_t rounded_size(std::size_t requested) override;
  // Allocates attached globally, marks the range MADV_DONTFORK (a fork() child must not share
  // managed pages) and applies `advice`; on failure it holds nothing and throws. The advice is
  // the caller's to keep (ManagedResidency's record), not the segment's.
  void allocate(PhysicalRange& range, const ManagedAdvice& advice);
  // Through the Backing interface: no advice (the Allocator passes the resolved one above).
  void allocate(PhysicalRange& range) override { allocate(range, ManagedAdvice{}); }
  void deallocate(PhysicalRange& range) override;

  void apply_advice(DevicePtr ptr, std::size_t size, const ManagedAdvice& advice);
  void clear_advice(DevicePtr ptr, std::size_t size, const ManagedAdvice& advice);

 private:
  Driver& driver_;
  const int device_;
};

}  // namespace tus
