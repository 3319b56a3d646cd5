#include "allocator/driver/sim_driver.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include "allocator/message.h"

#include "allocator/errors.h"

namespace tus {

namespace {

constexpr int kInvalidValue = 1;                            // CUDA_ERROR_INVALID_VALUE
constexpr int kLaunchFailed = 719;                          // CUDA_ERROR_LAUNCH_FAILED
constexpr int kNoDevice = std::numeric_limits<int>::min();  // calls about no device

[[noreturn]] void fail(const char* call, int code, const std::string& why) {
  Message message;
  message << "sim " << call << " failed: " << why << " (error " << code << ")";
  if (code == SimDriver::kOutOfMemoryCode) throw OutOfMemory(message.str());
  throw CudaError(message.str(), code);
}

std::string system_error(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

}  // namespace

SimDriver::SimDriver(std::size_t capacity_bytes, int device_count, std::size_t granularity)
    : capacity_(capacity_bytes),
      device_count_(device_count),
      granularity_(granularity),
      used_(static_cast<std::size_t>(device_count), 0) {
  if (device_count < 1) TUS_THROW(InvalidArgument, "SimDriver needs at least one device");
  if (granularity == 0 || granularity % static_cast<std::size_t>(getpagesize()) != 0) {
    TUS_THROW(InvalidArgument,
              "SimDriver granularity " << granularity << " must be a multiple of the page size");
  }
}

SimDriver::~SimDriver() {
  // Whatever the allocator left behind goes back to the host.
  for (auto& [ptr, size] : reservations_) munmap(reinterpret_cast<void*>(ptr), size);
  for (auto& [handle, physical] : physicals_) close(physical.fd);
  for (auto& [ptr, entry] : plain_allocations_) munmap(reinterpret_cast<void*>(ptr), entry.second);
  for (auto& [ptr, size] : pinned_) munmap(ptr, size);
}

void SimDriver::fail_on(const std::string& call, int nth, int error_code) {
  if (nth < 1) TUS_THROW(InvalidArgument, "fail_on: nth must be >= 1, got " << nth);
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.push_back(Fault{call, nth - 1, error_code});
}

void SimDriver::clear_faults() {
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.clear();
}

std::map<std::string, long> SimDriver::call_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_;
}

void SimDriver::reset_call_counts() {
  std::lock_guard<std::mutex> lock(mutex_);
  calls_.clear();
}

std::size_t SimDriver::used_bytes(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_device_locked(device);
  return used_[static_cast<std::size_t>(device)];
}

std::size_t SimDriver::mapped_ranges() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappings_.size();
}

std::size_t SimDriver::pinned_host_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = 0;
  for (const auto& [ptr, size] : pinned_) total += size;
  return total;
}

std::map<std::string, std::size_t> SimDriver::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {
      {"reservations", reservations_.size()},
      {"physical_handles", physicals_.size()},
      {"mappings", mappings_.size()},
      {"plain_allocations", plain_allocations_.size()},
      {"managed_allocations", managed_.allocation_count()},
      {"pinned_buffers", pinned_.size()},
      {"streams", own_streams_.size()},
      {"events", live_events_.size()},
  };
}

void SimDriver::check_device_locked(int device) const {
  if (device < 0 || device >= device_count_) {
    Message why;
    why << "device " << device << " does not exist (the simulated machine has " << device_count_
        << ")";
    throw InvalidArgument(why.str());
  }
}

