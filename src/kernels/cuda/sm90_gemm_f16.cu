// The f16 instantiations of the sm_90a CUTLASS GEMM (one file per dtype: they compile in
// parallel).
#include "cuda/sm90_gemm.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

bool sm90_gemm_f16(const Sm90Problem& p, cudaStream_t stream, Status* status) {
  return sm90::dispatch<cutlass::half_t>(p, stream, status);
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
