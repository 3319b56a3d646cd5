// ForkGuard: enrols one of the library's locks in the fork handlers, so that a child forked while
// another thread is inside the library does not inherit that lock held for ever.
//
// Note [Fork]
//  fork() copies the calling thread only. A lock that another thread held at that moment stays
//  held in the child, and the child's first call that wants it hangs: a fork while some thread
//  was in malloc, a pause or a stats read left the child deadlocked on the Allocator's mutex. So
//  every lock of the library is enrolled here (a ForkGuard member next to it), and the
//  pthread_atfork handlers, installed with the first enrolment, do this:
//  - before fork: take every enrolled lock, in rank order (LockRank). fork() waits for the calls
//    in progress to leave their locked sections (a pause that is copying included), so the child
//    gets the library's state whole, never half way through a change;
//  - after fork, in the parent: release them;
//  - after fork, in the child: let each object forget what belonged to threads the child does not
//    have (the host pool's pin-ahead worker and the disk-backup file reaper: their std::thread and
//    condition variables are rebuilt, the work they were doing is left to the parent, new threads
//    start at the next need), then release the locks (the child's one thread took them).
//
//  What a child may do: import torch_uvm_saver, read statistics and settings (memory_stats,
//  memory_summary, segments(), the limits), and on the simulated driver anything at all. What it
//  may not do: use CUDA. The CUDA driver does not work in a child forked after the parent
//  initialized it (its calls fail there, in the child only), so a child that needs the GPU must be
//  started with multiprocessing's 'spawn' or 'forkserver'. The parent's segments still show in a
//  child's bookkeeping, as they were at the fork, but the GPU memory is the parent's: a child must
//  not free, pause or resume them on a GPU. Managed memory is not in a child at all
//  (MADV_DONTFORK, managed_backing.cpp).
//
//  Three rules keep the handler itself free of deadlock:
//  - Locks nest in rank order only, and never two of one rank: then taking them all by rank
//    cannot wait in a circle with a thread that takes some of them.
//  - An object that owns a lock is made or destroyed (enrolled, struck off) with no lock of the
//    library held, except kRegistry locks: the Registry makes allocators and drivers under its
//    own. The before-fork handler therefore takes the kRegistry locks before the list of enrolled
//    locks and every other lock after it. kRegistry objects must live as long as the process.
//  - A thread that holds a lock of the library never waits for the GIL (ARCHITECTURE.md,
//    decision 5): the thread calling os.fork() holds the GIL while the handler waits.
//  - A fork() from inside our locked sections would wait for itself. We never fork, but libcuda's
//    cuInit runs nvidia-modprobe through fork() and exec when the kernel module is not loaded
//    yet, and cuInit may run under the Registry's lock: such calls run under ForkGuard::Unguarded,
//    and a fork() on that thread meanwhile takes no lock (its child only execs).
//  The package's Python-level locks (threading.Lock) are not enrolled: each is held for a few
//  Python statements, under the GIL, which the forking thread holds.
#pragma once

#include <functional>
#include <mutex>
#include <new>

namespace tus {

// The order in which the library's locks nest, outermost first (Note [Fork]).
enum class LockRank : int {
  kRegistry = 0,   // Registry: install_driver reads every Allocator under it
  kAllocator = 1,  // an Allocator's mutex, held for the whole of its public calls
  kResidency = 2,  // HostBufferPool, FileReaper: taken under an Allocator's mutex
  kDriver = 3,     // SimDriver, CudaDriver: called under any of the above
  kLog = 4,        // log_once: called under any of the above
};

class ForkGuard {
 public:
  // Enrols `mutex`, which must outlive this guard (declare the guard after it). `forget_in_child`
  // runs in a fork child while the lock is still held, before it is released.
  ForkGuard(std::mutex& mutex, LockRank rank, std::function<void()> forget_in_child = nullptr);
  ~ForkGuard();
  ForkGuard(const ForkGuard&) = delete;
  ForkGuard& operator=(const ForkGuard&) = delete;

  // While one lives on a thread, a fork() by that thread takes no lock (Note [Fork]): for a call
  // into another library that may fork() and exec while we hold our locks.
  class Unguarded {
   public:
    Unguarded();
    ~Unguarded();
    Unguarded(const Unguarded&) = delete;
    Unguarded& operator=(const Unguarded&) = delete;
  };

 private:
  struct Enrolled;
  static Enrolled& enrolled();
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();

  std::mutex& mutex_;
  const LockRank rank_;
  const std::function<void()> forget_in_child_;
};

// For a forget_in_child function: builds a fresh `object` in place without running the old one's
// destructor. A child's copy of a std::thread names a thread that is not in the child (joining it
// or destroying it joinable would hang or terminate), and a condition variable may count waiters
// that are not there either.
template <typename T>
void rebuild_in_child(T& object) {
  new (&object) T();
}

}  // namespace tus