void SimDriver::set_call_delay(const std::string& call, double seconds) {
  if (!(seconds >= 0.0)) {
    TUS_THROW(InvalidArgument, "set_call_delay: seconds must be >= 0, got " << seconds);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (seconds == 0.0) {
    delays_.erase(call);
  } else {
    delays_[call] = seconds;
  }
}

std::unique_lock<std::mutex> SimDriver::enter(const char* call, int device) {
  std::unique_lock<std::mutex> lock(mutex_);
  enter_locked(call, device);
  auto delay = delays_.find(call);
  if (delay == delays_.end()) delay = delays_.find("*");
  if (delay != delays_.end()) {
    // Note [Slow calls]: counted already, slow outside the lock, and then done as usual.
    const auto seconds = std::chrono::duration<double>(delay->second);
    lock.unlock();
    std::this_thread::sleep_for(seconds);
    lock.lock();
  }
  return lock;
}

void SimDriver::enter_locked(const char* call, int device) {
  ++calls_[call];
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->call != call && it->call != "*") continue;
    if (it->remaining > 0) {
      --it->remaining;
      continue;
    }
    const int code = it->error_code;
    faults_.erase(it);
    fail(call, code, "injected fault");
  }
  if (device != kNoDevice) check_device_locked(device);
}

void SimDriver::charge_locked(int device, std::size_t size, const char* call) {
  std::size_t& used = used_[static_cast<std::size_t>(device)];
  if (size > capacity_ - used) {
    Message why;
    why << "out of memory asking for " << size << " bytes with " << (capacity_ - used) << " of "
        << capacity_ << " free on device " << device;
    fail(call, kOutOfMemoryCode, why.str());
  }
  used += size;
}

int SimDriver::device_count() {
  auto lock = enter("device_count", kNoDevice);
  return device_count_;
}

MemInfo SimDriver::mem_get_info(int device) {
  auto lock = enter("mem_get_info", device);
  return MemInfo{capacity_ - used_[static_cast<std::size_t>(device)], capacity_};
}

std::size_t SimDriver::granularity(int device) {
  auto lock = enter("granularity", device);
  return granularity_;
}

DevicePtr SimDriver::reserve_address(int device, std::size_t size) {
  auto lock = enter("reserve_address", device);
  if (size == 0 || size % granularity_ != 0) {
    fail("reserve_address", kInvalidValue,
         "size " + std::to_string(size) +
             " is not a multiple "
             "of the granularity");
  }
  // Over-reserve and trim so the range is aligned to the granularity, as CUDA's are. A size
  // the padding would wrap is more address space than there is, as CUDA would say.
  if (size > SIZE_MAX - granularity_) {
    fail("reserve_address", kOutOfMemoryCode, "no address range of " + std::to_string(size));
  }
  const std::size_t padded = size + granularity_;
  void* raw = mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) fail("reserve_address", kOutOfMemoryCode, system_error("mmap"));
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = round_up(start, granularity_);
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t tail = start + padded - (aligned + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  reservations_[aligned] = size;
  return aligned;
}

std::map<DevicePtr, std::size_t>::const_iterator SimDriver::reservation_containing_locked(
    DevicePtr ptr, std::size_t size) const {
  auto it = reservations_.upper_bound(ptr);
  if (it == reservations_.begin()) return reservations_.end();
  --it;
  if (!range_within(ptr, size, it->first, it->second)) return reservations_.end();
  return it;
}

void SimDriver::free_address(int device, DevicePtr ptr, std::size_t size) {
  auto lock = enter("free_address", device);
  auto it = reservations_.find(ptr);
  if (it == reservations_.end() || it->second != size) {
    fail("free_address", kInvalidValue, "not a reservation of that size");
  }
  auto mapped = mappings_.lower_bound(ptr);
  if (mapped != mappings_.end() && mapped->first < ptr + size) {
    fail("free_address", kInvalidValue, "the range still has mappings");
  }
  munmap(reinterpret_cast<void*>(ptr), size);
  reservations_.erase(it);
}

