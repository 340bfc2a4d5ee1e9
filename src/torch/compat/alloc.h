// Output allocation through torch ops, so memory comes from torch's allocators (and, on
// CUDA, never through aoti_torch_cuda_caching_allocator_*, which 2.9.1 does not export).
// 2.9 only has the dtype-only new_empty overload; 2.10 added torch::stable::empty.
#pragma once
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <vector>
#include "compat/version.h"

namespace portable_gemm::compat {

// A new contiguous tensor of `sizes` and `dtype` on `like`'s device.
inline torch::stable::Tensor new_output(const torch::stable::Tensor& like,
                                        const std::vector<int64_t>& sizes,
                                        torch::headeronly::ScalarType dtype) {
#if PG_TARGET_AT_LEAST_2_10
  return torch::stable::empty(sizes, dtype, std::nullopt, like.device());
#else
  return torch::stable::new_empty(like, sizes, dtype);
#endif
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
