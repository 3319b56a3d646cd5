#include "allocator/driver/sim_managed_space.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace tus {

namespace {

std::size_t page_bytes() { return static_cast<std::size_t>(getpagesize()); }

std::uint64_t accessor_bit(MemLocation location) {
  if (location.kind == MemLocation::Kind::kHost) return 1;
  if (location.kind == MemLocation::Kind::kDevice && location.device >= 0 && location.device < 63) {
    return std::uint64_t{1} << (location.device + 1);
  }
  return 0;
}

}  // namespace

SimManagedSpace::~SimManagedSpace() {
  for (auto& [ptr, allocation] : allocations_)
    munmap(reinterpret_cast<void*>(ptr), allocation.size);
}

DevicePtr SimManagedSpace::allocate(int, std::size_t size) {
  if (size > SIZE_MAX - page_bytes()) {  // the page rounding would wrap: no host has that much
    errno = ENOMEM;
    return 0;
  }
  const std::size_t rounded = round_up(size == 0 ? 1 : size, page_bytes());
  void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) return 0;
  Allocation allocation;
  allocation.size = rounded;
  allocation.pages.resize(rounded / page_bytes());
  const auto address = reinterpret_cast<DevicePtr>(ptr);
  allocations_[address] = std::move(allocation);
  return address;
}

bool SimManagedSpace::release(DevicePtr ptr) {
  auto it = allocations_.find(ptr);
  if (it == allocations_.end()) return false;
  munmap(reinterpret_cast<void*>(ptr), it->second.size);
  allocations_.erase(it);
  return true;
}

bool SimManagedSpace::contains(DevicePtr ptr) const { return covers(ptr, 1); }

bool SimManagedSpace::covers(DevicePtr ptr, std::size_t size) const {
  if (size == 0) return false;
  auto it = allocations_.upper_bound(ptr);
  if (it == allocations_.begin()) return false;
  --it;
  return range_within(ptr, size, it->first, it->second.size);
}

template <typename Visit>
void SimManagedSpace::for_pages(DevicePtr ptr, std::size_t size, Visit visit) {
  auto it = --allocations_.upper_bound(ptr);  // covers() was checked by the caller
  const std::size_t first = (ptr - it->first) / page_bytes();
  const std::size_t last = (ptr + size - 1 - it->first) / page_bytes();
  for (std::size_t page = first; page <= last; ++page) visit(it->second.pages[page]);
}

void SimManagedSpace::advise(DevicePtr ptr, std::size_t size, Advice advice, MemLocation location) {
  for_pages(ptr, size, [&](PageState& page) {
    switch (advice) {
      case Advice::kSetReadMostly:
        page.read_mostly = true;
        break;
      case Advice::kUnsetReadMostly:
        page.read_mostly = false;
        break;
      case Advice::kSetPreferredLocation:
        page.preferred = location;
        break;
      case Advice::kUnsetPreferredLocation:
        page.preferred = MemLocation::none();
        break;
      case Advice::kSetAccessedBy:
        page.accessed_by |= accessor_bit(location);
        break;
      case Advice::kUnsetAccessedBy:
        page.accessed_by &= ~accessor_bit(location);
        break;
    }
  });
}

void SimManagedSpace::prefetch(DevicePtr ptr, std::size_t size, MemLocation location) {
  for_pages(ptr, size, [&](PageState& page) { page.last_prefetch = location; });
}

RangeAttributes SimManagedSpace::attributes(DevicePtr ptr, std::size_t size) const {
  auto& self = const_cast<SimManagedSpace&>(*this);
  RangeAttributes out;
  bool first = true;
  std::uint64_t accessors = 0;
  self.for_pages(ptr, size, [&](PageState& page) {
    if (first) {
      out.preferred = page.preferred;
      out.last_prefetch = page.last_prefetch;
      out.read_mostly = page.read_mostly;
      accessors = page.accessed_by;
      first = false;
      return;
    }
    // As CUDA answers: a location that differs across the range is none; read-mostly and
    // accessed-by hold only where every page has them.
    if (page.preferred != out.preferred) out.preferred = MemLocation::none();
    if (page.last_prefetch != out.last_prefetch) out.last_prefetch = MemLocation::none();
    out.read_mostly = out.read_mostly && page.read_mostly;
    accessors &= page.accessed_by;
  });
  if (accessors & 1) out.accessed_by.push_back(MemLocation::host());
  for (int device = 0; device < 63; ++device) {
    if (accessors & (std::uint64_t{1} << (device + 1))) {
      out.accessed_by.push_back(MemLocation::on_device(device));
    }
  }
  return out;
}

}  // namespace tus
