// Runtime glue of the CUDA half of the kernel library: error strings and Status helpers.
// The library links cudart statically, so errors must be read through this copy of the
// runtime (a binding's own cudart is a different instance with its own error state).
#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {

const char* error_string(int32_t code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

Status device_alloc(void** ptr, size_t bytes, int32_t device) {
  int32_t previous = 0;
  Status s = set_device(device, &previous);
  if (!s.ok()) return s;
  const cudaError_t e = cudaMalloc(ptr, bytes > 0 ? bytes : 1);
  cudaSetDevice(previous);
  return detail::status_from(e);
}

Status fill_bytes(void* data, size_t bytes, void* stream) {
  if (bytes == 0) return Status{};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(data, 0xFF, bytes, st);
  if (e == cudaSuccess && st == nullptr) e = cudaStreamSynchronize(nullptr);
  return detail::status_from(e);
}

void device_free(void* ptr, int32_t device) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device);
  cudaFree(ptr);
  cudaSetDevice(previous);
}

Status set_device(int32_t device, int32_t* previous) {
  int prev = 0;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (previous) *previous = prev;
  return detail::status_from(e);
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
