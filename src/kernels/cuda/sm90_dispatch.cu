// Host-side choice of the Hopper (sm_90a) CUTLASS kernels: device facts, and the public
// entry points of the fused weight-only GEMM. Compiled for every arch (no CUTLASS header);
// without PG_WITH_SM90_GEMM the entry points answer "not available".
#include <atomic>
#include <cstdlib>

#include "cuda/common.cuh"
#include "cuda/sm90_gemm.h"

namespace portable_gemm {
namespace cuda {

namespace detail {
namespace {

// Compute capability (major * 10 + minor) and SM count of `device`, read once per device.
bool device_facts(int device, int* cc, int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cache[kMaxDevices];  // (cc << 32) | sms; 0 = not read yet
  if (device < 0 || device >= kMaxDevices) return false;
  int64_t v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0, count = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();  // leave no sticky error behind
      return false;
    }
    v = (static_cast<int64_t>(major * 10 + minor) << 32) | count;
    cache[device].store(v, std::memory_order_relaxed);
  }
  *cc = static_cast<int>(v >> 32);
  *sms = static_cast<int>(v & 0xffffffff);
  return true;
}

bool sm90_enabled() {
  // PORTABLE_GEMM_DISABLE_SM90=1: every GPU takes the portable kernels (read once). For
  // compute-sanitizer's initcheck, which does not see TMA stores (bench/GPU_NOTES.md,
  // run 21), and as an escape hatch.
  static const bool enabled = [] {
    const char* e = std::getenv("PORTABLE_GEMM_DISABLE_SM90");
    return !(e && *e && *e != '0');
  }();
  return enabled;
}

}  // namespace

bool current_device_overlaps_launches() {
  int device = 0, cc = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return device_facts(device, &cc, &sms) && cc >= 90;
}

bool current_device_takes_sm90(int* device, int* sms) {
  int cc = 0;
  if (!sm90_enabled()) return false;
  if (cudaGetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return device_facts(*device, &cc, sms) && cc == 90;
}

namespace {

#if defined(PG_WITH_SM90_GEMM)
// The problem for the mixed-input kernel, or false when these arguments do not suit it
// (the checks CUTLASS's can_implement makes after this are on the same facts).
bool mixed_problem(const MixedLinearArgs& a, Sm90MixedProblem* p) {
  const ConstMatrix& x = a.x;
  const QuantizedWeight& w = a.w;
  const Matrix& y = a.y;
  if (x.dtype != DType::f16 && x.dtype != DType::bf16) return false;
  if (validate_mixed_linear(a).code != 0) return false;
  const int64_t M = x.rows, N = w.n, K = w.k;
  if (M <= 0 || N <= 0 || K <= 0 || M > 0x7fffffff || N > 0x7fffffff || K > 0x7fffffff) return false;
  const int64_t gs = w.group_size == 0 ? K : w.group_size;
  if (gs != K && gs % 64 != 0) return false;  // a group spans whole 64-wide k-blocks
  if (x.col_stride != 1 || x.row_stride < K || x.row_stride % 8 || !aligned_to(x.data, 16)) return false;
  if (y.col_stride != 1 || y.row_stride < N || y.row_stride % 8 || !aligned_to(y.data, 16)) return false;
  if (N % 8 || w.row_stride % 16 || !aligned_to(w.data, 16)) return false;
  if (K % (w.bits == 4 ? 32 : 16)) return false;
  p->dtype = x.dtype;
  p->x = x.data;
  p->ldx = x.row_stride;
  p->w = w.data;
  p->w_row_stride_elems = w.bits == 4 ? 2 * w.row_stride : w.row_stride;
  p->bits = w.bits;
  p->group_size = gs;
  p->scales = w.scales;
  p->scales_row_stride = w.scales_row_stride;
  p->scales_dtype = w.scales_dtype;
  p->y = y.data;
  p->ldy = y.row_stride;
  p->M = M;
  p->N = N;
  p->K = K;
  return current_device_takes_sm90(&p->device, &p->sm_count);
}
#endif

}  // namespace
}  // namespace detail

#if defined(PG_WITH_SM90_GEMM)
namespace detail {
namespace {
// The workspace: the transposed scales ([groups, N] in x's dtype; none when they are read
// as stored), then CUTLASS's own from a 256-byte boundary (none without stream-K). Returns
// its size, possibly 0, or -1 when the kernel does not apply.
int64_t mixed_layout(const MixedLinearArgs& args, Sm90MixedProblem* p, int64_t* scales_bytes) {
  if (!mixed_problem(args, p)) return -1;
  // Per-channel scales in x's dtype, contiguous and 16-byte aligned, are read as stored: no
  // transpose launch and no workspace for them (bench/GPU_NOTES.md, run 49). The alignment
  // is TMA's for a global address, and CUTLASS's can_implement does not check it; the
  // second stride (N elements) is a multiple of 16 bytes since N % 8 == 0.
  p->scales_as_stored = p->group_size == p->K && p->scales_dtype == p->dtype &&
                        p->scales_row_stride == 1 && aligned_to(p->scales, 16);
  if (p->scales_as_stored) p->scales_t = const_cast<void*>(p->scales);
  *scales_bytes = p->scales_as_stored ? 0 : ceil_div((p->K / p->group_size) * p->N * 2, 256) * 256;
  const int64_t cutlass_bytes =
      p->dtype == DType::f16 ? sm90_mixed_f16_workspace(*p) : sm90_mixed_bf16_workspace(*p);
  if (cutlass_bytes < 0) return -1;
  p->workspace_bytes = cutlass_bytes;
  return *scales_bytes + ceil_div(cutlass_bytes, 256) * 256;
}
}  // namespace
}  // namespace detail
#endif

int64_t mixed_linear_sm90_workspace(const MixedLinearArgs& args) {
#if defined(PG_WITH_SM90_GEMM)
  detail::Sm90MixedProblem p;
  int64_t scales_bytes = 0;
  return detail::mixed_layout(args, &p, &scales_bytes);
#else
  (void)args;
  return -1;
#endif
}

bool mixed_linear_sm90_preferred(const MixedLinearArgs& args) {
  // Rows 17..64 are ones both paths take. The GEMM pays a fixed ~10 us a call (its
  // launches, a 64-row tile mostly padding, stream-K's fix-up, the pipeline's fill) and then
  // streams the weight faster than the GEMV, which dequantises every weight once per slice
  // of x's rows: the size rule in sm90_gemm_outruns_gemv (kernels.h).
  if (!mixed_linear_small_m(args)) return false;
  if (!sm90_gemm_outruns_gemv(args.x.rows, detail::quantised_bytes(args.w), args.w.bits, args.w.group_size))
    return false;
  return mixed_linear_sm90_workspace(args) >= 0;
}

Status mixed_linear_sm90(const MixedLinearArgs& args, void* workspace, void* stream_ptr) {
#if defined(PG_WITH_SM90_GEMM)
  detail::Sm90MixedProblem p;
  int64_t scales_bytes = 0;
  const int64_t need = detail::mixed_layout(args, &p, &scales_bytes);
  if (need < 0 || !detail::aligned_to(workspace, 256) || (need > 0 && workspace == nullptr))
    return Status{static_cast<int32_t>(cudaErrorInvalidValue),
                  "portable_gemm.cuda.mixed_linear_sm90: arguments not supported (check "
                  "mixed_linear_sm90_workspace first; the workspace must be 256-byte aligned, and "
                  "non-null when that size is not 0)"};
  if (!p.scales_as_stored) p.scales_t = workspace;
  p.workspace = p.workspace_bytes > 0 ? static_cast<char*>(workspace) + scales_bytes : nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  Status s;
  const bool ran = p.dtype == DType::f16 ? detail::sm90_mixed_f16(p, stream, &s)
                                         : detail::sm90_mixed_bf16(p, stream, &s);
  if (!ran)
    return Status{static_cast<int32_t>(cudaErrorNotSupported),
                  "portable_gemm.cuda.mixed_linear_sm90: CUTLASS cannot implement this problem"};
  if (s.ok() && (args.bias != nullptr || args.activation != Activation::none)) {
    const Matrix& y = args.y;
    s = bias_act_store(ConstMatrix{y.data, y.rows, y.cols, y.row_stride, y.col_stride, y.dtype}, 0,
                       args.bias, args.bias_stride, args.activation, y, stream_ptr);
  }
  return s;
#else
  (void)args;
  (void)workspace;
  (void)stream_ptr;
  return Status{static_cast<int32_t>(cudaErrorNotSupported),
                "portable_gemm.cuda.mixed_linear_sm90: built without the sm_90 CUTLASS kernels"};
#endif
}

}  // namespace cuda
}  // namespace portable_gemm
