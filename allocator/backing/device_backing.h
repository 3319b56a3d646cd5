// DeviceBacking: plain cuMemAlloc memory, the `device` mode. Same allocator, same stats, no
// tricks: the baseline every other mode is measured against.
#pragma once

#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"

namespace tus {

class DeviceBacking final : public Backing {
 public:
  DeviceBacking(Driver& driver, int device) : driver_(driver), device_(device) {}

  const char* name() const override { return "device"; }
  Capabilities capabilities() const override { return {}; }
  std::size_t rounded_size(std::size_t requested) override;
  void allocate(PhysicalRange& range) override;
  void deallocate(PhysicalRange& range) override;

 private:
  Driver& driver_;
  const int device_;
};

}  // namespace tus
