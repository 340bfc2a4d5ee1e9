// CUTLASS 3 mixed-input GEMM for weight-only linears on sm_90a: the int8 / int4 weight is
// loaded by TMA as is, converted and scaled in registers between shared memory and wgmma.
// Included only by the sm90_mixed_*.cu files (compiled for sm_90a alone).
//
// The problem is run transposed, y^T [N, M] = W [N, K] . x^T: CUTLASS converts only its A
// operand, and W as A is K-major exactly as stored; x^T is K-major B; y^T is column-major
// D, i.e. y row-major. Scales must be "MN-major" ([groups, N], N contiguous) in the MMA
// type: the caller transposes them into a workspace first (transpose_scales below).
#pragma once

#include "cuda/sm90_gemm.cuh"  // the CUTLASS headers and launch()

namespace portable_gemm {
namespace cuda {
namespace detail {
namespace sm90 {

using namespace cute;

// 128 weight rows x TileM rows of x x 64 tiles, two consumer warp groups, no cluster. TileM =
// 128 for up to 256 rows of x, 256 above: the wider tile converts each weight element half
// as often (0.91-1.00x bf16 cuBLAS at M >= 1024 against 0.65-0.86x; run 20 of
// bench/GPU_NOTES.md), the narrower one leaves fewer idle rows at small M.
template <typename T, typename Q, int TileM>
struct MixedConfig {
  using TileShape = Shape<_128, Int<TileM>, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignQ = 128 / cutlass::sizeof_bits<Q>::value;
  static constexpr int kAlignT = 128 / cutlass::sizeof_bits<T>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::ColumnMajor, kAlignT,  // y^T column-major = y row-major
      T, cutlass::layout::ColumnMajor, kAlignT,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<Q, T>, cutlass::layout::RowMajor, kAlignQ,  // W [N, K] with its scales
      T, cutlass::layout::ColumnMajor, kAlignT,                // x^T: K contiguous
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// scales [N, groups] (any float dtype, row stride srs) -> out [groups, N] in T.
template <typename T>
__global__ void transpose_scales_kernel(const void* scales, int sdt, int64_t srs, int64_t n,
                                        int64_t groups, T* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * groups) return;
  const int64_t g = i / n, r = i - g * n;
  out[i] = from_f32<T>(load_f32(scales, sdt, r * srs + g));
}

// T: the CUDA type of x, y and the transposed scales (__half / __nv_bfloat16); TE: the same
// type as CUTLASS names it; Q: int8_t or cutlass::int4b_t.
template <typename T, typename TE, typename Q, int TileM>
bool run_mixed(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  static_assert(sizeof(TE) == sizeof(T), "T and TE must be the same 16-bit type");
  using Gemm = typename MixedConfig<TE, Q, TileM>::Gemm;
  using Mainloop = typename MixedConfig<TE, Q, TileM>::Mainloop;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using StrideS = typename Mainloop::StrideScale;

  const int64_t groups = p.K / p.group_size;
  // Strides are in elements of each operand (int4: nibbles).
  StrideA sa = make_stride(p.w_row_stride_elems, Int<1>{}, int64_t(0));
  StrideB sb = make_stride(p.ldx, Int<1>{}, int64_t(0));
  StrideD sd = make_stride(Int<1>{}, p.ldy, int64_t(0));
  StrideS ss = make_stride(Int<1>{}, p.N, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  using ElemA = typename Gemm::GemmKernel::CollectiveMainloop::ElementA;
  using ElemB = typename Gemm::GemmKernel::CollectiveMainloop::ElementB;
  using ElemS = typename Mainloop::ElementScale;
  using ElemD = typename Gemm::GemmKernel::CollectiveEpilogue::ElementD;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.N), static_cast<int>(p.M), static_cast<int>(p.K), 1},
      {static_cast<const ElemA*>(p.w), sa, static_cast<const ElemB*>(p.x), sb,
       static_cast<const ElemS*>(p.scales_t), ss, static_cast<int>(p.group_size)},
      {{1.f, 0.f}, nullptr, sd, static_cast<ElemD*>(p.y), sd},
      hw};
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) != 0) return false;

  const int64_t total = p.N * groups;
  transpose_scales_kernel<T><<<static_cast<unsigned>(ceil_div(total, 256)), 256, 0, stream>>>(
      p.scales, static_cast<int>(p.scales_dtype), p.scales_row_stride, p.N, groups,
      static_cast<T*>(p.scales_t));
  launch<Gemm>(args, stream, status,
               "portable_gemm.cuda.mixed_linear: the sm_90 CUTLASS kernel failed to launch");
  return true;
}

template <typename T, typename TE, typename Q>
bool dispatch_tile(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  return p.M <= 256 ? run_mixed<T, TE, Q, 128>(p, stream, status)
                    : run_mixed<T, TE, Q, 256>(p, stream, status);
}

template <typename T, typename TE>
bool dispatch_mixed(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  return p.bits == 8 ? dispatch_tile<T, TE, int8_t>(p, stream, status)
                     : dispatch_tile<T, TE, cutlass::int4b_t>(p, stream, status);
}

}  // namespace sm90
}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
