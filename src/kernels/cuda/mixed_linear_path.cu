// Which path a weight-only linear takes for callers that can lend scratch memory
// (mixed_linear_path: the torch binding's choice), and that choice for callers without an
// allocator of their own, with the scratch taken stream-ordered (mixed_linear_pooled: the
// DLPack door). Host code only; the kernels are those of mixed_linear.cu, sm90_dispatch.cu,
// dequantize.cu and gemm.cu.
#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {

MixedLinearPath mixed_linear_path(const MixedLinearArgs& args, int64_t* scratch_bytes) {
  *scratch_bytes = 0;
  const bool half = args.x.dtype == DType::f16 || args.x.dtype == DType::bf16;
  const int64_t N = args.w.n, K = args.w.k;
  if (!half || K == 0 || (mixed_linear_small_m(args) && !mixed_linear_sm90_preferred(args)))
    return MixedLinearPath::kernels;
  const int64_t workspace = mixed_linear_sm90_workspace(args);
  if (workspace >= 0) {
    *scratch_bytes = workspace;
    return MixedLinearPath::sm90;
  }
  if (N > kMixedTempMaxBytes / (2 * K)) return MixedLinearPath::kernels;
  *scratch_bytes = N * K * 2;
  return MixedLinearPath::dequantize_gemm;
}

Status mixed_linear_pooled(const MixedLinearArgs& args, void* stream_ptr) {
  const Status v = validate_mixed_linear(args);
  if (!v.ok()) return v;
  if (args.x.rows <= 0 || args.w.n <= 0) return Status{};  // nothing to write
  int64_t bytes = 0;
  const MixedLinearPath path = mixed_linear_path(args, &bytes);
  if (path == MixedLinearPath::kernels) return mixed_linear(args, stream_ptr);
  if (path == MixedLinearPath::sm90 && bytes == 0) return mixed_linear_sm90(args, nullptr, stream_ptr);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, static_cast<size_t>(bytes), stream) != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for the next launch check to report
    return mixed_linear(args, stream_ptr);  // the path without scratch
  }
  Status s;
  if (!detail::aligned_to(scratch, 256)) {  // the pool's blocks are; the sm_90 GEMM needs 256
    s = mixed_linear(args, stream_ptr);
  } else if (path == MixedLinearPath::sm90) {
    s = mixed_linear_sm90(args, scratch, stream_ptr);
  } else {
    const int64_t N = args.w.n, K = args.w.k;
    s = dequantize_rows(args.w, 0, N, Matrix{scratch, N, K, K, 1, args.x.dtype}, stream_ptr);
    if (s.ok()) {
      GemmArgs g;
      g.a = args.x;
      g.b = ConstMatrix{scratch, K, N, 1, K, args.x.dtype};  // dequant(w)^T, [K, N], K-major
      g.bias = args.bias;
      g.bias_stride = args.bias_stride;
      g.c = args.y;
      g.activation = args.activation;
      s = gemm(g, stream_ptr);
    }
  }
  const cudaError_t freed = cudaFreeAsync(scratch, stream);  // after the kernels above, in stream order
  if (freed != cudaSuccess) {
    cudaGetLastError();  // reported here, not again by the next launch check
    if (s.ok()) s = detail::status_from(freed);
  }
  return s;
}

}  // namespace cuda
}  // namespace portable_gemm
