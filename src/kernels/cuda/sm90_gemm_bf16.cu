// The bf16 instantiations of the sm_90a CUTLASS GEMM (one file per dtype: they compile in
// parallel).
#include "cuda/sm90_gemm.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

bool sm90_gemm_bf16(const Sm90Problem& p, cudaStream_t stream, Status* status) {
  return sm90::dispatch<cutlass::bfloat16_t>(p, stream, status);
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
