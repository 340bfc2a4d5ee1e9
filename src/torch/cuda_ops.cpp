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
    PG_CHECK(t.is_cuda(), op, ": the CUDA kernel got a non-CUDA tensor");
  }
  // PORTABLE_GEMM_FILL_OUTPUTS=1 (the tests): the outputs 0xFF (NaN) on the op's stream
  // before its kernels.
  template <class Args>
  static void fill(const Args& a, void* stream) {
    if (fill_new_outputs())
      for (const Span& s : fresh_outputs(a)) PG_CUDA_CHECK(cuda::fill_bytes(s.data, s.bytes, stream).code);
  }
  template <class Args, class Launch>
  static void launch(const Args& args, const Tensor& like, Launch fn) {
    const int32_t device = like.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    void* stream = compat::current_cuda_stream(device);
    fill(args, stream);
    PG_CUDA_CHECK(fn(args, stream).code);
  }
  static void run(const GemmArgs& a, const Tensor& like, const char*) {
    launch(a, like, cuda::gemm);
  }
  // The path is the library's choice for callers that lend scratch memory
  // (cuda::mixed_linear_path): the small-M kernels, or on sm_90 the fused CUTLASS
  // mixed-input GEMM with its workspace, or the weight dequantised into a temporary, torch's
  // own matmul (cuBLAS) and bias and activation applied while storing. The temporary costs
  // one extra write + read of the weight in 16 bits per call.
  static void run(const MixedLinearArgs& a, const Tensor& x, const char*) {
    // x's device is current from here on: the choice reads the current device's facts
    const int32_t device = x.get_device_index();
    torch::stable::accelerator::DeviceGuard guard(device);
    int64_t bytes = 0;
    const cuda::MixedLinearPath path = cuda::mixed_linear_path(a, &bytes);
    void* stream = compat::current_cuda_stream(device);
    fill(a, stream);
    if (path == cuda::MixedLinearPath::kernels) {  // under the guard above: no second one
      PG_CUDA_CHECK(cuda::mixed_linear(a, stream).code);
      return;
    }
    if (path == cuda::MixedLinearPath::sm90) {
      if (bytes == 0) {  // per-channel scales read as stored, no stream-K: no workspace
        PG_CUDA_CHECK(cuda::mixed_linear_sm90(a, nullptr, stream).code);
        return;
      }
      Tensor scratch = compat::new_output(x, {bytes / 2}, x.scalar_type());
      PG_CUDA_CHECK(cuda::mixed_linear_sm90(a, compat::mutable_data(scratch), stream).code);
      return;
    }
    const int64_t N = a.w.n, K = a.w.k;
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
