// cuda::dequantize_rows and cuda::bias_act_store: the two kernels around a dense GEMM that
// the CUDA binding runs for weight-only linears with many rows of x (see kernels.h).
#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {
namespace {
using namespace detail;

constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // k values per thread: one 8-byte (int8) / 4-byte (int4) read

// dst[r, k] = q(n0 + r, k) * scale(n0 + r, k) rounded to T; one thread per 8 consecutive k.
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(QuantizedWeight w, int64_t n0, int64_t rows,
                                                              T* dst, int64_t ld) {
  const int64_t per_row = ceil_div(w.k, kPerThread);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= rows * per_row) return;
  const int64_t r = t / per_row, k0 = (t % per_row) * kPerThread;
  const int64_t n = n0 + r;
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.row_stride;
  const int dt = static_cast<int>(w.scales_dtype);
  const int64_t s_row = n * w.scales_row_stride;
  T* out = dst + r * ld;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t k = k0 + i;
    if (k >= w.k) break;
    int q;
    if (w.bits == 8) {
      q = static_cast<int8_t>(row[k]);
    } else {
      const unsigned byte = row[k >> 1];
      q = static_cast<int>(((k & 1) ? (byte >> 4) : (byte & 0xFu)) ^ 8u) - 8;
    }
    const float s = load_f32(w.scales, dt, s_row + (w.group_size > 0 ? k / w.group_size : 0));
    out[k] = from_f32<T>(static_cast<float>(q) * s);
  }
}

// The same with aligned vectors: K % 8 == 0, one scale per 8 values (group_size % 8 == 0
// or per channel), an 8-byte (int8) / 4-byte (int4) load and one 16-byte store per thread.
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_vec_kernel(QuantizedWeight w, int64_t n0, int64_t rows,
                                                                  T* dst, int64_t ld) {
  const int64_t per_row = w.k / kPerThread;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= rows * per_row) return;
  const int64_t r = t / per_row, k0 = (t % per_row) * kPerThread;
  const int64_t n = n0 + r;
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.row_stride;
  const float s = load_f32(w.scales, static_cast<int>(w.scales_dtype),
                           n * w.scales_row_stride + (w.group_size > 0 ? k0 / w.group_size : 0));
  float v[kPerThread];
  if (w.bits == 8) {
    const uint2 b = __ldg(reinterpret_cast<const uint2*>(row + k0));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = static_cast<float>(static_cast<int8_t>(b.x >> (8 * i)));
      v[4 + i] = static_cast<float>(static_cast<int8_t>(b.y >> (8 * i)));
    }
  } else {
    const uint32_t b = __ldg(reinterpret_cast<const unsigned int*>(row + k0 / 2));
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) v[i] = static_cast<float>(static_cast<int>(((b >> (4 * i)) & 0xFu) ^ 8u) - 8);
  }
  uint4 o;
  uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) ow[i] = pack2<T>(v[2 * i] * s, v[2 * i + 1] * s);
  *reinterpret_cast<uint4*>(dst + r * ld + k0) = o;
}

// out[m, n0 + j] = act(src[m, j] + bias[n0 + j]) for m < M, j < cols.
template <typename T>
__global__ void __launch_bounds__(kThreads) bias_act_kernel(const T* src, int64_t M, int64_t cols, int64_t ld,
                                                            int64_t n0, const T* bias, int64_t bias_stride,
                                                            int act, T* out, int64_t o_rs, int64_t o_cs) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= M * cols) return;
  const int64_t m = t / cols, j = t % cols;
  float v = to_f32(src[m * ld + j]);
  if (bias != nullptr) v += to_f32(bias[(n0 + j) * bias_stride]);
  out[m * o_rs + (n0 + j) * o_cs] = from_f32<T>(apply_act(v, act));
}

Status bad(const char* what) { return Status{static_cast<int32_t>(cudaErrorInvalidValue), what}; }

}  // namespace

Status dequantize_rows(const QuantizedWeight& w, int64_t n0, int64_t rows, Matrix dst, void* stream) {
  if (w.bits != 4 && w.bits != 8) return bad("portable_gemm.cuda.dequantize_rows: bits must be 4 or 8");
  if (n0 < 0 || rows < 0 || n0 + rows > w.n || dst.rows != rows || dst.cols != w.k || dst.col_stride != 1)
    return bad("portable_gemm.cuda.dequantize_rows: dst must be [rows, K] with unit column stride");
  if (rows == 0 || w.k == 0) return Status{};
  const int64_t threads = rows * ceil_div(w.k, kPerThread);
  const int64_t blocks = ceil_div(threads, kThreads);
  if (blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t qb = w.bits == 8 ? 8 : 4;  // bytes per 8 values
  const bool vec = w.k % kPerThread == 0 && (w.group_size == 0 || w.group_size % kPerThread == 0) &&
                   reinterpret_cast<uintptr_t>(w.data) % qb == 0 && w.row_stride % qb == 0 &&
                   reinterpret_cast<uintptr_t>(dst.data) % 16 == 0 && dst.row_stride % 8 == 0;
  const unsigned nb = static_cast<unsigned>(blocks);
  switch (dst.dtype) {
    case DType::f16: {
      auto* d = static_cast<__half*>(dst.data);
      if (vec) dequantize_vec_kernel<<<nb, kThreads, 0, s>>>(w, n0, rows, d, dst.row_stride);
      else dequantize_kernel<<<nb, kThreads, 0, s>>>(w, n0, rows, d, dst.row_stride);
      break;
    }
    case DType::bf16: {
      auto* d = static_cast<__nv_bfloat16*>(dst.data);
      if (vec) dequantize_vec_kernel<<<nb, kThreads, 0, s>>>(w, n0, rows, d, dst.row_stride);
      else dequantize_kernel<<<nb, kThreads, 0, s>>>(w, n0, rows, d, dst.row_stride);
      break;
    }
    default:
      return bad("portable_gemm.cuda.dequantize_rows: dst must be f16 or bf16");
  }
  return launch_status();
}

Status bias_act_store(ConstMatrix src, int64_t n0, const void* bias, int64_t bias_stride,
                      Activation act, Matrix out, void* stream) {
  if (src.dtype != out.dtype || src.col_stride != 1 || src.rows != out.rows || n0 < 0 ||
      n0 + src.cols > out.cols)
    return bad("portable_gemm.cuda.bias_act_store: src must be [M, cols] of out's dtype, unit column stride");
  if (src.rows == 0 || src.cols == 0) return Status{};
  const int64_t blocks = ceil_div(src.rows * src.cols, kThreads);
  if (blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  auto s = static_cast<cudaStream_t>(stream);
  const int a = static_cast<int>(act);
  switch (out.dtype) {
    case DType::f16:
      bias_act_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
          static_cast<const __half*>(src.data), src.rows, src.cols, src.row_stride, n0,
          static_cast<const __half*>(bias), bias_stride, a, static_cast<__half*>(out.data), out.row_stride,
          out.col_stride);
      break;
    case DType::bf16:
      bias_act_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
          static_cast<const __nv_bfloat16*>(src.data), src.rows, src.cols, src.row_stride, n0,
          static_cast<const __nv_bfloat16*>(bias), bias_stride, a, static_cast<__nv_bfloat16*>(out.data),
          out.row_stride, out.col_stride);
      break;
    default:
      return bad("portable_gemm.cuda.bias_act_store: f16 or bf16 only");
  }
  return launch_status();
}

}  // namespace cuda
}  // namespace portable_gemm
