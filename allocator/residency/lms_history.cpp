#include "allocator/residency/lms_history.h"

#include <algorithm>

namespace tus {

std::vector<DevicePtr> LmsHistory::paged_in_after(std::uint64_t pin, std::size_t depth) const {
  std::vector<DevicePtr> found;
  auto it =
      std::upper_bound(paged_in_then_.begin(), paged_in_then_.end(), pin,
                       [](std::uint64_t count, const auto& entry) { return count < entry.first; });
  for (; it != paged_in_then_.end() && found.size() < depth; ++it) found.push_back(it->second);
  return found;
}

void LmsHistory::next_iteration() {
  reclaimed_then_ = std::move(reclaimed_now_);
  reclaimed_now_.clear();
  paged_in_then_ = std::move(paged_in_now_);
  paged_in_now_.clear();
  unpins_ = 0;
  pins_ = 0;
  ++iteration_;
}

}  // namespace tus