PhysHandle SimDriver::create_physical(int device, std::size_t size) {
  auto lock = enter("create_physical", device);
  if (size == 0 || size % granularity_ != 0) {
    fail("create_physical", kInvalidValue, "size is not a multiple of the granularity");
  }
  charge_locked(device, size, "create_physical");
  const int fd = memfd_create("tus-sim-physical", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const std::string why = system_error("memfd_create/ftruncate");
    if (fd >= 0) close(fd);
    used_[static_cast<std::size_t>(device)] -= size;
    fail("create_physical", kOutOfMemoryCode, why);
  }
  const PhysHandle handle = next_handle_++;
  physicals_[handle] = Physical{device, fd, size};
  return handle;
}

void SimDriver::drop_physical_if_unused_locked(PhysHandle handle) {
  auto it = physicals_.find(handle);
  if (it == physicals_.end() || !it->second.released || it->second.map_count > 0) return;
  close(it->second.fd);
  if (!it->second.imported) used_[static_cast<std::size_t>(it->second.device)] -= it->second.size;
  physicals_.erase(it);
}

// The simulated physical memory is a memfd: exporting hands out a duplicate of it, and another
// process that maps the duplicate shares the bytes, as two processes share a GPU's memory.
int SimDriver::export_physical(int device, PhysHandle handle) {
  auto lock = enter("export_physical", device);
  auto it = physicals_.find(handle);
  if (it == physicals_.end() || it->second.released) {
    fail("export_physical", kInvalidValue, "unknown or released handle");
  }
  const int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) fail("export_physical", kOutOfMemoryCode, system_error("fcntl(F_DUPFD_CLOEXEC)"));
  return fd;
}

PhysHandle SimDriver::import_physical(int device, int fd) {
  auto lock = enter("import_physical", device);
  struct stat info = {};
  if (fd < 0 || fstat(fd, &info) != 0 || info.st_size <= 0) {
    fail("import_physical", kInvalidValue, "not a descriptor of exported memory");
  }
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) fail("import_physical", kOutOfMemoryCode, system_error("fcntl(F_DUPFD_CLOEXEC)"));
  const PhysHandle handle = next_handle_++;
  Physical physical{device, own, static_cast<std::size_t>(info.st_size)};
  physical.imported = true;
  physicals_[handle] = physical;
  return handle;
}

void SimDriver::release_physical(int device, PhysHandle handle) {
  auto lock = enter("release_physical", device);
  auto it = physicals_.find(handle);
  if (it == physicals_.end() || it->second.released) {
    fail("release_physical", kInvalidValue, "unknown or already released handle");
  }
  it->second.released = true;
  drop_physical_if_unused_locked(handle);
}

void SimDriver::map(int device, DevicePtr ptr, std::size_t size, PhysHandle handle) {
  auto lock = enter("map", device);
  auto physical = physicals_.find(handle);
  if (physical == physicals_.end() || physical->second.released || physical->second.size != size) {
    fail("map", kInvalidValue, "unknown handle or size mismatch");
  }
  if (reservation_containing_locked(ptr, size) == reservations_.end()) {
    fail("map", kInvalidValue, "range is not inside one reservation");
  }
  auto next = mappings_.lower_bound(ptr);
  const bool overlaps_next = next != mappings_.end() && next->first < ptr + size;
  bool overlaps_previous = false;
  if (next != mappings_.begin()) {
    auto previous = std::prev(next);
    overlaps_previous = previous->first + previous->second.size > ptr;
  }
  if (overlaps_next || overlaps_previous) fail("map", kInvalidValue, "range is already mapped");
  void* placed = mmap(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_FIXED, physical->second.fd, 0);
  if (placed == MAP_FAILED) fail("map", kOutOfMemoryCode, system_error("mmap"));
  mappings_[ptr] = Mapping{size, handle};
  ++physical->second.map_count;
}

