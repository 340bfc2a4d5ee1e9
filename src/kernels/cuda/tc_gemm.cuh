// Tensor-core (mma.sync m16n8k16 + ldmatrix, fp32 accumulate) tiled GEMM main loop for
// f16 / bf16, shared by gemm.cu (strided B) and mixed_linear.cu (B dequantised from int8 /
// int4 on the fly).
//
// Block tile 128 x 128 x 32, 256 threads = 8 warps as 2 (M) x 4 (N), warp tile 64 x 32
// (4 x 4 m16n8k16 tiles), 3-stage shared-memory pipeline.
//   A is staged as [m][k] (ldmatrix).
//   B is staged as [k][n] (B_COL = false, ldmatrix.trans) or as [n][k] (B_COL = true,
//   ldmatrix), so that either layout of B can be copied without a transpose.
// A tile loader fills a pipeline slot in two steps: begin(p, slot, k0) issues the global
// reads (cp.async straight into the slot, or plain loads + shared stores) and
// end(p, slot, k0) finishes what begin left in registers (the dequantising loader converts
// there);
// end() runs after the MMAs of the current stage, which hides the global-load latency.
#pragma once

#include "cuda/common.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

namespace tc {
constexpr int BM = 128, BN = 128, BK = 32;
constexpr int STAGES = 3;
constexpr int THREADS = 256;
constexpr int PAD = 8;  // elements of padding per smem row (keeps 32-byte fragment alignment)
}  // namespace tc

// Loads an OUTER x INNER tile of a strided matrix (element (o, i) at
// data[o * so + i * si], valid while o < olim and i < ilim; zero outside) into shared
// memory laid out [OUTER][INNER + PAD]. K_INNER says which tile coordinate moves with k.
// fast: si == 1, so % 8 == 0 and data 16-byte aligned -> 16-byte cp.async (zero-filled
// past ilim). Otherwise element-wise loads, inner-index-fastest across threads when
// inner_fast (si <= so), outer-fastest otherwise (keeps either layout coalesced).
template <typename T, int OUTER, int INNER, bool K_INNER>
struct StridedTileLoader {
  static_assert(sizeof(T) == 2, "tensor-core tiles hold 16-bit elements");
  struct Params {
    const T* data;
    int64_t so, si, olim, ilim;
    int fast, inner_fast;
  };
  static constexpr int LD = INNER + tc::PAD;
  static constexpr int STAGE_ELEMS = OUTER * LD;
  static constexpr int PER = OUTER * INNER / tc::THREADS;
  static constexpr int CHUNKS = OUTER * INNER / 8 / tc::THREADS;
  static_assert(PER * tc::THREADS == OUTER * INNER, "tile / threads mismatch");
  static_assert(CHUNKS * tc::THREADS * 8 == OUTER * INNER, "tile / chunks mismatch");
  static_assert(INNER % 8 == 0, "16-byte chunks along the inner dimension");

  // The loader keeps no copy of Params: it reads them from the kernel's parameter space
  // on every tile (keeps registers for the accumulators).
  int64_t fixed;  // origin of the coordinate that does not move with k

  __device__ __forceinline__ explicit StridedTileLoader(int64_t fixed_) : fixed(fixed_) {}

