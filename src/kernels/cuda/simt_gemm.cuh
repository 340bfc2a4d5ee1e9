// Exact-fp32 (SIMT FMA, no TF32) tiled GEMM main loop, shared by gemm.cu (strided f32 B)
// and mixed_linear.cu (f32 activations, B dequantised from int8 / int4).
//
// Block tile 64 x 64 x 16, 256 threads as 16 x 16; each thread computes 4 x 4 outputs at
// rows ty + 16 i, columns tx + 16 j. Shared tiles As[k][m] and Bs[k][n], double-buffered
// with register staging (the next tile's global reads are issued before the FMAs).
// A B loader provides load(k0) (global -> registers) and store(Bs) (registers -> smem).
#pragma once

#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

namespace simt {
constexpr int BM = 64, BN = 64, BK = 16;
constexpr int THREADS = 256;
constexpr int LDS = 64 + 4;  // smem row pitch of As[k][m] / Bs[k][n]
}  // namespace simt

// A strided M x K (or K x N) f32 matrix. For the B role: element (k, n) at
// data[k * rs + n * cs].
struct SimtStrided {
  const float* data;
  int64_t rs, cs;
  int64_t rows, cols;
};

// Loads the A tile (64 m x 16 k) into As[k][m].
struct SimtALoader {
  SimtStrided p;
  int64_t m0;
  float regs[4];
  __device__ __forceinline__ void coords(int j, int& m, int& k) const {
    const int e = threadIdx.x + j * simt::THREADS;
    if (p.cs <= p.rs) {  // k-fastest (row-major-ish A)
      m = e / simt::BK;
      k = e % simt::BK;
    } else {  // m-fastest (column-major-ish A)
      m = e % simt::BM;
      k = e / simt::BM;
    }
  }
  __device__ __forceinline__ void load(int64_t k0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int m, k;
      coords(j, m, k);
      const int64_t gm = m0 + m, gk = k0 + k;
      regs[j] = (gm < p.rows && gk < p.cols) ? p.data[gm * p.rs + gk * p.cs] : 0.f;
    }
  }
  __device__ __forceinline__ void store(float* As) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int m, k;
      coords(j, m, k);
      As[k * simt::LDS + m] = regs[j];
    }
  }
};

// Loads the B tile (16 k x 64 n) of a strided K x N matrix into Bs[k][n].
struct SimtBStridedLoader {
  using Params = SimtStrided;
  SimtStrided p;
  int64_t n0;
  float regs[4];
  __device__ __forceinline__ SimtBStridedLoader(const Params& p_, int64_t n0_) : p(p_), n0(n0_) {}
  __device__ __forceinline__ void coords(int j, int& k, int& n) const {
    const int e = threadIdx.x + j * simt::THREADS;
    if (p.cs <= p.rs) {  // n-fastest
      k = e / simt::BN;
      n = e % simt::BN;
    } else {  // k-fastest
      k = e % simt::BK;
      n = e / simt::BK;
    }
  }
  __device__ __forceinline__ void load(int64_t k0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int k, n;
      coords(j, k, n);
      const int64_t gk = k0 + k, gn = n0 + n;
      regs[j] = (gk < p.rows && gn < p.cols) ? p.data[gk * p.rs + gn * p.cs] : 0.f;
    }
  }
  __device__ __forceinline__ void store(float* Bs) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int k, n;
      coords(j, k, n);
      Bs[k * simt::LDS + n] = regs[j];
    }
  }
};

template <class BLoader>
__global__ void __launch_bounds__(simt::THREADS)
    simt_gemm_kernel(SimtStrided a, typename BLoader::Params bp, Epilogue ep) {
  __shared__ __align__(16) float As[2][simt::BK * simt::LDS];
  __shared__ __align__(16) float Bs[2][simt::BK * simt::LDS];

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t ktiles = ceil_div(ep.K, simt::BK);
  const int64_t mtiles = ceil_div(ep.M, simt::BM);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * simt::BN;

  for (int64_t mt = blockIdx.y; mt < mtiles; mt += gridDim.y) {
    const int64_t m0 = mt * simt::BM;
    SimtALoader la{a, m0, {}};
    BLoader lb(bp, n0);

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    if (ktiles > 0) {
      la.load(0);
      lb.load(0);
      la.store(As[0]);
      lb.store(Bs[0]);
      __syncthreads();
    }
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      const int cur = static_cast<int>(kt & 1);
      const bool more = kt + 1 < ktiles;
      if (more) {
        la.load((kt + 1) * simt::BK);
        lb.load((kt + 1) * simt::BK);
      }
#pragma unroll
      for (int k = 0; k < simt::BK; ++k) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = As[cur][k * simt::LDS + ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = Bs[cur][k * simt::LDS + tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      if (more) {
        // The other buffer was last read in iteration kt-1, before its closing barrier.
        la.store(As[cur ^ 1]);
        lb.store(Bs[cur ^ 1]);
      }
      __syncthreads();
    }

    float* const c = static_cast<float*>(ep.c);
    const float* const bias = static_cast<const float*>(ep.bias);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t gn = n0 + tx + 16 * j;
      if (gn >= ep.N) continue;
      const float bv = bias ? bias[gn * ep.bias_stride] : 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t gm = m0 + ty + 16 * i;
        if (gm < ep.M) c[gm * ep.c_rs + gn * ep.c_cs] = apply_act(acc[i][j] + bv, ep.act);
      }
    }
    // No barrier needed before the next m tile: the last loop iteration ended with one
    // and the epilogue touches no shared memory.
  }
}

template <class BLoader>
inline Status launch_simt_gemm(const SimtStrided& a, const typename BLoader::Params& bp,
                               const Epilogue& ep, cudaStream_t stream) {
  const int64_t ntiles = ceil_div(ep.N, simt::BN), mtiles = ceil_div(ep.M, simt::BM);
  if (ntiles > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned>(ntiles),
                  static_cast<unsigned>(mtiles < 65535 ? mtiles : 65535));
  simt_gemm_kernel<BLoader><<<grid, simt::THREADS, 0, stream>>>(a, bp, ep);
  return launch_status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
