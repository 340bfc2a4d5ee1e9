// CUDA binding, compiled once per torch target with -DUSE_CUDA. Only implements the
// schemas the CPU binding of the same target defined; it is loaded after it, and only
// under a CUDA build of torch (it needs libtorch_cuda.so).
#include <torch/csrc/stable/accelerator.h>

#include "compat/alloc.h"
#include "compat/cuda_check.h"
#include "compat/tensor_access.h"
#include "compat/cuda_stream.h"
#include "ops_common.h"

namespace portable_gemm::binding {
namespace {

struct CudaBackend {
  static constexpr const char* dispatch_key = "CUDA";
  static void check_device(const Tensor& t, const char* op) {
    STD_TORCH_CHECK(t.is_cuda(), op, ": the CUDA kernel got a non-CUDA tensor");
  }
  template <class Args, class Launch>
  static void launch(const Args& args, const Tensor& like, Launch fn) {
    const int32_t device = like.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    void* stream = compat::current_cuda_stream(device);
    PG_CUDA_CHECK(fn(args, stream).code);
  }
  static void run(const GemmArgs& a, const Tensor& like, const char*) {
    launch(a, like, cuda::gemm);
  }
  // More rows of x than the small-M kernels take (f16 / bf16 x, M > 16, or more than the
  // sliced tensor-core GEMV takes, cuda::mixed_linear_small_m), or small-M rows the sm_90
  // GEMM runs faster (cuda::mixed_linear_sm90_preferred): on sm_90 the library's fused
  // CUTLASS mixed-input GEMM when it applies; otherwise dequantise the weight into a
  // temporary, multiply with torch's own matmul (cuBLAS) and apply bias and activation while
  // storing. The library's mma.sync GEMM reaches ~0.2x cuBLAS there (bench/GPU_NOTES.md,
  // run 15); the temporary costs one extra write + read of the weight in 16 bits per call.
  // Weights whose 16-bit copy would exceed kMaxTempBytes keep the library's GEMM off sm_90:
  // splitting them into row chunks was measured 7x slower (run 17: chunks of 4681 rows gave
  // cuBLAS an odd leading dimension).
  static constexpr int64_t kMaxTempBytes = int64_t(512) << 20;
  static void run(const MixedLinearArgs& a, const Tensor& x, const char*) {
    const bool half = a.x.dtype == DType::f16 || a.x.dtype == DType::bf16;
    const int64_t N = a.w.n, K = a.w.k;
    // x's device is current from here on: the choices below read the current device's facts
    const int32_t device = x.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    const bool small_m = cuda::mixed_linear_small_m(a) && !cuda::mixed_linear_sm90_preferred(a);
    if (small_m || !half || K == 0) {
      launch(a, x, cuda::mixed_linear);
      return;
    }
    // sm_90: the fused mixed-input kernel reads the quantised weight as stored; it needs at
    // most a small workspace (the scales transposed unless they are read as stored, the
    // stream-K partial sums). It beat dequantise + GEMM at every M measured
    // (bench/GPU_NOTES.md, run 20).
    const int64_t ws = cuda::mixed_linear_sm90_workspace(a);
    if (ws < 0 && N > kMaxTempBytes / (2 * K)) {
      launch(a, x, cuda::mixed_linear);
      return;
    }
    void* stream = compat::current_cuda_stream(device);
    if (ws == 0) {  // per-channel scales read as stored, no stream-K: no workspace
      PG_CUDA_CHECK(cuda::mixed_linear_sm90(a, nullptr, stream).code);
      return;
    }
    if (ws > 0) {
      Tensor scratch = compat::new_output(x, {ws / 2}, x.scalar_type());
      PG_CUDA_CHECK(cuda::mixed_linear_sm90(a, compat::mutable_data(scratch), stream).code);
      return;
    }
    Tensor w = compat::new_output(x, {N, K}, x.scalar_type());
    PG_CUDA_CHECK(cuda::dequantize_rows(a.w, 0, N, Matrix{compat::mutable_data(w), N, K, K, 1, a.x.dtype},
                                        stream).code);
    // [..., K] @ [K, N]: a contiguous [..., N], i.e. M rows of N.
    Tensor y = torch::stable::matmul(x, torch::stable::transpose(w, 0, 1));
    PG_CUDA_CHECK(cuda::bias_act_store(ConstMatrix{compat::const_data(y), a.x.rows, N, N, 1, a.x.dtype}, 0,
                                       a.bias, a.bias_stride, a.activation, a.y, stream).code);
  }
  static void run(const QuantizeArgs& a, const Tensor& like, const char*) {
    launch(a, like, cuda::quantize);
  }
};

}  // namespace
}  // namespace portable_gemm::binding

PG_BINDING_EXPORT int portable_gemm_register(const char* ns, char* err, size_t errlen) {
  using namespace portable_gemm::binding;
  return register_namespace<CudaBackend>(ns, /*define=*/false, err, errlen);
}

PG_BINDING_EXPORT const char* portable_gemm_binding_info() {
  static const std::string info = std::string("{\"target\": \"") + PG_TARGET_VERSION +
                                  "\", \"device\": \"cuda\", \"stream_api\": \"" +
                                  portable_gemm::compat::kStreamApi +
                                  "\", \"cuda_error_check\": \"" +
                                  portable_gemm::compat::kCudaErrorCheck + "\"}";
  return info.c_str();
}
