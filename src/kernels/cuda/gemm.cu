// cuda::gemm: c = act(a @ b + bias) for f32 (exact SIMT FMA), f16 and bf16 (tensor cores,
// fp32 accumulate). Arbitrary element strides for a, b, c and bias.
#include "cuda/common.cuh"
#include "cuda/simt_gemm.cuh"
#include "cuda/tc_gemm.cuh"
#if defined(PG_WITH_SM90_GEMM)
#include "cuda/sm90_gemm.h"
#endif

namespace portable_gemm {
namespace cuda {

namespace {

using namespace detail;

#if defined(PG_WITH_SM90_GEMM)
// Fewer rows stay on the portable kernel (CUTLASS's 128-row tiles would be mostly empty;
// the crossover was not measured).
constexpr int64_t kSm90MinM = 64;
#endif

template <typename T>
Status gemm_tc(const GemmArgs& args, const Epilogue& ep, cudaStream_t stream) {
  const ConstMatrix& a = args.a;
  const ConstMatrix& b = args.b;
  const T* ad = static_cast<const T*>(a.data);
  const T* bd = static_cast<const T*>(b.data);

  typename TcALoader<T>::Params ap;
  ap.data = ad;
  ap.so = a.row_stride;
  ap.si = a.col_stride;
  ap.olim = ep.M;
  ap.ilim = ep.K;
  ap.fast = a.col_stride == 1 && a.row_stride % 8 == 0 && aligned_to(ad, 16);
  ap.inner_fast = a.col_stride <= a.row_stride;

  // B column-major (e.g. the transpose of an nn.Linear weight): stage B as [n][k].
  const bool b_col = b.row_stride == 1 && b.col_stride != 1;
  if (b_col) {
    typename TcBColLoader<T>::Params bp;
    bp.data = bd;
    bp.so = b.col_stride;  // outer = n
    bp.si = b.row_stride;  // inner = k
    bp.olim = ep.N;
    bp.ilim = ep.K;
    bp.fast = b.row_stride == 1 && b.col_stride % 8 == 0 && aligned_to(bd, 16);
    bp.inner_fast = 1;
    return launch_tc_gemm<T, true, TcBColLoader<T>>(ap, bp, ep, stream);
  }
  typename TcBRowLoader<T>::Params bp;
  bp.data = bd;
  bp.so = b.row_stride;  // outer = k
  bp.si = b.col_stride;  // inner = n
  bp.olim = ep.K;
  bp.ilim = ep.N;
  bp.fast = b.col_stride == 1 && b.row_stride % 8 == 0 && aligned_to(bd, 16);
  bp.inner_fast = b.col_stride <= b.row_stride;
  return launch_tc_gemm<T, false, TcBRowLoader<T>>(ap, bp, ep, stream);
}

#if defined(PG_WITH_SM90_GEMM)
// The Hopper path (CUTLASS, TMA + wgmma) for f16/bf16 on sm_90 when the operands suit TMA:
// unit stride along K for a, along N for c, either unit stride for b, 16-byte aligned
// pointers and leading dimensions. Bias and activation run as a second, in-place pass over
// c. Returns false (nothing launched) when the problem does not qualify.
bool try_sm90(const GemmArgs& args, const Epilogue& ep, cudaStream_t stream, Status* status) {
  if (ep.M < kSm90MinM || ep.N < 64 || ep.K < 64) return false;
  const ConstMatrix& a = args.a;
  const ConstMatrix& b = args.b;
  const Matrix& c = args.c;
  if (a.col_stride != 1 || c.col_stride != 1) return false;
  Sm90Problem p;
  p.dtype = a.dtype;
  p.a = a.data;
  p.lda = a.row_stride;
  p.b = b.data;
  if (b.col_stride == 1) {
    p.ldb = b.row_stride;
    if (p.ldb < ep.N) return false;
  } else if (b.row_stride == 1) {
    p.b_k_major = true;
    p.ldb = b.col_stride;
    if (p.ldb < ep.K) return false;
  } else {
    return false;
  }
  p.d = c.data;
  p.ldd = c.row_stride;
  p.M = ep.M;
  p.N = ep.N;
  p.K = ep.K;
  if (p.lda < ep.K || p.ldd < ep.N || p.lda % 8 || p.ldb % 8 || p.ldd % 8 ||
      !aligned_to(p.a, 16) || !aligned_to(p.b, 16) || !aligned_to(p.d, 16))
    return false;
  if (!current_device_takes_sm90(&p.device, &p.sm_count)) return false;
  const bool ran = p.dtype == DType::f16 ? sm90_gemm_f16(p, stream, status)
                                         : sm90_gemm_bf16(p, stream, status);
  if (ran && status->ok() && (args.bias != nullptr || args.activation != Activation::none)) {
    const ConstMatrix d{c.data, c.rows, c.cols, c.row_stride, c.col_stride, c.dtype};
    *status = bias_act_store(d, 0, args.bias, args.bias_stride, args.activation, c, stream);
  }
  return ran;
}
#endif

Status gemm_f32(const GemmArgs& args, const Epilogue& ep, cudaStream_t stream) {
  SimtStrided a{static_cast<const float*>(args.a.data), args.a.row_stride, args.a.col_stride,
                ep.M, ep.K};
  SimtStrided b{static_cast<const float*>(args.b.data), args.b.row_stride, args.b.col_stride,
                ep.K, ep.N};
  return launch_simt_gemm<SimtBStridedLoader>(a, b, ep, stream);
}

}  // namespace

Status gemm(const GemmArgs& args, void* stream_ptr) {
  const Status v = validate_gemm(args);
  if (!v.ok()) return v;
  Epilogue ep;
  ep.M = args.a.rows;
  ep.K = args.a.cols;
  ep.N = args.b.cols;
  if (ep.M <= 0 || ep.N <= 0) return Status{};  // nothing to write
  ep.c = args.c.data;
  ep.c_rs = args.c.row_stride;
  ep.c_cs = args.c.col_stride;
  ep.bias = args.bias;
  ep.bias_stride = args.bias_stride;
  ep.act = static_cast<int>(args.activation);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // K == 0 runs the same kernels: the k loop is empty and the epilogue writes act(bias).
  switch (args.a.dtype) {
    case DType::f16:
    case DType::bf16: {
#if defined(PG_WITH_SM90_GEMM)
      Status s;
      if (try_sm90(args, ep, stream, &s)) return s;
#endif
      return args.a.dtype == DType::f16 ? gemm_tc<__half>(args, ep, stream)
                                        : gemm_tc<__nv_bfloat16>(args, ep, stream);
    }
    case DType::f32:
      return gemm_f32(args, ep, stream);
    default:
      return Status{static_cast<int32_t>(cudaErrorInvalidValue),
                    "portable_gemm.cuda.gemm: dtype must be f32, f16 or bf16"};
  }
}

}  // namespace cuda
}  // namespace portable_gemm
