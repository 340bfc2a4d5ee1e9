// Symmetric weight quantisation (the inverse of mixed_linear's dequantisation).
//
// q is computed by dividing by the scale *as stored* (after rounding to scales_dtype),
// not by the fp32 absmax / qmax and not by multiplying with a reciprocal: then a weight
// that is exactly q * stored_scale comes back exactly, and quantize(dequant(q)) == q.
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/common.h"

namespace portable_gemm {
namespace cpu {

namespace {

struct QuantJob {
  const QuantizeArgs* args;
  int64_t k, groups, group_len;
  float qmin, qmax;
  mutable std::atomic<bool> failed{false};
};

void quantize_rows_impl(const QuantJob& job, int64_t begin, int64_t end);

void quantize_rows(void* ctx, int64_t begin, int64_t end) {
  const QuantJob& job = *static_cast<const QuantJob*>(ctx);
  guarded(job.failed, [&] { quantize_rows_impl(job, begin, end); });
}

void quantize_rows_impl(const QuantJob& job, int64_t begin, int64_t end) {
  const QuantizeArgs& a = *job.args;
  const int64_t K = job.k;
  const int64_t es = int64_t(dtype_size(a.w.dtype));
  float* row = scratch(5, size_t(K));
  for (int64_t n = begin; n < end; ++n) {
    convert_to_f32(static_cast<const char*>(a.w.data) + n * a.w.row_stride * es, a.w.col_stride,
                   a.w.dtype, K, row);
    // Pass 1, per group: the scale, then q in place of the weights (as floats).
    for (int64_t g = 0; g < job.groups; ++g) {
      float* v = row + g * job.group_len;
      // A NaN weight makes the group's scale NaN (as w.abs().amax() would): a damaged
      // checkpoint shows in every output it reaches instead of passing as a zero weight.
      float absmax = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < job.group_len; ++i) {
        absmax = std::max(absmax, std::fabs(v[i]));
        nan |= v[i] != v[i];
      }
      if (nan) absmax = std::numeric_limits<float>::quiet_NaN();
      // Round the scale to its storage type first: q must be computed against the value
      // a reader will multiply by.
      const int64_t scale_index = a.group_size > 0 ? n * job.groups + g : n;
      store_f32(a.scales, scale_index, a.scales_dtype, absmax / job.qmax);
      const float scale = load_f32(a.scales, scale_index, a.scales_dtype);
      if (scale == 0.f) {
        for (int64_t i = 0; i < job.group_len; ++i) v[i] = 0.f;
        continue;
      }
      const float lo = job.qmin, hi = job.qmax;
      for (int64_t i = 0; i < job.group_len; ++i) {
        // Clamping before rounding gives the same integer (the bounds are integers) and
        // keeps |r| small enough for the round-half-even trick: adding 1.5 * 2^23 leaves
        // no fraction bits, so the FPU's ties-to-even rounding does the work (this needs
        // IEEE float semantics, i.e. no -ffast-math, like the fp16 conversions).
        float r = v[i] / scale;
        r = r < lo ? lo : r;
        r = r > hi ? hi : r;
        v[i] = (r + 12582912.f) - 12582912.f;  // NaN stays NaN
      }
    }
    // Pass 2: store; a NaN quotient (a NaN group's, or Inf / Inf) has no integer: 0.
    if (a.bits == 8) {
      int8_t* dst = static_cast<int8_t*>(a.qweight) + n * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = row[k] == row[k] ? static_cast<int8_t>(row[k]) : 0;
    } else {
      uint8_t* dst = static_cast<uint8_t*>(a.qweight) + n * (K / 2);
      for (int64_t j = 0; j < K / 2; ++j) {
        const float r0 = row[2 * j], r1 = row[2 * j + 1];
        const int q0 = r0 == r0 ? static_cast<int>(r0) : 0;
        const int q1 = r1 == r1 ? static_cast<int>(r1) : 0;
        dst[j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
      }
    }
  }
}

}  // namespace

Status quantize(const QuantizeArgs& args, const Executor& exec) {
  const ScratchUse use;
  Status st = validate_quantize(args);
  if (!st.ok()) return st;
  const int64_t n = args.w.rows, k = args.w.cols;
  if (n == 0) return st;
  QuantJob job;
  job.args = &args;
  job.k = k;
  job.group_len = args.group_size > 0 ? args.group_size : k;
  job.groups = args.group_size > 0 ? k / args.group_size : 1;
  job.qmax = args.bits == 8 ? 127.f : 7.f;
  job.qmin = -job.qmax - 1.f;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  if (exec.parallel_for != nullptr && n > grain)
    run_tasks(exec, 0, n, grain, quantize_rows, &job);
  else
    quantize_rows(&job, 0, n);
  return job.failed.load() ? Status{2, "quantize: out of memory (scratch buffer)"} : st;
}

}  // namespace cpu
}  // namespace portable_gemm
