// The bf16-activation instantiations (int8 and int4 weights) of the sm_90a CUTLASS
// mixed-input GEMM (one file per dtype: they compile in parallel).
#include "cuda/sm90_mixed.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

bool sm90_mixed_bf16(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  return sm90::dispatch_mixed<__nv_bfloat16, cutlass::bfloat16_t>(p, stream, status);
}

int64_t sm90_mixed_bf16_workspace(const Sm90MixedProblem& p) {
  return sm90::workspace_mixed<__nv_bfloat16, cutlass::bfloat16_t>(p);
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
