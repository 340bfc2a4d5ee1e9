// CUTLASS 3 mixed-input GEMM for weight-only linears on sm_90a: the int8 / int4 weight is
// loaded by TMA as is, converted and scaled in registers between shared memory and wgmma.
// Included only by the sm90_mixed_*.cu files (compiled for sm_90a alone).
//
// The problem is run transposed, y^T [N, M] = W [N, K] . x^T: CUTLASS converts only its A
// operand, and W as A is K-major exactly as stored; x^T is K-major B; y^T is column-major
// D, i.e. y row-major. Scales must be "MN-major" ([groups, N], N contiguous) in the MMA
// type: the caller transposes them into a workspace first (transpose_scales below), except
// per-channel scales in x's dtype, contiguous: [N] is already [1, N] (scales_as_stored).
#pragma once

#include "cuda/sm90_gemm.cuh"  // the CUTLASS headers and launch()

namespace portable_gemm {
namespace cuda {
namespace detail {
namespace sm90 {

using namespace cute;

// 128 weight rows x TileM rows of x x 64 tiles, two consumer warp groups, no cluster. TileM is
// 64, 128 or 256 (kernel_choice below): a wider tile converts each weight element fewer
// times (0.91-1.00x bf16 cuBLAS at M >= 1024 for 256 against 0.65-0.86x for 128; run 20 of
// bench/GPU_NOTES.md), a narrower one leaves fewer idle rows at small M.
// With few rows of x there are only N / 128 tiles (64 for N = 8192: half of the H200's 132
// SMs idle while each tile streams 128 whole weight rows). When the tiles fill at most half
// of the SMs, the kernel runs under CUTLASS's stream-K scheduler (StreamK = true): it splits
// the tiles' K loops over the SMs and adds the fp32 partials through a workspace in K order
// (deterministic). From 96 tiles up that was slower than the plain persistent scheduler
// (bench/GPU_NOTES.md, run 27), which the other instantiation keeps.
template <typename T, typename Q, int TileM, bool StreamK>
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
  using Scheduler = std::conditional_t<StreamK, cutlass::gemm::StreamKScheduler,
                                       cutlass::gemm::PersistentScheduler>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// scales [N, groups] (any float dtype, row stride srs) -> out [groups, N] in T, through
// 32 x 32 tiles in shared memory so that both the reads (along groups) and the writes
// (along N) are coalesced: 3.9 us for 8192 x 64 on the H200, against 4.6 us with one
// thread per element reading across rows (bench/GPU_NOTES.md, run 27).
constexpr int kTransposeTile = 32, kTransposeRows = 8;

template <typename T>
__global__ void transpose_scales_kernel(const void* scales, int sdt, int64_t srs, int64_t n,
                                        int64_t groups, T* out) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;  // rows of N
  for (int64_t g0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile; g0 < groups;
       g0 += static_cast<int64_t>(gridDim.y) * kTransposeTile) {
    for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
      const int64_t r = r0 + i, g = g0 + threadIdx.x;
      if (r < n && g < groups) tile[i][threadIdx.x] = load_f32(scales, sdt, r * srs + g);
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
      const int64_t g = g0 + i, r = r0 + threadIdx.x;
      if (r < n && g < groups) out[g * n + r] = from_f32<T>(tile[threadIdx.x][i]);
    }
    __syncthreads();
  }
}

// T: the CUDA type of x, y and the transposed scales (__half / __nv_bfloat16); TE: the same
// type as CUTLASS names it; Q: int8_t or cutlass::int4b_t.
template <typename T, typename TE, typename Q, int TileM, bool StreamK>
struct MixedRun {
  static_assert(sizeof(TE) == sizeof(T), "T and TE must be the same 16-bit type");
  using Gemm = typename MixedConfig<TE, Q, TileM, StreamK>::Gemm;
  using Mainloop = typename MixedConfig<TE, Q, TileM, StreamK>::Mainloop;

  static typename Gemm::Arguments arguments(const Sm90MixedProblem& p) {
    using ElemA = typename Mainloop::ElementA;
    using ElemB = typename Mainloop::ElementB;
    using ElemS = typename Mainloop::ElementScale;
    using ElemD = typename Gemm::GemmKernel::CollectiveEpilogue::ElementD;
    // Strides are in elements of each operand (int4: nibbles).
    typename Gemm::GemmKernel::StrideA sa = make_stride(p.w_row_stride_elems, Int<1>{}, int64_t(0));
    typename Gemm::GemmKernel::StrideB sb = make_stride(p.ldx, Int<1>{}, int64_t(0));
    typename Gemm::GemmKernel::StrideD sd = make_stride(Int<1>{}, p.ldy, int64_t(0));
    typename Mainloop::StrideScale ss = make_stride(Int<1>{}, p.N, int64_t(0));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count;
    typename Gemm::Arguments a{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.N), static_cast<int>(p.M), static_cast<int>(p.K), 1},
        {static_cast<const ElemA*>(p.w), sa, static_cast<const ElemB*>(p.x), sb,
         static_cast<const ElemS*>(p.scales_t), ss, static_cast<int>(p.group_size)},
        {{1.f, 0.f}, nullptr, sd, static_cast<ElemD*>(p.y), sd},
        hw};
    return a;
  }