void SimDriver::unmap(int device, DevicePtr ptr, std::size_t size) {
  auto lock = enter("unmap", device);
  for (const CopyInFlight& copy : copies_in_flight_) {
    if (copy.ptr < ptr + size && ptr < copy.ptr + copy.size) {
      fail("unmap", kLaunchFailed, "a copy still in flight uses this memory (Note [Held copies])");
    }
  }
  auto it = mappings_.find(ptr);
  if (it == mappings_.end() || it->second.size != size) {
    fail("unmap", kInvalidValue, "range does not match one mapping");
  }
  // Back to an inaccessible reservation: touching it now faults, as on a GPU.
  void* placed = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (placed == MAP_FAILED) fail("unmap", kInvalidValue, system_error("mmap"));
  const PhysHandle handle = it->second.handle;
  mappings_.erase(it);
  --physicals_[handle].map_count;
  drop_physical_if_unused_locked(handle);
}

void SimDriver::set_access(int device, DevicePtr ptr, std::size_t size) {
  auto lock = enter("set_access", device);
  auto it = mappings_.find(ptr);
  if (it == mappings_.end() || it->second.size != size) {
    fail("set_access", kInvalidValue, "range does not match one mapping");
  }
}

DevicePtr SimDriver::mem_alloc(int device, std::size_t size) {
  auto lock = enter("mem_alloc", device);
  const std::size_t page = static_cast<std::size_t>(getpagesize());
  // More than any device has, as CUDA says of it, before the page rounding wraps.
  if (size > SIZE_MAX - page) {
    fail("mem_alloc", kOutOfMemoryCode, "out of memory asking for " + std::to_string(size));
  }
  const std::size_t rounded = round_up(size == 0 ? 1 : size, page);
  charge_locked(device, rounded, "mem_alloc");
  void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    used_[static_cast<std::size_t>(device)] -= rounded;
    fail("mem_alloc", kOutOfMemoryCode, system_error("mmap"));
  }
  plain_allocations_[reinterpret_cast<DevicePtr>(ptr)] = {device, rounded};
  return reinterpret_cast<DevicePtr>(ptr);
}

DevicePtr SimDriver::mem_alloc_managed(int device, std::size_t size) {
  auto lock = enter("mem_alloc_managed", device);
  const DevicePtr ptr = managed_.allocate(device, size);
  if (ptr == 0) fail("mem_alloc_managed", kOutOfMemoryCode, system_error("mmap"));
  return ptr;
}

void SimDriver::mem_advise(int device, DevicePtr ptr, std::size_t size, Advice advice,
                           MemLocation location) {
  auto lock = enter("mem_advise", device);
  if (!managed_.covers(ptr, size)) fail("mem_advise", kInvalidValue, "not managed memory");
  const bool needs_location =
      advice == Advice::kSetPreferredLocation || advice == Advice::kSetAccessedBy;
  if (needs_location && location.is_none()) fail("mem_advise", kInvalidValue, "no location");
  if (location.kind == MemLocation::Kind::kDevice) check_device_locked(location.device);
  managed_.advise(ptr, size, advice, location);
}

void SimDriver::mem_prefetch(int device, DevicePtr ptr, std::size_t size, MemLocation location,
                             StreamHandle) {
  auto lock = enter("mem_prefetch", device);
  if (!managed_.covers(ptr, size)) fail("mem_prefetch", kInvalidValue, "not managed memory");
  if (location.is_none()) fail("mem_prefetch", kInvalidValue, "no location");
  if (location.kind == MemLocation::Kind::kDevice) check_device_locked(location.device);
  managed_.prefetch(ptr, size, location);
}

RangeAttributes SimDriver::range_attributes(int device, DevicePtr ptr, std::size_t size) {
  auto lock = enter("range_attributes", device);
  if (!managed_.covers(ptr, size)) fail("range_attributes", kInvalidValue, "not managed memory");
  return managed_.attributes(ptr, size);
}

bool SimDriver::is_managed(int device, DevicePtr ptr) {
  auto lock = enter("is_managed", device);
  return managed_.contains(ptr);
}

