#include "allocator/residency/lms_history.h"

#include <algorithm>

namespace tus {

std::pair<std::size_t, std::size_t> LmsHistory::prefetch_window(std::uint64_t pin,
                                                                std::size_t depth) const {
  const auto after =
      std::upper_bound(paged_in_then_.begin(), paged_in_then_.end(), pin,
                       [](std::uint64_t count, const auto& entry) { return count < entry.first; });
  const auto first = static_cast<std::size_t>(after - paged_in_then_.begin());
  const std::size_t end = std::min(paged_in_then_.size(), first + depth);
  return {std::min(std::max(first, prefetch_cursor_), end), end};
}

void LmsHistory::next_iteration() {
  reclaimed_then_ = std::move(reclaimed_now_);
  reclaimed_now_.clear();
  paged_in_then_ = std::move(paged_in_now_);
  paged_in_now_.clear();
  prefetch_cursor_ = 0;
  unpins_ = 0;
  pins_ = 0;
  ++iteration_;
}

}  // namespace tus
