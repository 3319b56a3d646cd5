// ReclaimList: the inactive `lms` segments, least recently used first. Intrusive (the links live
// in each Segment's LmsLinks), so insert and remove are O(1) and never allocate: they run on
// every pin and unpin.
#pragma once

#include <cstddef>

#include "allocator/segment.h"

namespace tus {

class ReclaimList {
 public:
  // Appends at the most recently used end. The segment must not be on the list.
  void push_back(Segment& segment) {
    LmsLinks& links = segment.lms;
    links.prev = tail_;
    links.next = nullptr;
    if (tail_ != nullptr) tail_->lms.next = &segment;
    tail_ = &segment;
    if (head_ == nullptr) head_ = &segment;
    links.on_list = true;
    bytes_ += segment.size;
    ++count_;
  }
  // No-op for a segment that is not on the list.
  void remove(Segment& segment) {
    LmsLinks& links = segment.lms;
    if (!links.on_list) return;
    if (links.prev != nullptr) links.prev->lms.next = links.next;
    if (links.next != nullptr) links.next->lms.prev = links.prev;
    if (head_ == &segment) head_ = links.next;
    if (tail_ == &segment) tail_ = links.prev;
    links.prev = links.next = nullptr;
    links.on_list = false;
    bytes_ -= segment.size;
    --count_;
  }
  Segment* least_recent() const { return head_; }
  static Segment* more_recent(const Segment& segment) { return segment.lms.next; }
  std::size_t bytes() const { return bytes_; }
  std::size_t size() const { return count_; }

 private:
  Segment* head_ = nullptr;
  Segment* tail_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t count_ = 0;
};

}  // namespace tus
