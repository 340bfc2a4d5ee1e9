// Output allocation through torch's allocators (on CUDA never through
// aoti_torch_cuda_caching_allocator_*, which 2.9.1 does not export).
#pragma once
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <vector>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/util/shim_utils.h>

namespace portable_gemm::compat {

// A new contiguous tensor of `sizes` and `dtype` on `like`'s device, from the AOTI shim's
// empty_strided (every runtime from 2.9 on exports it). torch::stable::empty (2.10+) goes
// through torch_call_dispatcher, which looks aten::empty up by name and boxes its arguments
// on every call; on CPU the shim calls empty_strided_cpu directly (bench/GPU_NOTES.md,
// run 80).
inline torch::stable::Tensor new_output(const torch::stable::Tensor& like,
                                        const std::vector<int64_t>& sizes,
                                        torch::headeronly::ScalarType dtype) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> strides(sizes.size());  // contiguous, as torch sets them
  int64_t step = 1;
  for (int64_t d = nd - 1; d >= 0; --d) {
    strides[d] = step;
    step *= sizes[d] > 1 ? sizes[d] : 1;
  }
  int32_t device_type = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  // the shim's dtype code, as the stable API converts it
  const int32_t code = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle out = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(nd, sizes.data(), strides.data(), code, device_type,
                                                  like.get_device_index(), &out));
  return torch::stable::Tensor(out);
}

// A contiguous copy (used only when a view's leading dims cannot be merged into one
// stride; stable ops available since 2.9 in both branches).
inline torch::stable::Tensor contiguous_copy(const torch::stable::Tensor& t) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  torch::stable::Tensor out = new_output(t, sizes, t.scalar_type());
  torch::stable::copy_(out, t);
  return out;
}

}  // namespace portable_gemm::compat
