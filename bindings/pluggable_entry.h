// The extern "C" allocation entry points for torch.cuda.memory.CUDAPluggableAllocator. PyTorch
// dlopens this module's file and looks these symbols up; they use no Python.
#pragma once

#include <cstddef>
#include <string>

namespace tus::bindings {

constexpr const char* kMallocSymbol = "tus_malloc";
constexpr const char* kFreeSymbol = "tus_free";

std::string last_malloc_error();

}  // namespace tus::bindings

extern "C" {
__attribute__((visibility("default"))) void* tus_malloc(std::size_t size, int device,
                                                        void* stream) noexcept;
__attribute__((visibility("default"))) void tus_free(void* ptr, std::size_t size, int device,
                                                     void* stream) noexcept;
}
