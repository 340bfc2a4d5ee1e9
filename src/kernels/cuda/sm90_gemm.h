// Hopper (sm_90a) GEMMs through CUTLASS 3's TMA + wgmma warp-specialised kernels: dense
// f16/bf16 (sm90_gemm_*.cu) and the weight-only mixed-input GEMM (sm90_mixed_*.cu).
// Host-only declarations (no CUTLASS header): gemm.cu and sm90_dispatch.cu call these when
// the library was built with them (PG_WITH_SM90_GEMM) and the device is sm_90.
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

// y[M, N] = x[M, K] @ (q * scale)[N, K]^T for the mixed-input kernel (sm90_mixed.cuh): x and
// y row-major (unit column stride), w [N, K] int8 or packed int4 with its row stride in
// elements (nibbles for int4), scales [N, groups] of any float dtype; scales_t is a
// workspace of groups * N elements of x's dtype that receives them transposed, or, with
// scales_as_stored, the scales themselves (one group, x's dtype, contiguous: already
// [1, N]); workspace (workspace_bytes) is CUTLASS's own, for the stream-K reduction
// (sm90_mixed_*_workspace).
struct Sm90MixedProblem {
  DType dtype = DType::bf16;
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  int64_t w_row_stride_elems = 0;
  int bits = 8;
  int64_t group_size = 0;  // K for per-channel scales
  const void* scales = nullptr;
  int64_t scales_row_stride = 0;
  DType scales_dtype = DType::f32;
  void* scales_t = nullptr;
  bool scales_as_stored = false;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  void* y = nullptr;
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  int device = 0;
  int sm_count = 0;
};

// True when the sm_90 kernels are enabled (the environment does not set
// PORTABLE_GEMM_DISABLE_SM90 to anything but 0) and the current device is compute
// capability 9.0; then *device and *sms (its SM count) are set.
bool current_device_takes_sm90(int* device, int* sms);

// Runs the problem and returns true, with *status the launch's status; returns false
// without launching when CUTLASS cannot implement it (alignment, sizes, a workspace would
// be needed), so that the caller falls back to the portable tensor-core kernel.
bool sm90_gemm_f16(const Sm90Problem& p, cudaStream_t stream, Status* status);
bool sm90_gemm_bf16(const Sm90Problem& p, cudaStream_t stream, Status* status);
bool sm90_mixed_f16(const Sm90MixedProblem& p, cudaStream_t stream, Status* status);
bool sm90_mixed_bf16(const Sm90MixedProblem& p, cudaStream_t stream, Status* status);
// The bytes of CUTLASS workspace the mixed-input kernel needs for p (0 without stream-K),
// or -1 when CUTLASS cannot implement p.
int64_t sm90_mixed_f16_workspace(const Sm90MixedProblem& p);
int64_t sm90_mixed_bf16_workspace(const Sm90MixedProblem& p);

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
