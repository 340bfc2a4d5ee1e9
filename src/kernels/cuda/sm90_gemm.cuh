// CUTLASS 3 kernel definitions behind sm90_gemm.h. Included only by the sm90_gemm_*.cu
// files, which are compiled for sm_90a alone (wgmma and TMA exist only there).
#pragma once

#include <atomic>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/sm90_gemm.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace portable_gemm {
namespace cuda {
namespace detail {
namespace sm90 {

using namespace cute;

// One configuration for every shape: 128 x 256 x 64 tiles, two warp groups cooperating on
// each tile (consumer) behind one TMA producer warp, clusters of 2 along M sharing B by TMA
// multicast, a persistent tile scheduler sized to the SM count. The stage count fills the
// shared memory left by the epilogue.
template <typename T, typename LayoutB>
struct Config {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  static constexpr int kAlign = 16 / sizeof(T);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlign,  // no source operand (beta = 0)
      T, cutlass::layout::RowMajor, kAlign,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign,
      T, LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline bool fits_int(int64_t v) { return v >= 0 && v <= 0x7fffffff; }

// GemmUniversalAdapter::initialize sets the kernel's dynamic shared memory limit on every
// call; here it is set once per device (bit d of the kernel's mask: device d has it; devices
// past 63 set it every call). It lowered the host's time per call on 7 of 8 cases, median
// 3.6 us, near the probe's noise per case (bench/GPU_NOTES.md, runs 49b and 49c).
template <typename Kernel>
std::atomic<uint64_t>& smem_set_on_devices() {
  static std::atomic<uint64_t> devices{0};
  return devices;
}

inline uint64_t device_bit(int device) { return device >= 0 && device < 64 ? uint64_t(1) << device : 0; }

template <typename Kernel>
bool dynamic_smem_set(int device) {
  constexpr int kSmem = Kernel::SharedStorageSize;
  if (kSmem < (48 << 10)) return true;
  const uint64_t bit = device_bit(device);
  if (bit != 0 && (smem_set_on_devices<Kernel>().load(std::memory_order_acquire) & bit)) return true;
  if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kSmem) != cudaSuccess)
    return false;  // the error stays for launch_status()
  smem_set_on_devices<Kernel>().fetch_or(bit, std::memory_order_acq_rel);
  return true;
}

// Initialises and launches a CUTLASS device-level GEMM on `stream`. *status gets the CUDA
// error of this library's runtime, or `failure` when CUTLASS refused without one (it reports
// failures as its own enum). `workspace`: get_workspace_size(args) bytes of device memory
// (CUTLASS clears what it needs of it on `stream`), or null when that size is 0.
// GemmUniversalAdapter::initialize + run, with the shared-memory attribute set once (the
// dense kernel's cluster launch still sets its cluster attribute on every call). A failed
// launch forgets the device's bit, so a context reset (which drops the attribute) is met by
// setting it again on the next call.
template <typename Gemm>
void launch(const typename Gemm::Arguments& args, cudaStream_t stream, Status* status,
            const char* failure, void* workspace = nullptr) {
  using Kernel = typename Gemm::GemmKernel;
  cutlass::Status s = Kernel::initialize_workspace(args, workspace, stream, nullptr);
  if (s == cutlass::Status::kSuccess) {
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
    s = dynamic_smem_set<Kernel>(args.hw_info.device_id) ? Gemm::run(params, stream)
                                                         : cutlass::Status::kErrorInternal;
  }
  *status = launch_status();
  if (s != cutlass::Status::kSuccess || !status->ok())
    smem_set_on_devices<Kernel>().fetch_and(~device_bit(args.hw_info.device_id), std::memory_order_acq_rel);
  if (s != cutlass::Status::kSuccess && status->ok())
    *status = Status{static_cast<int32_t>(cudaErrorLaunchFailure), failure};
}

template <typename T, typename LayoutB>
bool run(const Sm90Problem& p, cudaStream_t stream, Status* status) {
  using Gemm = typename Config<T, LayoutB>::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  if (!fits_int(p.M) || !fits_int(p.N) || !fits_int(p.K)) return false;
  // CUTLASS strides are (row, column, batch) of A [M, K] and D [M, N], and B seen as [N, K].
  StrideA sa = make_stride(p.lda, Int<1>{}, int64_t(0));
  StrideB sb{};
  if constexpr (std::is_same_v<LayoutB, cutlass::layout::ColumnMajor>)
    sb = make_stride(p.ldb, Int<1>{}, int64_t(0));  // K contiguous
  else
    sb = make_stride(Int<1>{}, p.ldb, int64_t(0));  // N contiguous
  StrideD sd = make_stride(p.ldd, Int<1>{}, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.M), static_cast<int>(p.N), static_cast<int>(p.K), 1},
      {static_cast<const T*>(p.a), sa, static_cast<const T*>(p.b), sb},
      {{1.f, 0.f}, nullptr, sd, static_cast<T*>(p.d), sd},
      hw};
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) != 0) return false;  // not with this scheduler
  launch<Gemm>(args, stream, status,
               "portable_gemm.cuda.gemm: the sm_90 CUTLASS kernel failed to launch");
  return true;
}

template <typename T>
bool dispatch(const Sm90Problem& p, cudaStream_t stream, Status* status) {
  return p.b_k_major ? run<T, cutlass::layout::ColumnMajor>(p, stream, status)
                     : run<T, cutlass::layout::RowMajor>(p, stream, status);
}

}  // namespace sm90
}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