void SimDriver::mem_free(int device, DevicePtr ptr) {
  auto lock = enter("mem_free", device);
  if (managed_.release(ptr)) return;
  auto it = plain_allocations_.find(ptr);
  if (it == plain_allocations_.end()) fail("mem_free", kInvalidValue, "not an allocation");
  munmap(reinterpret_cast<void*>(ptr), it->second.second);
  used_[static_cast<std::size_t>(it->second.first)] -= it->second.second;
  plain_allocations_.erase(it);
}

void* SimDriver::host_alloc_pinned(int device, std::size_t size) {
  auto lock = enter("host_alloc_pinned", device);
  void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) fail("host_alloc_pinned", kOutOfMemoryCode, system_error("mmap"));
  pinned_[ptr] = size;
  return ptr;
}

void SimDriver::host_free_pinned(int device, void* ptr) {
  auto lock = enter("host_free_pinned", device);
  auto it = pinned_.find(ptr);
  if (it == pinned_.end()) fail("host_free_pinned", kInvalidValue, "not a pinned allocation");
  munmap(ptr, it->second);
  pinned_.erase(it);
}

StreamHandle SimDriver::stream_create(int device) {
  auto lock = enter("stream_create", device);
  auto stream = reinterpret_cast<StreamHandle>(next_object_++);
  own_streams_.push_back(stream);
  return stream;
}

void SimDriver::stream_destroy(int device, StreamHandle stream) {
  auto lock = enter("stream_destroy", device);
  auto it = std::find(own_streams_.begin(), own_streams_.end(), stream);
  if (it == own_streams_.end()) fail("stream_destroy", kInvalidValue, "not a live stream");
  own_streams_.erase(it);
}

void SimDriver::stream_synchronize(int device, StreamHandle stream) {
  auto lock = enter("stream_synchronize", device);
  complete_copies_locked(stream, copy_order_);
}

EventHandle SimDriver::event_create(int device) {
  auto lock = enter("event_create", device);
  auto event = reinterpret_cast<EventHandle>(next_object_++);
  live_events_.insert(event);
  return event;
}

void SimDriver::event_destroy(int device, EventHandle event) {
  auto lock = enter("event_destroy", device);
  if (live_events_.erase(event) == 0) fail("event_destroy", kInvalidValue, "not a live event");
  held_events_.erase(event);
}

void SimDriver::event_record(int device, EventHandle event, StreamHandle stream) {
  auto lock = enter("event_record", device);
  held_events_.erase(event);
  const bool behind_a_copy =
      std::any_of(copies_in_flight_.begin(), copies_in_flight_.end(),
                  [&](const CopyInFlight& copy) { return copy.stream == stream; });
  if (behind_a_copy) held_events_[event] = HeldEvent{stream, ++copy_order_};
}

EventHandle SimDriver::event_create_timed(int device) {
  auto lock = enter("event_create_timed", device);
  auto event = reinterpret_cast<EventHandle>(next_object_++);
  live_events_.insert(event);
  return event;
}

float SimDriver::event_elapsed_ms(int device, EventHandle, EventHandle) {
  auto lock = enter("event_elapsed_ms", device);
  return 0.0f;  // synchronous streams: work has taken no time by the time it is queried
}

bool SimDriver::event_query(int device, EventHandle event) {
  auto lock = enter("event_query", device);
  // Streams are synchronous: recorded events are complete unless held.
  return !events_held_ && held_events_.count(event) == 0;
}

void SimDriver::hold_events(bool held) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_held_ = held;
}

void SimDriver::hold_copies(bool held) {
  std::lock_guard<std::mutex> lock(mutex_);
  copies_held_ = held;
  if (!held) {
    copies_in_flight_.clear();
    held_events_.clear();
  }
}

void SimDriver::note_copy_locked(StreamHandle stream, DevicePtr ptr, std::size_t size) {
  if (!copies_held_) return;
  if (std::find(own_streams_.begin(), own_streams_.end(), stream) == own_streams_.end()) return;
  copies_in_flight_.push_back(CopyInFlight{stream, ptr, size, ++copy_order_});
}

