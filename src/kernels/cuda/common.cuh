// Private helpers shared by the CUDA kernels of the portable_gemm kernel library.
// No torch header may be included here (or anywhere under src/kernels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "portable_gemm/kernels.h"

namespace portable_gemm {
namespace cuda {
namespace detail {

// ---- host helpers (runtime.cu) ----------------------------------------------------
// Status {code = e, message = cudaGetErrorString(e)}; ok when e == cudaSuccess.
Status status_from(cudaError_t e);
// The status of the launches just made (cudaGetLastError of this library's cudart).
inline Status launch_status() { return status_from(cudaGetLastError()); }
// True when the current device can start a launch while the one before it in the stream
// runs (programmatic dependent launch: compute capability 9.0 or newer). sm90_dispatch.cu,
// from the device facts it reads once per device.
bool current_device_overlaps_launches();

inline bool aligned_to(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Bytes of a quantised weight as stored (n rows of k * bits / 8; scales not counted),
// saturating at INT64_MAX: the small-M routing rules compare it with a size.
inline int64_t quantised_bytes(const QuantizedWeight& w) {
  const int64_t row = w.k * w.bits / 8;
  if (row <= 0 || w.n <= 0) return 0;
  return w.n > INT64_MAX / row ? INT64_MAX : w.n * row;
}

// ---- element conversion -----------------------------------------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Two floats -> two 16-bit values packed in a 32-bit word (a at the lower address).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Runtime-dtype element access (for small operands: scales, bias, GEMV activations).
__device__ __forceinline__ float load_f32(const void* p, int dt, int64_t i) {
  switch (dt) {
    case static_cast<int>(DType::f16):
      return __half2float(static_cast<const __half*>(p)[i]);
    case static_cast<int>(DType::bf16):
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_f32(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case static_cast<int>(DType::f16):
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    case static_cast<int>(DType::bf16):
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

// ---- epilogue -----------------------------------------------------------------------
__device__ __forceinline__ float apply_act(float v, int act) {
  switch (act) {
    case static_cast<int>(Activation::relu):
      return v < 0.f ? 0.f : v;  // NaN propagates, as torch.relu
    case static_cast<int>(Activation::silu):
      return v / (1.f + expf(-v));
    case static_cast<int>(Activation::gelu):
      return 0.5f * v * (1.f + erff(v * 0.70710678118654752440f));
    default:
      return v;
  }
}

// a / b for non-negative a, b: 32-bit division when both fit (the common case).
__device__ __forceinline__ int64_t div_nn(int64_t a, int64_t b) {
  if (((a | b) >> 31) == 0)
    return static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
  return a / b;
}

// ---- int8 / int4 -> float, exact, without I2F --------------------------------------
// Byte `idx` (0..3, compile-time after unrolling) of w as a signed int8, as float.
__device__ __forceinline__ float s8_to_f32(uint32_t w, int idx) {
  // (b ^ 0x80) = b + 128 in 0..255, placed in the mantissa of 2^23: 8388608 + b + 128.
  const uint32_t bits = __byte_perm(w ^ 0x80808080u, 0x4B00u, 0x5440u | static_cast<uint32_t>(idx));
  return __uint_as_float(bits) - 8388736.f;
}
// Nibble `idx` (0..7) of w as a signed int4 (two's complement), as float.
__device__ __forceinline__ float s4_to_f32(uint32_t w, int idx) {
  const uint32_t u = ((w ^ 0x88888888u) >> (4 * idx)) & 0xFu;  // v + 8 in 0..15
  return __uint_as_float(0x4B000000u | u) - 8388616.f;
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// ---- cp.async (sm_80+) ------------------------------------------------------------------
// Copies src_bytes (0..16) from gmem and zero-fills the rest of the 16-byte smem chunk.
// Both addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Opt a kernel into more than 48 KiB of dynamic shared memory when needed.
template <typename Kernel>
inline cudaError_t set_dynamic_smem(Kernel k, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// The shared epilogue parameters of the tiled GEMM kernels: c = act(acc + bias).
struct Epilogue {
  void* c = nullptr;
  int64_t c_rs = 0, c_cs = 0;
  const void* bias = nullptr;
  int64_t bias_stride = 0;
  int64_t M = 0, N = 0, K = 0;
  int act = 0;
};

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
