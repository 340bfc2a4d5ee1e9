// The MixedLinearArgs the kernel probes time: M x K bf16 x, an N x K int4 / int8 weight
// (rows of `row` bytes) with bf16 scales per channel (gs = 0) or per group of gs, bf16 y.
#pragma once
#include <cstdint>

#include "portable_gemm/kernels.h"

static inline portable_gemm::MixedLinearArgs mixed_args(const uint16_t* x, int64_t M, int64_t K,
                                                        const uint8_t* w, int64_t N, int64_t row,
                                                        int bits, int64_t gs, const uint16_t* s,
                                                        uint16_t* y) {
  using portable_gemm::DType;
  portable_gemm::MixedLinearArgs a;
  a.x = {x, M, K, K, 1, DType::bf16};
  a.w.data = w;
  a.w.n = N;
  a.w.k = K;
  a.w.row_stride = row;
  a.w.bits = bits;
  a.w.group_size = gs;
  a.w.scales = s;
  a.w.scales_row_stride = gs ? K / gs : 1;
  a.w.scales_dtype = DType::bf16;
  a.y = {y, M, N, N, 1, DType::bf16};
  return a;
}
