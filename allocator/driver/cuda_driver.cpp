#include "allocator/driver/cuda_driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include "allocator/message.h"

#include "allocator/errors.h"

namespace tus {

// One pointer per driver entry point, each pinned to the ABI version it was written against
// (the toolkit's PFN_<name>_v<version> typedefs). cuGetProcAddress is asked for exactly that
// version, so a newer driver that changed a signature (cuCtxSynchronize gained a context argument
// in CUDA 13) still hands out the one this code calls.
// clang-format off
#define TUS_CUDA_ENTRY_POINTS(X)           \
  X(cuInit, 2000)                          \
  X(cuGetErrorName, 6000)                  \
  X(cuDeviceGet, 2000)                     \
  X(cuDeviceGetCount, 2000)                \
  X(cuDeviceGetAttribute, 2000)            \
  X(cuDevicePrimaryCtxRetain, 7000)        \
  X(cuCtxGetCurrent, 4000)                 \
  X(cuCtxSetCurrent, 4000)                 \
  X(cuCtxSynchronize, 2000)                \
  X(cuMemGetInfo, 3020)                    \
  X(cuMemGetAllocationGranularity, 10020)  \
  X(cuMemAddressReserve, 10020)            \
  X(cuMemAddressFree, 10020)               \
  X(cuMemCreate, 10020)                    \
  X(cuMemRelease, 10020)                   \
  X(cuMemMap, 10020)                       \
  X(cuMemUnmap, 10020)                     \
  X(cuMemSetAccess, 10020)                 \
  X(cuMemExportToShareableHandle, 10020)   \
  X(cuMemImportFromShareableHandle, 10020) \
  X(cuMemAlloc, 3020)                      \
  X(cuMemFree, 3020)                       \
  X(cuMemAllocManaged, 6000)               \
  X(cuMemAdvise, 12020)                    \
  X(cuMemPrefetchAsync, 12020)             \
  X(cuMemRangeGetAttribute, 8000)          \
  X(cuPointerGetAttribute, 4000)           \
  X(cuMemHostAlloc, 2020)                  \
  X(cuThreadExchangeStreamCaptureMode, 10010) \
  X(cuMemFreeHost, 2000)                   \
  X(cuStreamCreate, 2000)                  \
  X(cuStreamDestroy, 4000)                 \
  X(cuStreamSynchronize, 2000)             \
  X(cuEventCreate, 2000)                   \
  X(cuEventDestroy, 4000)                  \
  X(cuEventRecord, 2000)                   \
  X(cuEventSynchronize, 2000)              \
  X(cuEventQuery, 2000)                    \
  X(cuEventElapsedTime, 2000)              \
  X(cuStreamWaitEvent, 3020)               \
  X(cuMemcpyDtoHAsync, 3020)               \
  X(cuMemcpyHtoDAsync, 3020)               \
  X(cuMemcpyDtoDAsync, 3020)
// clang-format on

struct CudaApi {
#define TUS_DECLARE_ENTRY(fn, version) PFN_##fn##_v##version fn = nullptr;
  TUS_CUDA_ENTRY_POINTS(TUS_DECLARE_ENTRY)
#undef TUS_DECLARE_ENTRY
};

namespace {

constexpr int kNoDriver = CUDA_ERROR_NO_DEVICE;

std::string error_name(const CudaApi& api, CUresult result) {
  const char* name = nullptr;
  if (api.cuGetErrorName != nullptr && api.cuGetErrorName(result, &name) == CUDA_SUCCESS && name) {
    return name;
  }
  return "CUresult " + std::to_string(static_cast<int>(result));
}

void check(const CudaApi& api, CUresult result, const char* call, const std::string& details) {
  if (result == CUDA_SUCCESS) return;
  Message message;
  message << call << "(" << details << ") failed: " << error_name(api, result);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(message.str());
  throw CudaError(message.str(), static_cast<int>(result));
}

CUmemAllocationProp device_allocation_prop(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

CUmemLocation to_cuda(MemLocation location) {
  CUmemLocation out = {};
  switch (location.kind) {
    case MemLocation::Kind::kDevice:
      out.type = CU_MEM_LOCATION_TYPE_DEVICE;
      out.id = location.device;
      break;
    case MemLocation::Kind::kHost:
      out.type = CU_MEM_LOCATION_TYPE_HOST;
      break;
    case MemLocation::Kind::kNone:
      out.type = CU_MEM_LOCATION_TYPE_INVALID;
      break;
  }
  return out;
}

MemLocation from_cuda(int type, int id) {
  if (type == CU_MEM_LOCATION_TYPE_DEVICE) return MemLocation::on_device(id);
  if (type == CU_MEM_LOCATION_TYPE_HOST || type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
      type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT) {
    return MemLocation::host();
  }
  return MemLocation::none();
}

std::string bytes_on(std::size_t size, int device) {
  return std::to_string(size) + " bytes, device " + std::to_string(device);
}

}  // namespace

// Makes `device`'s primary context (the one PyTorch and the runtime API use) current for one
// call and puts the caller's context back afterwards, so that calling us never changes which
// device the caller's thread is on.
class CudaDriver::ContextGuard {
 public:
  ContextGuard(CudaDriver& driver, int device) : api_(driver.api()) {
    CUcontext wanted = static_cast<CUcontext>(driver.primary_context(device));
    check(api_, api_.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent", "");
    if (previous_ != wanted) {
      check(api_, api_.cuCtxSetCurrent(wanted), "cuCtxSetCurrent",
            "device " + std::to_string(device));
      switched_ = true;
    }
  }
  ~ContextGuard() {
    if (switched_) api_.cuCtxSetCurrent(previous_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const CudaApi& api_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

CudaDriver::CudaDriver() = default;
CudaDriver::~CudaDriver() = default;

const CudaApi& CudaDriver::api() {
  std::call_once(load_once_, [this] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (library == nullptr) {
      const char* why = dlerror();
      load_error_ = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") +
                    (why ? why : "unknown reason") +
                    ". This machine has no NVIDIA driver; set TUS_DRIVER=sim to use the simulated "
                    "driver.";
      return;
    }
    using GetProcAddress =
        CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(library, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) {
      load_error_ =
          "libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver is older than "
          "CUDA 12; torch_uvm_saver needs a driver for CUDA 12 or newer.";
      return;
    }
    auto api = std::make_unique<CudaApi>();
    std::string missing;
#define TUS_RESOLVE_ENTRY(fn, version)                                                            \
  {                                                                                               \
    void* address = nullptr;                                                                      \
    CUdriverProcAddressQueryResult status;                                                        \
    if (get_proc(#fn, &address, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || \
        address == nullptr) {                                                                     \
      missing += std::string(missing.empty() ? "" : ", ") + #fn;                                  \
    }                                                                                             \
    api->fn = reinterpret_cast<decltype(api->fn)>(address);                                       \
  }
    TUS_CUDA_ENTRY_POINTS(TUS_RESOLVE_ENTRY)
#undef TUS_RESOLVE_ENTRY
    if (!missing.empty()) {
      load_error_ = "the NVIDIA driver lacks entry points torch_uvm_saver needs (" + missing +
                    "); a driver for CUDA 12 or newer is required.";
      return;
    }
    CUresult init;
    {
      // It may fork() nvidia-modprobe, and this may run under the Registry's lock (Note [Fork]).
      const ForkGuard::Unguarded forks_to_exec;
      init = api->cuInit(0);
    }
    if (init != CUDA_SUCCESS) {
      load_error_ = "cuInit failed: " + error_name(*api, init);
      return;
    }
    api_ = std::move(api);
  });
  if (!api_) throw CudaError(load_error_, kNoDriver);
  return *api_;
}

void* CudaDriver::primary_context(int device) {
  if (device < 0 || device >= kMaxDevices) {
    TUS_THROW(InvalidArgument, "device " << device << " is out of range");
  }
  std::lock_guard<std::mutex> lock(context_mutex_);
  if (primary_contexts_[device] == nullptr) {
    const CudaApi& cuda = api();
    CUdevice handle;
    check(cuda, cuda.cuDeviceGet(&handle, device), "cuDeviceGet",
          "device " + std::to_string(device));
    CUcontext context;
    // Retained for the life of the process: PyTorch uses the same primary context.
    check(cuda, cuda.cuDevicePrimaryCtxRetain(&context, handle), "cuDevicePrimaryCtxRetain",
          "device " + std::to_string(device));
    primary_contexts_[device] = context;
  }
  return primary_contexts_[device];
}

int CudaDriver::device_count() {
  const CudaApi& cuda = api();
  int count = 0;
  check(cuda, cuda.cuDeviceGetCount(&count), "cuDeviceGetCount", "");
  return count;
}

MemInfo CudaDriver::mem_get_info(int device) {
  ContextGuard guard(*this, device);
  MemInfo info;
  check(api(), api().cuMemGetInfo(&info.free_bytes, &info.total_bytes), "cuMemGetInfo",
        "device " + std::to_string(device));
  return info;
}

std::size_t CudaDriver::granularity(int device) {
  if (device >= 0 && device < kMaxDevices && granularity_[device] != 0) return granularity_[device];
  ContextGuard guard(*this, device);
  CUmemAllocationProp prop = device_allocation_prop(device);
  std::size_t value = 0;
  check(api(), api().cuMemGetAllocationGranularity(&value, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity", "device " + std::to_string(device));
  granularity_[device] = value;
  return value;
}

DevicePtr CudaDriver::reserve_address(int device, std::size_t size) {
  ContextGuard guard(*this, device);
  CUdeviceptr ptr = 0;
  check(api(), api().cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve",
        bytes_on(size, device));
  return static_cast<DevicePtr>(ptr);
}

void CudaDriver::free_address(int device, DevicePtr ptr, std::size_t size) {
  ContextGuard guard(*this, device);
  check(api(), api().cuMemAddressFree(static_cast<CUdeviceptr>(ptr), size), "cuMemAddressFree",
        bytes_on(size, device));
}

PhysHandle CudaDriver::create_physical(int device, std::size_t size) {
  ContextGuard guard(*this, device);
  CUmemAllocationProp prop = device_allocation_prop(device);
  // Exportable where the device allows it, so that any tag can be shared later (Note [Sharing]);
  // asking costs nothing measurable at cuMemCreate.
  if (exportable_[device] == 0) {
    int supported = 0;
    const CUresult asked = api().cuDeviceGetAttribute(
        &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device);
    exportable_[device] = asked == CUDA_SUCCESS && supported != 0 ? 1 : -1;
  }
  if (exportable_[device] > 0) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle handle = 0;
  check(api(), api().cuMemCreate(&handle, size, &prop, 0), "cuMemCreate", bytes_on(size, device));
  return static_cast<PhysHandle>(handle);
}

int CudaDriver::export_physical(int device, PhysHandle handle) {
  ContextGuard guard(*this, device);
  int fd = -1;
  check(api(),
        api().cuMemExportToShareableHandle(&fd, static_cast<CUmemGenericAllocationHandle>(handle),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle", "device " + std::to_string(device));
  return fd;
}

PhysHandle CudaDriver::import_physical(int device, int fd) {
  ContextGuard guard(*this, device);
  CUmemGenericAllocationHandle handle = 0;
  void* shareable = reinterpret_cast<void*>(static_cast<std::intptr_t>(fd));
  check(api(),
        api().cuMemImportFromShareableHandle(&handle, shareable,
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle", "device " + std::to_string(device));
  return static_cast<PhysHandle>(handle);
}

void CudaDriver::release_physical(int device, PhysHandle handle) {
  ContextGuard guard(*this, device);
  check(api(), api().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)),
        "cuMemRelease", "device " + std::to_string(device));
}

void CudaDriver::map(int device, DevicePtr ptr, std::size_t size, PhysHandle handle) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuMemMap(static_cast<CUdeviceptr>(ptr), size, 0,
                       static_cast<CUmemGenericAllocationHandle>(handle), 0),
        "cuMemMap", bytes_on(size, device));
}

void CudaDriver::unmap(int device, DevicePtr ptr, std::size_t size) {
  ContextGuard guard(*this, device);
  check(api(), api().cuMemUnmap(static_cast<CUdeviceptr>(ptr), size), "cuMemUnmap",
        bytes_on(size, device));
}

void CudaDriver::set_access(int device, DevicePtr ptr, std::size_t size) {
  ContextGuard guard(*this, device);
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(api(), api().cuMemSetAccess(static_cast<CUdeviceptr>(ptr), size, &access, 1),
        "cuMemSetAccess", bytes_on(size, device));
}

DevicePtr CudaDriver::mem_alloc(int device, std::size_t size) {
  ContextGuard guard(*this, device);
  CUdeviceptr ptr = 0;
  check(api(), api().cuMemAlloc(&ptr, size), "cuMemAlloc", bytes_on(size, device));
  return static_cast<DevicePtr>(ptr);
}

void CudaDriver::mem_free(int device, DevicePtr ptr) {
  ContextGuard guard(*this, device);
  check(api(), api().cuMemFree(static_cast<CUdeviceptr>(ptr)), "cuMemFree",
        "device " + std::to_string(device));
}

DevicePtr CudaDriver::mem_alloc_managed(int device, std::size_t size) {
  ContextGuard guard(*this, device);
  CUdeviceptr ptr = 0;
  check(api(), api().cuMemAllocManaged(&ptr, size, CU_MEM_ATTACH_GLOBAL), "cuMemAllocManaged",
        bytes_on(size, device));
  return static_cast<DevicePtr>(ptr);
}

void CudaDriver::mem_advise(int device, DevicePtr ptr, std::size_t size, Advice advice,
                            MemLocation location) {
  ContextGuard guard(*this, device);
  // Advice that ignores its location still needs a valid one (CUDA 13 rejects the invalid type).
  if (location.is_none()) location = MemLocation::on_device(device);
  check(api(),
        api().cuMemAdvise(static_cast<CUdeviceptr>(ptr), size, static_cast<CUmem_advise>(advice),
                          to_cuda(location)),
        "cuMemAdvise",
        "advice " + std::to_string(static_cast<int>(advice)) + ", " + location_name(location) +
            ", " + bytes_on(size, device));
}

void CudaDriver::mem_prefetch(int device, DevicePtr ptr, std::size_t size, MemLocation location,
                              StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuMemPrefetchAsync(static_cast<CUdeviceptr>(ptr), size, to_cuda(location), 0,
                                 static_cast<CUstream>(stream)),
        "cuMemPrefetchAsync", "to " + location_name(location) + ", " + bytes_on(size, device));
}

RangeAttributes CudaDriver::range_attributes(int device, DevicePtr ptr, std::size_t size) {
  ContextGuard guard(*this, device);
  const auto dptr = static_cast<CUdeviceptr>(ptr);
  auto query_int = [&](CUmem_range_attribute attribute) {
    int value = 0;
    check(
        api(), api().cuMemRangeGetAttribute(&value, sizeof(value), attribute, dptr, size),
        "cuMemRangeGetAttribute",
        "attribute " + std::to_string(static_cast<int>(attribute)) + ", " + bytes_on(size, device));
    return value;
  };
  RangeAttributes out;
  out.read_mostly = query_int(CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY) != 0;
  out.preferred = from_cuda(query_int(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE),
                            query_int(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID));
  out.last_prefetch = from_cuda(query_int(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE),
                                query_int(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID));
  // Device ordinals, CU_DEVICE_CPU (-1) for the host, CU_DEVICE_INVALID (-2) for unused slots.
  int accessors[kMaxDevices + 1];
  check(api(),
        api().cuMemRangeGetAttribute(accessors, sizeof(accessors),
                                     CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, dptr, size),
        "cuMemRangeGetAttribute", "accessed-by, " + bytes_on(size, device));
  for (int accessor : accessors) {
    if (accessor == CU_DEVICE_CPU) out.accessed_by.push_back(MemLocation::host());
    if (accessor >= 0) out.accessed_by.push_back(MemLocation::on_device(accessor));
  }
  return out;
}

bool CudaDriver::is_managed(int device, DevicePtr ptr) {
  ContextGuard guard(*this, device);
  unsigned int managed = 0;
  const CUresult result = api().cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                                      static_cast<CUdeviceptr>(ptr));
  // Host memory CUDA never saw (malloc'd, mmap'd) is not an error here: it is just not managed.
  if (result == CUDA_ERROR_INVALID_VALUE) return false;
  check(api(), result, "cuPointerGetAttribute", "IS_MANAGED, device " + std::to_string(device));
  return managed != 0;
}

namespace {

// Note [Pinning during a capture]
//  Pinning and unpinning host memory are calls CUDA forbids on every thread while any thread
//  captures a graph in the default (global) mode, and making one anyway invalidates that capture.
//  The host pool pins on a worker thread at any time (Note [Pinning ahead]), so for the length
//  of the call this thread's capture mode is relaxed: the call is allowed, the capture goes on
//  (seen on an H100: a pin ahead for memory a graph allocated during its capture invalidated it).
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const CudaApi& api) : api_(api) {
    if (api_.cuThreadExchangeStreamCaptureMode != nullptr) {
      changed_ = api_.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
    }
  }
  ~RelaxedCaptureMode() {
    if (changed_) api_.cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  const CudaApi& api_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  bool changed_ = false;
};

}  // namespace

void* CudaDriver::host_alloc_pinned(int device, std::size_t size) {
  ContextGuard guard(*this, device);
  RelaxedCaptureMode relaxed(api());  // Note [Pinning during a capture]
  void* ptr = nullptr;
  check(api(), api().cuMemHostAlloc(&ptr, size, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc",
        std::to_string(size) + " bytes");
  return ptr;
}

void CudaDriver::host_free_pinned(int device, void* ptr) {
  ContextGuard guard(*this, device);
  RelaxedCaptureMode relaxed(api());  // Note [Pinning during a capture]
  check(api(), api().cuMemFreeHost(ptr), "cuMemFreeHost", "");
}

StreamHandle CudaDriver::stream_create(int device) {
  ContextGuard guard(*this, device);
  CUstream stream = nullptr;
  check(api(), api().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate",
        "device " + std::to_string(device));
  return stream;
}

void CudaDriver::stream_destroy(int device, StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(), api().cuStreamDestroy(static_cast<CUstream>(stream)), "cuStreamDestroy", "");
}

void CudaDriver::stream_synchronize(int device, StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(), api().cuStreamSynchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize",
        "device " + std::to_string(device));
}

EventHandle CudaDriver::event_create(int device) {
  ContextGuard guard(*this, device);
  CUevent event = nullptr;
  check(api(), api().cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", "");
  return event;
}

void CudaDriver::event_destroy(int device, EventHandle event) {
  ContextGuard guard(*this, device);
  check(api(), api().cuEventDestroy(static_cast<CUevent>(event)), "cuEventDestroy", "");
}

void CudaDriver::event_record(int device, EventHandle event, StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(), api().cuEventRecord(static_cast<CUevent>(event), static_cast<CUstream>(stream)),
        "cuEventRecord", "");
}

void CudaDriver::event_synchronize(int device, EventHandle event) {
  ContextGuard guard(*this, device);
  check(api(), api().cuEventSynchronize(static_cast<CUevent>(event)), "cuEventSynchronize",
        "device " + std::to_string(device));
}

EventHandle CudaDriver::event_create_timed(int device) {
  ContextGuard guard(*this, device);
  CUevent event = nullptr;
  check(api(), api().cuEventCreate(&event, CU_EVENT_DEFAULT), "cuEventCreate", "timed");
  return event;
}

float CudaDriver::event_elapsed_ms(int device, EventHandle start, EventHandle end) {
  ContextGuard guard(*this, device);
  float milliseconds = 0.0f;
  check(api(),
        api().cuEventElapsedTime(&milliseconds, static_cast<CUevent>(start),
                                 static_cast<CUevent>(end)),
        "cuEventElapsedTime", "device " + std::to_string(device));
  return milliseconds;
}

bool CudaDriver::event_query(int device, EventHandle event) {
  ContextGuard guard(*this, device);
  const CUresult result = api().cuEventQuery(static_cast<CUevent>(event));
  if (result == CUDA_ERROR_NOT_READY) return false;
  check(api(), result, "cuEventQuery", "device " + std::to_string(device));
  return true;
}

void CudaDriver::stream_wait_event(int device, StreamHandle stream, EventHandle event) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuStreamWaitEvent(static_cast<CUstream>(stream), static_cast<CUevent>(event), 0),
        "cuStreamWaitEvent", "device " + std::to_string(device));
}

void CudaDriver::device_synchronize(int device) {
  ContextGuard guard(*this, device);
  check(api(), api().cuCtxSynchronize(), "cuCtxSynchronize", "device " + std::to_string(device));
}

void CudaDriver::copy_device_to_host(int device, void* dst, DevicePtr src, std::size_t size,
                                     StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), size,
                                static_cast<CUstream>(stream)),
        "cuMemcpyDtoHAsync", bytes_on(size, device));
}

void CudaDriver::copy_host_to_device(int device, DevicePtr dst, const void* src, std::size_t size,
                                     StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, size,
                                static_cast<CUstream>(stream)),
        "cuMemcpyHtoDAsync", bytes_on(size, device));
}

void CudaDriver::copy_device_to_device(int device, DevicePtr dst, DevicePtr src, std::size_t size,
                                       StreamHandle stream) {
  ContextGuard guard(*this, device);
  check(api(),
        api().cuMemcpyDtoDAsync(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), size,
                                static_cast<CUstream>(stream)),
        "cuMemcpyDtoDAsync", bytes_on(size, device));
}

}  // namespace tus