  __device__ __forceinline__ void begin(const Params& p, T* slot, int64_t k0) const {
    const int64_t o0 = K_INNER ? fixed : k0;
    const int64_t i0 = K_INNER ? k0 : fixed;
    if (p.fast) {
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int e = threadIdx.x + c * tc::THREADS;
        const int o = e / (INNER / 8);
        const int ic = (e % (INNER / 8)) * 8;
        const int64_t go = o0 + o, gi = i0 + ic;
        const int64_t rem = p.ilim - gi;
        const int n = (go < p.olim && rem > 0) ? (rem >= 8 ? 8 : static_cast<int>(rem)) : 0;
        const T* src = n > 0 ? p.data + go * p.so + gi : p.data;
        cp_async_16(slot + o * LD + ic, src, n * static_cast<int>(sizeof(T)));
      }
    } else {
      // Element j of this thread sits at tile coordinates (o_t + j*step_o, i_t + j*step_i):
      // e = tid + j * THREADS split inner-fastest or outer-fastest (THREADS is a multiple
      // of both INNER and OUTER).
      static_assert(tc::THREADS % INNER == 0 && tc::THREADS % OUTER == 0, "thread split");
      const int o_t = p.inner_fast ? threadIdx.x / INNER : threadIdx.x % OUTER;
      const int i_t = p.inner_fast ? threadIdx.x % INNER : threadIdx.x / OUTER;
      const int step_o = p.inner_fast ? tc::THREADS / INNER : 0;
      const int step_i = p.inner_fast ? 0 : tc::THREADS / OUTER;
      const int64_t step_elems = step_o * p.so + step_i * p.si;
      const int64_t orem = p.olim - o0 - o_t;  // element j valid while j*step_o < orem
      const int64_t irem = p.ilim - i0 - i_t;  // ... and j*step_i < irem
      const T* src = p.data + (o0 + o_t) * p.so + (i0 + i_t) * p.si;
      T* dst = slot + o_t * LD + i_t;
      const int step_smem = step_o * LD + step_i;
      T v[PER];
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const bool ok = j * step_o < orem && j * step_i < irem;
        v[j] = ok ? src[j * step_elems] : from_f32<T>(0.f);
      }
#pragma unroll
      for (int j = 0; j < PER; ++j) dst[j * step_smem] = v[j];
    }
  }
  __device__ __forceinline__ void end(const Params&, T*, int64_t) const {}
};

template <typename T>
using TcALoader = StridedTileLoader<T, tc::BM, tc::BK, /*K_INNER=*/true>;  // [m][k]
template <typename T>
using TcBRowLoader = StridedTileLoader<T, tc::BK, tc::BN, /*K_INNER=*/false>;  // [k][n]
template <typename T>
using TcBColLoader = StridedTileLoader<T, tc::BN, tc::BK, /*K_INNER=*/true>;  // [n][k]

template <typename T, class BLoader>
constexpr size_t tc_smem_bytes() {
  return size_t(tc::STAGES) * (TcALoader<T>::STAGE_ELEMS + BLoader::STAGE_ELEMS) * sizeof(T);
}

