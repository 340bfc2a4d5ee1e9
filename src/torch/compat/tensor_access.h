// Data pointers. 2.9 has only data_ptr(); 2.10 added const/mutable accessors, which let
// torch skip copy-on-write materialisation for inputs we only read.
#pragma once
#include <torch/csrc/stable/tensor.h>
#include "compat/version.h"

namespace portable_gemm::compat {

inline const void* const_data(const torch::stable::Tensor& t) {
#if PG_TARGET_AT_LEAST_2_10
  return t.const_data_ptr();
#else
  return t.data_ptr();
#endif
}

inline void* mutable_data(const torch::stable::Tensor& t) {
#if PG_TARGET_AT_LEAST_2_10
  return t.mutable_data_ptr();
#else
  return t.data_ptr();
#endif
}

}  // namespace portable_gemm::compat
