#include "allocator/fork_guard.h"

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

namespace tus {

namespace {

thread_local int t_unguarded = 0;            // Unguarded scopes open on this thread
thread_local bool t_fork_unguarded = false;  // this thread's fork in progress took no lock

}  // namespace

ForkGuard::Unguarded::Unguarded() { ++t_unguarded; }
ForkGuard::Unguarded::~Unguarded() { --t_unguarded; }

struct ForkGuard::Enrolled {
  std::mutex mutex;                // guards `guards`; held from before fork until after it
  std::vector<ForkGuard*> guards;  // in enrolment order
  std::vector<ForkGuard*> held;    // taken by before_fork, in the order taken
};

ForkGuard::Enrolled& ForkGuard::enrolled() {
  // Never destroyed (Note [Teardown] in registry.h): guards of objects that are never destroyed
  // either, and the fork handlers, still use it during process exit.
  static Enrolled* list = [] {
    auto* created = new Enrolled();
    const int error = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
    if (error != 0) {  // not log_once: it is enrolled here itself
      std::fprintf(stderr,
                   "[torch_uvm_saver] pthread_atfork failed (%s): a child forked while another "
                   "thread is inside torch_uvm_saver may hang\n",
                   std::strerror(error));
    }
    return created;
  }();
  return *list;
}

ForkGuard::ForkGuard(std::mutex& mutex, LockRank rank, std::function<void()> forget_in_child)
    : mutex_(mutex), rank_(rank), forget_in_child_(std::move(forget_in_child)) {
  Enrolled& list = enrolled();
  std::lock_guard<std::mutex> lock(list.mutex);
  list.guards.push_back(this);
}

ForkGuard::~ForkGuard() {
  Enrolled& list = enrolled();
  std::lock_guard<std::mutex> lock(list.mutex);
  list.guards.erase(std::find(list.guards.begin(), list.guards.end(), this));
}

void ForkGuard::before_fork() {
  t_fork_unguarded = t_unguarded > 0;
  if (t_fork_unguarded) return;
  Enrolled& list = enrolled();
  auto registry_locks = [&list] {  // caller holds list.mutex
    std::vector<ForkGuard*> found;
    for (ForkGuard* guard : list.guards) {
      if (guard->rank_ == LockRank::kRegistry) found.push_back(guard);
    }
    return found;
  };
  // Note [Fork]: kRegistry locks come before the list's own lock, as a thread may enrol an object
  // while it holds one. They live as long as the process, so they can be taken unlisted; if one
  // was enrolled in between, start again.
  std::vector<ForkGuard*> outer;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(list.mutex);
      outer = registry_locks();
    }
    for (ForkGuard* guard : outer) guard->mutex_.lock();
    list.mutex.lock();
    if (registry_locks() == outer) break;
    list.mutex.unlock();
    for (auto it = outer.rbegin(); it != outer.rend(); ++it) (*it)->mutex_.unlock();
  }
  std::vector<ForkGuard*> inner;
  for (ForkGuard* guard : list.guards) {
    if (guard->rank_ != LockRank::kRegistry) inner.push_back(guard);
  }
  std::stable_sort(inner.begin(), inner.end(),
                   [](const ForkGuard* a, const ForkGuard* b) { return a->rank_ < b->rank_; });
  for (ForkGuard* guard : inner) guard->mutex_.lock();
  list.held = std::move(outer);
  list.held.insert(list.held.end(), inner.begin(), inner.end());
}

void ForkGuard::after_fork_in_parent() {
  if (t_fork_unguarded) return;
  Enrolled& list = enrolled();
  for (auto it = list.held.rbegin(); it != list.held.rend(); ++it) (*it)->mutex_.unlock();
  list.held.clear();
  list.mutex.unlock();
}

void ForkGuard::after_fork_in_child() {
  if (t_fork_unguarded) return;
  Enrolled& list = enrolled();
  for (auto it = list.held.rbegin(); it != list.held.rend(); ++it) {
    if ((*it)->forget_in_child_) (*it)->forget_in_child_();
    (*it)->mutex_.unlock();
  }
  list.held.clear();
  list.mutex.unlock();
}

}  // namespace tus
