// Argument checks shared by every door into the kernels (torch bindings, DLPack, the CPU
// and CUDA entry points). Kernels assume these hold, so anything a caller can get wrong
// must be caught here, with a message that names the argument to fix.
#include "portable_gemm/kernels.h"

namespace portable_gemm {

namespace {

constexpr Status kOk{};

Status fail(const char* message) { return Status{1, message}; }

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

bool valid_activation(Activation a) {
  return a == Activation::none || a == Activation::relu || a == Activation::silu ||
         a == Activation::gelu;
}

template <typename M>
bool negative_size(const M& m) { return m.rows < 0 || m.cols < 0; }
template <typename M>
bool negative_stride(const M& m) { return m.row_stride < 0 || m.col_stride < 0; }
template <typename M>
bool null_but_not_empty(const M& m) { return m.data == nullptr && m.rows > 0 && m.cols > 0; }
// Several output elements sharing one address would be written concurrently by
// different threads with different values: that is a caller bug, not a broadcast.
template <typename M>
bool output_overlaps(const M& m) {
  return (m.rows > 1 && m.row_stride == 0) || (m.cols > 1 && m.col_stride == 0);
}

}  // namespace

Status validate_gemm(const GemmArgs& g) {
  if (!is_float(g.a.dtype)) return fail("gemm: dtype of a must be f32, f16 or bf16");
  if (g.b.dtype != g.a.dtype) return fail("gemm: dtype of b must equal dtype of a");
  if (g.c.dtype != g.a.dtype) return fail("gemm: dtype of c must equal dtype of a");
  if (negative_size(g.a)) return fail("gemm: a has a negative size");
  if (negative_size(g.b)) return fail("gemm: b has a negative size");
  if (negative_size(g.c)) return fail("gemm: c has a negative size");
  if (negative_stride(g.a)) return fail("gemm: strides of a must be non-negative");
  if (negative_stride(g.b)) return fail("gemm: strides of b must be non-negative");
  if (negative_stride(g.c)) return fail("gemm: strides of c must be non-negative");
  if (g.a.cols != g.b.rows) return fail("gemm: a.cols (K) must equal b.rows");
  if (g.c.rows != g.a.rows) return fail("gemm: c.rows must equal a.rows (M)");
  if (g.c.cols != g.b.cols) return fail("gemm: c.cols must equal b.cols (N)");
  if (null_but_not_empty(g.a)) return fail("gemm: a.data is null but a is not empty");
  if (null_but_not_empty(g.b)) return fail("gemm: b.data is null but b is not empty");
  if (null_but_not_empty(g.c)) return fail("gemm: c.data is null but c is not empty");
  if (output_overlaps(g.c))
    return fail("gemm: c must not have a zero stride along a dimension of size > 1");
  if (g.bias != nullptr && g.bias_stride < 0)
    return fail("gemm: bias_stride must be non-negative");
  if (!valid_activation(g.activation)) return fail("gemm: unknown activation");
  return kOk;
}

Status validate_mixed_linear(const MixedLinearArgs& m) {
  const QuantizedWeight& w = m.w;
  if (!is_float(m.x.dtype)) return fail("mixed_linear: dtype of x must be f32, f16 or bf16");
  if (m.y.dtype != m.x.dtype) return fail("mixed_linear: dtype of y must equal dtype of x");
  if (w.bits != 4 && w.bits != 8) return fail("mixed_linear: w.bits must be 4 or 8");
  if (!is_float(w.scales_dtype))
    return fail("mixed_linear: w.scales_dtype must be f32, f16 or bf16");
  if (negative_size(m.x)) return fail("mixed_linear: x has a negative size");
  if (negative_size(m.y)) return fail("mixed_linear: y has a negative size");
  if (w.n < 0 || w.k < 0) return fail("mixed_linear: w.n and w.k must be non-negative");
  if (negative_stride(m.x)) return fail("mixed_linear: strides of x must be non-negative");
  if (negative_stride(m.y)) return fail("mixed_linear: strides of y must be non-negative");
  if (m.x.cols != w.k) return fail("mixed_linear: x.cols (K) must equal w.k");
  if (m.y.rows != m.x.rows) return fail("mixed_linear: y.rows must equal x.rows (M)");
  if (m.y.cols != w.n) return fail("mixed_linear: y.cols must equal w.n (N)");
  if (w.bits == 4 && w.k % 2 != 0) return fail("mixed_linear: int4 weights need an even K");
  if (w.group_size < 0) return fail("mixed_linear: w.group_size must be non-negative");
  if (w.group_size > 0 && w.k % w.group_size != 0)
    return fail("mixed_linear: w.group_size must divide K");
  const int64_t row_bytes = w.bits == 8 ? w.k : w.k / 2;
  if (w.n > 1 && w.row_stride < row_bytes)
    return fail("mixed_linear: w.row_stride must be at least K bytes (int8) or K/2 (int4)");
  if (w.data == nullptr && w.n > 0 && w.k > 0)
    return fail("mixed_linear: w.data is null but the weight is not empty");
  if (w.scales_row_stride < 0)
    return fail("mixed_linear: w.scales_row_stride must be non-negative");
  const int64_t groups = w.group_size > 0 ? w.k / w.group_size : 1;
  if (w.group_size > 0 && w.n > 1 && w.scales_row_stride < groups)
    return fail("mixed_linear: w.scales_row_stride must be at least K / group_size");
  if (w.scales == nullptr && w.n > 0 && groups > 0)
    return fail("mixed_linear: w.scales is null");
  if (null_but_not_empty(m.x)) return fail("mixed_linear: x.data is null but x is not empty");
  if (null_but_not_empty(m.y)) return fail("mixed_linear: y.data is null but y is not empty");
  if (output_overlaps(m.y))
    return fail("mixed_linear: y must not have a zero stride along a dimension of size > 1");
  if (m.bias != nullptr && m.bias_stride < 0)
    return fail("mixed_linear: bias_stride must be non-negative");
  if (!valid_activation(m.activation)) return fail("mixed_linear: unknown activation");
  return kOk;
}

Status validate_quantize(const QuantizeArgs& q) {
  if (!is_float(q.w.dtype)) return fail("quantize: dtype of w must be f32, f16 or bf16");
  if (q.bits != 4 && q.bits != 8) return fail("quantize: bits must be 4 or 8");
  if (!is_float(q.scales_dtype))
    return fail("quantize: scales_dtype must be f32, f16 or bf16");
  if (negative_size(q.w)) return fail("quantize: w has a negative size");
  if (negative_stride(q.w)) return fail("quantize: strides of w must be non-negative");
  const int64_t n = q.w.rows, k = q.w.cols;
  if (q.bits == 4 && k % 2 != 0) return fail("quantize: int4 needs an even K (w.cols)");
  if (q.group_size < 0) return fail("quantize: group_size must be non-negative");
  if (q.group_size > 0 && k % q.group_size != 0)
    return fail("quantize: group_size must divide K (w.cols)");
  if (null_but_not_empty(q.w)) return fail("quantize: w.data is null but w is not empty");
  if (q.qweight == nullptr && n > 0 && k > 0)
    return fail("quantize: qweight is null but w is not empty");
  const int64_t groups = q.group_size > 0 ? k / q.group_size : 1;
  if (q.scales == nullptr && n > 0 && groups > 0) return fail("quantize: scales is null");
  return kOk;
}

}  // namespace portable_gemm
