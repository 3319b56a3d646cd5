// The extern "C" allocation entry points for torch.cuda.memory.CUDAPluggableAllocator. PyTorch
// dlopens this module's file and looks these symbols up; they use no Python.
#pragma once

#include <cstddef>
#include <string>

namespace tus::bindings {

constexpr const char* kMallocSymbol = "tus_malloc";
constexpr const char* kFreeSymbol = "tus_free";
// How an out-of-memory raised under the global hook begins (Note [Failing under the global hook]
// in pluggable_entry.cpp); lms_mode() recognises it by this.
constexpr const char* kHookOutOfMemory = "CUDA out of memory. torch_uvm_saver could not allocate";

std::string last_malloc_error();

}  // namespace tus::bindings

extern "C" {
// Returns nullptr on failure in a region; throws under the global hook (Note [Failing under the
// global hook] in pluggable_entry.cpp).
__attribute__((visibility("default"))) void* tus_malloc(std::size_t size, int device, void* stream);
__attribute__((visibility("default"))) void tus_free(void* ptr, std::size_t size, int device,
                                                     void* stream) noexcept;
}
