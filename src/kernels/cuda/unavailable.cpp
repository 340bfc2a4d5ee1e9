// The cuda:: half of the API for a library built without CUDA. The symbols exist anyway
// so that every binding links against one and the same ABI, and a CUDA call made by
// mistake gets a readable error instead of a missing-symbol failure at load time.
#include "portable_gemm/kernels.h"

namespace portable_gemm {
namespace cuda {

namespace {
constexpr const char* kNoCuda = "portable_gemm was built without CUDA kernels";
Status unavailable() { return Status{1, kNoCuda}; }
}  // namespace

Status gemm(const GemmArgs&, void*) { return unavailable(); }
Status mixed_linear(const MixedLinearArgs&, void*) { return unavailable(); }
bool mixed_linear_small_m(const MixedLinearArgs&) { return false; }
Status quantize(const QuantizeArgs&, void*) { return unavailable(); }
Status dequantize_rows(const QuantizedWeight&, int64_t, int64_t, Matrix, void*) { return unavailable(); }
Status bias_act_store(ConstMatrix, int64_t, const void*, int64_t, Activation, Matrix, void*) {
  return unavailable();
}
int64_t mixed_linear_sm90_workspace(const MixedLinearArgs&) { return -1; }
bool mixed_linear_sm90_preferred(const MixedLinearArgs&) { return false; }
Status mixed_linear_sm90(const MixedLinearArgs&, void*, void*) { return unavailable(); }
MixedLinearPath mixed_linear_path(const MixedLinearArgs&, int64_t* scratch_bytes) {
  *scratch_bytes = 0;
  return MixedLinearPath::kernels;  // whose call answers "built without CUDA"
}
Status mixed_linear_pooled(const MixedLinearArgs&, void*) { return unavailable(); }
Status device_alloc(void**, size_t, int32_t) { return unavailable(); }
Status fill_bytes(void*, size_t, void*) { return unavailable(); }
void device_free(void*, int32_t) {}
Status set_device(int32_t, int32_t*) { return unavailable(); }
const char* error_string(int32_t) {
  return "no CUDA runtime: portable_gemm was built without CUDA kernels";
}

}  // namespace cuda
}  // namespace portable_gemm