void SimDriver::complete_copies_locked(StreamHandle stream, std::uint64_t through) {
  copies_in_flight_.erase(std::remove_if(copies_in_flight_.begin(), copies_in_flight_.end(),
                                         [&](const CopyInFlight& copy) {
                                           return copy.stream == stream && copy.order <= through;
                                         }),
                          copies_in_flight_.end());
  for (auto it = held_events_.begin(); it != held_events_.end();) {
    const bool done = it->second.stream == stream && it->second.order <= through;
    it = done ? held_events_.erase(it) : std::next(it);
  }
}

void SimDriver::event_synchronize(int device, EventHandle event) {
  auto lock = enter("event_synchronize", device);
  auto it = held_events_.find(event);
  if (it != held_events_.end()) complete_copies_locked(it->second.stream, it->second.order);
}

void SimDriver::stream_wait_event(int device, StreamHandle, EventHandle) {
  auto lock = enter("stream_wait_event", device);  // synchronous streams: nothing to wait for
}

void SimDriver::device_synchronize(int device) {
  auto lock = enter("device_synchronize", device);
  events_held_ = false;
  copies_in_flight_.clear();
  held_events_.clear();
}

namespace {

// True when [ptr, ptr + size) lies inside one entry of `ranges` (start -> size-like value).
template <typename Map, typename SizeOf>
bool inside_one(const Map& ranges, DevicePtr ptr, std::size_t size, SizeOf size_of) {
  auto it = ranges.upper_bound(ptr);
  if (it == ranges.begin()) return false;
  --it;
  return range_within(ptr, size, it->first, size_of(it->second));
}

}  // namespace

void SimDriver::copy_device_to_host(int device, void* dst, DevicePtr src, std::size_t size,
                                    StreamHandle stream) {
  auto lock = enter("copy_device_to_host", device);
  const bool valid =
      inside_one(mappings_, src, size, [](const Mapping& m) { return m.size; }) ||
      inside_one(plain_allocations_, src, size, [](const auto& entry) { return entry.second; }) ||
      managed_.covers(src, size);
  if (!valid) fail("copy_device_to_host", kInvalidValue, "source is not mapped device memory");
  std::memcpy(dst, reinterpret_cast<const void*>(src), size);
  note_copy_locked(stream, src, size);
}

void SimDriver::copy_host_to_device(int device, DevicePtr dst, const void* src, std::size_t size,
                                    StreamHandle stream) {
  auto lock = enter("copy_host_to_device", device);
  const bool valid =
      inside_one(mappings_, dst, size, [](const Mapping& m) { return m.size; }) ||
      inside_one(plain_allocations_, dst, size, [](const auto& entry) { return entry.second; }) ||
      managed_.covers(dst, size);
  if (!valid) fail("copy_host_to_device", kInvalidValue, "destination is not mapped device memory");
  std::memcpy(reinterpret_cast<void*>(dst), src, size);
  note_copy_locked(stream, dst, size);
}

void SimDriver::copy_device_to_device(int device, DevicePtr dst, DevicePtr src, std::size_t size,
                                      StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  enter_locked("copy_device_to_device", device);
  auto device_memory = [&](DevicePtr ptr) {
    return inside_one(mappings_, ptr, size, [](const Mapping& m) { return m.size; }) ||
           inside_one(plain_allocations_, ptr, size,
                      [](const auto& entry) { return entry.second; }) ||
           managed_.covers(ptr, size);
  };
  if (!device_memory(src)) {
    fail("copy_device_to_device", kInvalidValue, "source is not mapped device memory");
  }
  if (!device_memory(dst)) {
    fail("copy_device_to_device", kInvalidValue, "destination is not mapped device memory");
  }
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size);
  note_copy_locked(stream, src, size);
  note_copy_locked(stream, dst, size);
}

}  // namespace tus
