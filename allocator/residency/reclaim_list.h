// ReclaimList: the inactive `lms` blocks, least recently used first. Intrusive (the links live
// in each LmsBlock, LmsResidency's record of a segment), so insert and remove are O(1) and never
// allocate: they run on every pin and unpin.
#pragma once

#include <cstddef>

#include "allocator/residency/lms_block.h"

namespace tus {

class ReclaimList {
 public:
  // Appends at the most recently used end. The block must not be on the list.
  void push_back(LmsBlock& block) {
    block.prev = tail_;
    block.next = nullptr;
    if (tail_ != nullptr) tail_->next = &block;
    tail_ = &block;
    if (head_ == nullptr) head_ = &block;
    block.on_list = true;
    bytes_ += block.segment->size;
    ++count_;
  }
  // No-op for a block that is not on the list.
  void remove(LmsBlock& block) {
    if (!block.on_list) return;
    if (block.prev != nullptr) block.prev->next = block.next;
    if (block.next != nullptr) block.next->prev = block.prev;
    if (head_ == &block) head_ = block.next;
    if (tail_ == &block) tail_ = block.prev;
    block.prev = block.next = nullptr;
    block.on_list = false;
    bytes_ -= block.segment->size;
    --count_;
  }
  LmsBlock* least_recent() const { return head_; }
  static LmsBlock* more_recent(const LmsBlock& block) { return block.next; }
  std::size_t bytes() const { return bytes_; }
  std::size_t size() const { return count_; }

 private:
  LmsBlock* head_ = nullptr;
  LmsBlock* tail_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t count_ = 0;
};

}  // namespace tus
