#include "allocator/backing/managed_backing.h"

#include <sys/mman.h>
#include <unistd.h>

#include "allocator/log.h"

namespace tus {

std::size_t ManagedBacking::rounded_size(std::size_t requested) {
  const std::size_t bytes = requested == 0 ? 1 : requested;
  if (bytes >= kManagedPageBytes) return round_up_checked(bytes, kManagedPageBytes);
  return round_up_checked(bytes, static_cast<std::size_t>(getpagesize()));
}

void ManagedBacking::allocate(PhysicalRange& range, const ManagedAdvice& advice) {
  range.ptr = driver_.mem_alloc_managed(device_, range.size);
  try {
    apply_advice(range.ptr, range.size, advice);
  } catch (...) {
    driver_.mem_free(device_, range.ptr);
    range.ptr = 0;
    throw;
  }
  // Managed pages shared with a fork() child corrupt both processes' views; a child does not get
  // them at all this way. A failure only costs that protection, so it is logged, not raised.
  if (madvise(reinterpret_cast<void*>(range.ptr), range.size, MADV_DONTFORK) != 0) {
    log_once("managed_dontfork",
             "madvise(MADV_DONTFORK) failed on managed memory; a fork() "
             "child would share managed pages with this process");
  }
}

void ManagedBacking::deallocate(PhysicalRange& range) {
  if (range.ptr == 0) return;
  driver_.mem_free(device_, range.ptr);
  range.ptr = 0;
}

void ManagedBacking::apply_advice(DevicePtr ptr, std::size_t size, const ManagedAdvice& advice) {
  if (!advice.preferred.is_none()) {
    driver_.mem_advise(device_, ptr, size, Advice::kSetPreferredLocation, advice.preferred);
  }
  if (advice.accessed_by) {
    driver_.mem_advise(device_, ptr, size, Advice::kSetAccessedBy, *advice.accessed_by);
  }
  if (advice.read_mostly) {
    driver_.mem_advise(device_, ptr, size, Advice::kSetReadMostly, MemLocation::on_device(device_));
  }
}

void ManagedBacking::clear_advice(DevicePtr ptr, std::size_t size, const ManagedAdvice& advice) {
  if (!advice.preferred.is_none()) {
    driver_.mem_advise(device_, ptr, size, Advice::kUnsetPreferredLocation, advice.preferred);
  }
  if (advice.accessed_by) {
    driver_.mem_advise(device_, ptr, size, Advice::kUnsetAccessedBy, *advice.accessed_by);
  }
  if (advice.read_mostly) {
    driver_.mem_advise(device_, ptr, size, Advice::kUnsetReadMostly,
                       MemLocation::on_device(device_));
  }
}

}  // namespace tus