  static int64_t workspace(const Sm90MixedProblem& p) {
    // The transposed scales' place in the workspace is not known yet (scales read as stored
    // are already set); can_implement only checks that the pointer is set (scale mode), so
    // the weight's pointer stands in.
    Sm90MixedProblem q = p;
    if (q.scales_t == nullptr) q.scales_t = const_cast<void*>(q.w);
    const auto args = arguments(q);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -1;
    return static_cast<int64_t>(Gemm::get_workspace_size(args));
  }

  static bool run(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
    const auto args = arguments(p);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
    const auto need = static_cast<int64_t>(Gemm::get_workspace_size(args));
    if (need > p.workspace_bytes || (need > 0 && p.workspace == nullptr)) return false;
    if (!p.scales_as_stored) {
      const int64_t groups = p.K / p.group_size;
      const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kTransposeTile)),
                      static_cast<unsigned>(std::min<int64_t>(ceil_div(groups, kTransposeTile), 65535)));
      transpose_scales_kernel<T><<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(
          p.scales, static_cast<int>(p.scales_dtype), p.scales_row_stride, p.N, groups,
          static_cast<T*>(p.scales_t));
    }
    launch<Gemm>(args, stream, status,
                 "portable_gemm.cuda.mixed_linear: the sm_90 CUTLASS kernel failed to launch",
                 need > 0 ? p.workspace : nullptr);
    return true;
  }
};

// The kernel for p: the tile's width in rows of x, and whether stream-K schedules it
// (bench/GPU_NOTES.md, run 48: each width against the others on the issue's shapes, graph
// replay):
// - up to 64 rows, 64 wide: 0.73-0.95x the 128-wide tile's time at M = 48 and 64 on every
//   shape (half of a 128-wide tile's MMAs would multiply the padding);
// - up to 128 rows, 128 wide: the 64-wide tile converts each weight twice and lost there
//   (1.13-1.70x), except at 4096^2;
// - 129..256 rows, 256 wide where its N / 128 tiles give at least a quarter of the SMs one
//   (N > 4096 on the H200): 0.77-0.89x at N = 12288 and 28672 and at (28672, 8192),
//   0.97-1.03x at 8192^2 and N = 22016; with fewer tiles (N = 4096: 32 tiles split over 132
//   SMs by stream-K) it lost (1.02-1.27x), so 128 wide there;
// - above 256 rows, 256 wide (run 20).
// Stream-K when the tiles fill at most half of the SMs, at up to 256 rows (run 27).
struct MixedChoice {
  int tile;
  bool stream_k;
};
inline MixedChoice kernel_choice(const Sm90MixedProblem& p) {
  const int64_t row_tiles = ceil_div(p.N, 128);
  int tile = 256;
  if (p.M <= 64)
    tile = 64;
  else if (p.M <= 128 || (p.M <= 256 && 4 * row_tiles < p.sm_count))
    tile = 128;
  const int64_t tiles = row_tiles * ceil_div(p.M, tile);
  return {tile, p.M <= 256 && 2 * tiles <= p.sm_count};
}

// f(MixedRun<T, TE, Q, tile, stream_k>{}) for kernel_choice(p): the six kernels of a (T, Q).
template <typename T, typename TE, typename Q, typename F>
auto with_kernel(const Sm90MixedProblem& p, F&& f) {
  const MixedChoice c = kernel_choice(p);
  if (c.tile == 64)
    return c.stream_k ? f(MixedRun<T, TE, Q, 64, true>{}) : f(MixedRun<T, TE, Q, 64, false>{});
  if (c.tile == 128)
    return c.stream_k ? f(MixedRun<T, TE, Q, 128, true>{}) : f(MixedRun<T, TE, Q, 128, false>{});
  return c.stream_k ? f(MixedRun<T, TE, Q, 256, true>{}) : f(MixedRun<T, TE, Q, 256, false>{});
}

template <typename T, typename TE, typename Q>
bool dispatch_tile(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  return with_kernel<T, TE, Q>(p, [&](auto kernel) { return kernel.run(p, stream, status); });
}

template <typename T, typename TE>
bool dispatch_mixed(const Sm90MixedProblem& p, cudaStream_t stream, Status* status) {
  return p.bits == 8 ? dispatch_tile<T, TE, int8_t>(p, stream, status)
                     : dispatch_tile<T, TE, cutlass::int4b_t>(p, stream, status);
}

// The CUTLASS workspace dispatch_mixed needs for p (the same choice of kernel).
template <typename T, typename TE, typename Q>
int64_t workspace_tile(const Sm90MixedProblem& p) {
  return with_kernel<T, TE, Q>(p, [&](auto kernel) { return kernel.workspace(p); });
}

template <typename T, typename TE>
int64_t workspace_mixed(const Sm90MixedProblem& p) {
  return p.bits == 8 ? workspace_tile<T, TE, int8_t>(p) : workspace_tile<T, TE, cutlass::int4b_t>(p);
}

}  // namespace sm90
}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
