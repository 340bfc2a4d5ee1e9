// Runtime glue of the CUDA half of the kernel library: error strings and Status helpers.
// The library links cudart statically, so errors must be read through this copy of the
// runtime (a binding's own cudart is a different instance with its own error state).
#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {

const char* error_string(int32_t code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

namespace detail {

Status status_from(cudaError_t e) {
  Status s;
  if (e != cudaSuccess) {
    s.code = static_cast<int32_t>(e);
    s.message = cudaGetErrorString(e);  // static string owned by cudart
  }
  return s;
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
