// CUDA binding, compiled once per torch target with -DUSE_CUDA. Only implements the
// schemas the CPU binding of the same target defined; it is loaded after it, and only
// under a CUDA build of torch (it needs libtorch_cuda.so).
#include <torch/csrc/stable/accelerator.h>

#include "compat/cuda_check.h"
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
  static void run(const MixedLinearArgs& a, const Tensor& like, const char*) {
    launch(a, like, cuda::mixed_linear);
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
