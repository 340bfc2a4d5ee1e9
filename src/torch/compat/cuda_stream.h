// The current CUDA stream of a device. 2.13 added Stream::nativeHandle(); 2.9-2.12 only
// have the AOTI shim, declared under USE_CUDA and exported by libtorch_cuda.
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/util/shim_utils.h>
#include "compat/version.h"

namespace portable_gemm::compat {

#if PG_TARGET_AT_LEAST_2_13
inline constexpr const char* kStreamApi = "Stream::nativeHandle";
#else
inline constexpr const char* kStreamApi = "aoti_torch_get_current_cuda_stream";
#endif

inline void* current_cuda_stream(int32_t device_index) {
#if PG_TARGET_AT_LEAST_2_13
  return torch::stable::accelerator::getCurrentStream(device_index).nativeHandle();
#else
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return stream;
#endif
}

}  // namespace portable_gemm::compat