// ---- mma.sync m16n8k16 / ldmatrix wrappers -------------------------------------------
// Fragment layouts (g = lane / 4, t = lane % 4), PTX ISA "mma.m16n8k16":
//   A (16x16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16x8):  c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T, bool B_COL, class BLoader>
__global__ void __launch_bounds__(tc::THREADS, 2)
    tc_gemm_kernel(typename TcALoader<T>::Params ap, typename BLoader::Params bp, Epilogue ep) {
  using ALoader = TcALoader<T>;
  static_assert(BLoader::STAGE_ELEMS == (B_COL ? tc::BN : tc::BK) * BLoader::LD,
                "B loader tile shape does not match the B layout");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const As = reinterpret_cast<T*>(smem_raw);
  T* const Bs = As + tc::STAGES * ALoader::STAGE_ELEMS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4;  // 2 x 4 warps, warp tile 64 x 32
  const int64_t ktiles = ceil_div(ep.K, tc::BK);
  // 1-D grid over the tiles, N-tile fastest (consecutive blocks share an A row panel).
  const int64_t ntiles = ceil_div(ep.N, tc::BN);
  const int64_t mt = static_cast<int64_t>(blockIdx.x) / ntiles;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) - mt * ntiles) * tc::BN;
  const int64_t m0 = mt * tc::BM;

  // Per-lane ldmatrix offsets (elements) inside one stage.
  // A x4: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (8-15, 8-15).
  const int a_off = (wm * 64 + (lane % 16)) * ALoader::LD + (lane / 16) * 8;
  // B x4 covers two n8 tiles: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
  // (n 8-15, k 8-15); [n][k] smem uses plain ldmatrix, [k][n] smem the .trans form.
  const int b_off = B_COL ? (wn * 32 + (lane / 16) * 8 + (lane % 8)) * BLoader::LD +
                                ((lane / 8) % 2) * 8
                          : (((lane / 8) % 2) * 8 + (lane % 8)) * BLoader::LD + wn * 32 +
                                (lane / 16) * 8;

  {
    ALoader la(m0);
    BLoader lb(n0);

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // Prologue: stages 0 .. STAGES-2.
#pragma unroll
    for (int s = 0; s < tc::STAGES - 1; ++s) {
      if (s < ktiles) {
        la.begin(ap, As + s * ALoader::STAGE_ELEMS, s * tc::BK);
        lb.begin(bp, Bs + s * BLoader::STAGE_ELEMS, s * tc::BK);
        la.end(ap, As + s * ALoader::STAGE_ELEMS, s * tc::BK);
        lb.end(bp, Bs + s * BLoader::STAGE_ELEMS, s * tc::BK);
      }
      cp_async_commit();
    }

    int cs = 0, ns = tc::STAGES - 1;  // stage computed / stage loaded in this iteration
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      // Groups committed so far: STAGES-1+kt; allowing STAGES-2 pending means tile kt landed.
      cp_async_wait<tc::STAGES - 2>();
      __syncthreads();  // tile kt visible to all; everyone is done with tile kt-1's slot

      const int64_t nk = kt + tc::STAGES - 1;
      T* const a_next = As + ns * ALoader::STAGE_ELEMS;
      T* const b_next = Bs + ns * BLoader::STAGE_ELEMS;
      if (nk < ktiles) {
        la.begin(ap, a_next, nk * tc::BK);
        lb.begin(bp, b_next, nk * tc::BK);
      }

      const T* const a_cur = As + cs * ALoader::STAGE_ELEMS + a_off;
      const T* const b_cur = Bs + cs * BLoader::STAGE_ELEMS + b_off;
#pragma unroll
      for (int kk = 0; kk < tc::BK; kk += 16) {
        uint32_t af[4][4], bf[4][2];
#pragma unroll
        for (int i = 0; i < 4; ++i) ldmatrix_x4(af[i], a_cur + i * 16 * ALoader::LD + kk);
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          uint32_t r[4];
          if (B_COL)
            ldmatrix_x4(r, b_cur + jp * 16 * BLoader::LD + kk);
          else
            ldmatrix_x4_trans(r, b_cur + kk * BLoader::LD + jp * 16);
          bf[2 * jp][0] = r[0];
          bf[2 * jp][1] = r[1];
          bf[2 * jp + 1][0] = r[2];
          bf[2 * jp + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], af[i], bf[j]);
      }

      if (nk < ktiles) {
        la.end(ap, a_next, nk * tc::BK);
        lb.end(bp, b_next, nk * tc::BK);
      }
      cp_async_commit();
      cs = cs + 1 == tc::STAGES ? 0 : cs + 1;
      ns = ns + 1 == tc::STAGES ? 0 : ns + 1;
    }
    cp_async_wait<0>();

    // Epilogue straight from the accumulators (bounds-checked, arbitrary output strides).
    T* const c = static_cast<T*>(ep.c);
    const T* const bias = static_cast<const T*>(ep.bias);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t gn = n0 + wn * 32 + j * 8 + 2 * t + e;
        if (gn >= ep.N) continue;
        const float bv = bias ? to_f32(bias[gn * ep.bias_stride]) : 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t gm = m0 + wm * 64 + i * 16 + g + h * 8;
            if (gm < ep.M)
              c[gm * ep.c_rs + gn * ep.c_cs] =
                  from_f32<T>(apply_act(acc[i][j][h * 2 + e] + bv, ep.act));
          }
        }
      }
    }
  }
}

// Launches c = act(A @ B + bias) with the tensor-core kernel: one block per 128 x 128
// output tile, 1-D grid (up to 2^31 - 1 tiles).
template <typename T, bool B_COL, class BLoader>
inline Status launch_tc_gemm(const typename TcALoader<T>::Params& ap,
                             const typename BLoader::Params& bp, const Epilogue& ep,
                             cudaStream_t stream) {
  auto kernel = tc_gemm_kernel<T, B_COL, BLoader>;
  constexpr size_t smem = tc_smem_bytes<T, BLoader>();
  const cudaError_t e = set_dynamic_smem(kernel, smem);
  if (e != cudaSuccess) return status_from(e);
  const int64_t tiles = ceil_div(ep.N, tc::BN) * ceil_div(ep.M, tc::BM);
  if (tiles > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  kernel<<<static_cast<unsigned>(tiles), tc::THREADS, smem, stream>>>(ap, bp, ep);
  return launch_status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace portable_gemm
