// Turning a CUDA error code into an exception. >= 2.10: STD_CUDA_CHECK (torch formats
// the message like its own C10_CUDA_CHECK). 2.9 lacks it: our own, same shape.
// The kernels run inside the kernel library, which has its own static cudart, so the
// launch status is captured there and handed back as a code: cudaGetLastError() here
// would ask a different runtime instance (hence no STD_CUDA_KERNEL_LAUNCH_CHECK).
#pragma once
#include <cuda_runtime_api.h>
#include <portable_gemm/kernels.h>
#include <torch/csrc/stable/macros.h>
#include <sstream>
#include <stdexcept>
#include "compat/version.h"

namespace portable_gemm::compat {
#if PG_TARGET_AT_LEAST_2_10
inline constexpr const char* kCudaErrorCheck = "STD_CUDA_CHECK";
#else
inline constexpr const char* kCudaErrorCheck = "own_macro";
#endif
}  // namespace portable_gemm::compat

#if PG_TARGET_AT_LEAST_2_10
#define PG_CUDA_CHECK(code) STD_CUDA_CHECK(static_cast<cudaError_t>(code))
#else
#define PG_CUDA_CHECK(code)                                                          \
  do {                                                                               \
    const int32_t pg_err_ = static_cast<int32_t>(code);                              \
    if (pg_err_ != 0) {                                                              \
      std::ostringstream pg_msg_;                                                    \
      pg_msg_ << "CUDA error: " << ::portable_gemm::cuda::error_string(pg_err_)      \
              << " (code " << pg_err_ << ") at " << __FILE__ << ":" << __LINE__;     \
      throw std::runtime_error(pg_msg_.str());                                       \
    }                                                                                \
  } while (0)
#endif
