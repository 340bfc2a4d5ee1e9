// Hopper (sm_90a) dense GEMM through CUTLASS 3's TMA + wgmma warp-specialised kernels.
// Host-only declarations (no CUTLASS header): gemm.cu includes this and calls sm90_gemm()
// when the library was built with it (PG_WITH_SM90_GEMM) and the device is sm_90.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "portable_gemm/kernels.h"

namespace portable_gemm {
namespace cuda {
namespace detail {

// d[M, N] = a[M, K] @ b[K, N] in f16 or bf16 with fp32 accumulation. a and d are row-major
// with leading dimensions lda / ldd (unit column stride). b is row-major (N contiguous,
// ldb = its row stride) or, with b_k_major, column-major (K contiguous, ldb = its column
// stride: the transpose of an nn.Linear weight). No bias or activation: callers apply them.
struct Sm90Problem {
  DType dtype = DType::bf16;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool b_k_major = false;
  void* d = nullptr;
  int64_t ldd = 0;
  int64_t M = 0, N = 0, K = 0;
  int device = 0;
  int sm_count = 0;
};

// Runs the problem and returns true, with *status the launch's status; returns false
// without launching when CUTLASS cannot implement it (alignment, sizes, a workspace would
// be needed), so that the caller falls back to the portable tensor-core kernel.
bool sm90_gemm(const Sm90Problem& p, cudaStream_t stream, Status* status);
bool sm90_gemm_f16(const Sm90Problem& p, cudaStream_t stream, Status* status);
bool sm90_gemm_bf16(const Sm90Problem& p, cudaStream_t stream, Status* status);

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
