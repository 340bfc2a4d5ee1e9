// cuda::quantize: symmetric per-channel / group-wise int8 or int4 quantisation of an N x K
// weight (f32 / f16 / bf16, arbitrary strides). Two kernels on the same stream:
//   1. scales: one warp per (row, group): absmax in fp32 (NaN if any weight is), scale =
//      absmax / qmax rounded to scales_dtype and stored;
//   2. values: one thread per output byte, reading back the stored (rounded) scale, so that
//      q = rint(w / stored_scale) uses exactly the scale a consumer will multiply by. An
//      int4 byte may straddle two groups (odd group sizes), which this split handles for free.
#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

struct QuantizeParams {
  const void* w;
  int w_dt;
  int64_t w_rs, w_cs;
  int64_t N, K;
  int64_t gs;       // effective group size (K when per channel)
  int64_t ngroups;  // K / gs
  int bits;
  void* qweight;
  void* scales;
  int s_dt;
};

constexpr int QZ_THREADS = 256;
constexpr int64_t QZ_MAX_BLOCKS = int64_t(1) << 20;  // grid-stride beyond this

__global__ void __launch_bounds__(QZ_THREADS) quantize_scales_kernel(QuantizeParams p) {
  const float qmax = static_cast<float>((1 << (p.bits - 1)) - 1);
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = QZ_THREADS / 32;
  const int64_t total = p.N * p.ngroups;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
       gi < total; gi += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const int64_t n = gi / p.ngroups, g = gi - n * p.ngroups;
    const int64_t kbeg = g * p.gs, kend = kbeg + p.gs;
    // fmaxf drops NaNs; a NaN weight makes the group's scale NaN instead (as the CPU kernel
    // and w.abs().amax() do), so a damaged weight shows in the outputs it reaches.
    float amax = 0.f;
    bool nan = false;
    for (int64_t k = kbeg + lane; k < kend; k += 32) {
      const float a = fabsf(load_f32(p.w, p.w_dt, n * p.w_rs + k * p.w_cs));
      amax = fmaxf(amax, a);
      nan |= a != a;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) store_f32(p.scales, p.s_dt, gi, nan ? __int_as_float(0x7fc00000) : amax / qmax);
  }
}

__device__ __forceinline__ int quantize_one(float v, float s, int bits) {
  if (s == 0.f) return 0;  // zero group (or a scale that rounded to 0 in scales_dtype)
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  const float r = rintf(v / s);  // true division: exact multiples of s round-trip exactly
  if (r != r) return 0;           // a NaN group's scale, or Inf / Inf: no integer (as on the CPU)
  return static_cast<int>(fminf(fmaxf(r, -qmax - 1.f), qmax));
}

__global__ void __launch_bounds__(QZ_THREADS) quantize_values_kernel(QuantizeParams p) {
  const int64_t cols = p.bits == 8 ? p.K : p.K / 2;  // output bytes per row
  const int64_t total = p.N * cols;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * QZ_THREADS + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * QZ_THREADS) {
    const int64_t n = e / cols, jc = e - n * cols;
    if (p.bits == 8) {
      const int64_t k = jc;
      const float s = load_f32(p.scales, p.s_dt, n * p.ngroups + k / p.gs);
      const float v = load_f32(p.w, p.w_dt, n * p.w_rs + k * p.w_cs);
      static_cast<int8_t*>(p.qweight)[e] = static_cast<int8_t>(quantize_one(v, s, 8));
    } else {
      const int64_t k0 = 2 * jc, k1 = k0 + 1;
      const float s0 = load_f32(p.scales, p.s_dt, n * p.ngroups + k0 / p.gs);
      const float s1 = load_f32(p.scales, p.s_dt, n * p.ngroups + k1 / p.gs);
      const int q0 = quantize_one(load_f32(p.w, p.w_dt, n * p.w_rs + k0 * p.w_cs), s0, 4);
      const int q1 = quantize_one(load_f32(p.w, p.w_dt, n * p.w_rs + k1 * p.w_cs), s1, 4);
      static_cast<uint8_t*>(p.qweight)[e] =
          static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    }
  }
}

}  // namespace detail

Status quantize(const QuantizeArgs& args, void* stream_ptr) {
  using namespace detail;
  const Status v = validate_quantize(args);
  if (!v.ok()) return v;
  const int64_t N = args.w.rows, K = args.w.cols;
  if (args.bits != 8 && args.bits != 4)
    return Status{static_cast<int32_t>(cudaErrorInvalidValue),
                  "portable_gemm.cuda.quantize: bits must be 4 or 8"};
  if (N <= 0 || K <= 0) return Status{};  // no groups, no bytes: nothing to write
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  QuantizeParams p;
  p.w = args.w.data;
  p.w_dt = static_cast<int>(args.w.dtype);
  p.w_rs = args.w.row_stride;
  p.w_cs = args.w.col_stride;
  p.N = N;
  p.K = K;
  p.gs = args.group_size > 0 ? args.group_size : K;
  p.ngroups = K / p.gs;
  p.bits = args.bits;
  p.qweight = args.qweight;
  p.scales = args.scales;
  p.s_dt = static_cast<int>(args.scales_dtype);

  const int64_t groups = N * p.ngroups;
  int64_t blocks = ceil_div(groups, QZ_THREADS / 32);
  quantize_scales_kernel<<<static_cast<unsigned>(blocks < QZ_MAX_BLOCKS ? blocks : QZ_MAX_BLOCKS),
                           QZ_THREADS, 0, stream>>>(p);
  const Status s1 = launch_status();
  if (!s1.ok()) return s1;

  const int64_t bytes = N * (args.bits == 8 ? K : K / 2);
  blocks = ceil_div(bytes, QZ_THREADS);
  if (blocks > 0) {
    quantize_values_kernel<<<static_cast<unsigned>(blocks < QZ_MAX_BLOCKS ? blocks : QZ_MAX_BLOCKS),
                             QZ_THREADS, 0, stream>>>(p);
  }
  return launch_status();
}

}  // namespace cuda
}  // namespace portable_gemm
