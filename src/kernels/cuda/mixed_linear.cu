// cuda::mixed_linear: y = act(x @ dequant(w)^T + bias), w int8 [N, K] or int4 packed
// [N, K/2] with per-channel or group-wise scales (f32 / f16 / bf16).
//   M <= 16, f16/bf16 x (aligned, K % 128 (int4) / 64 (int8) == 0): tensor-core GEMV
//                   (mma.sync, weight dequantised in registers into the A fragment) over
//                   whole blocks of 32 rows, then the last N % 32 rows as one more whole
//                   block ending at row N.
//   16 < M <= GEMV_SLICED_MAX_M, same conditions: the same GEMV over x in slices of 16
//                   rows, one launch (see gemv_tc_kernel); int8 with four x tiles in slices
//                   of 32 rows (tcv_four).
//   M <= 16 otherwise, and up to M = 64 where N is below one block of the tensor-core
//                   GEMV: SIMT GEMV kernel (weights streamed once in 16-byte chunks).
//   more rows, f16/bf16 x: the tensor-core GEMM of tc_gemm.cuh, B tiles dequantised on the
//                   fly. Callers that lend scratch memory (the torch binding; the DLPack
//                   door through mixed_linear_pooled) send these to the sm_90 CUTLASS GEMM
//                   or to dequantize_rows + a dense GEMM instead (mixed_linear_path), and
//                   on sm_90 also M = 17..32 from 48 MiB of weight (not int4 with groups
//                   of a multiple of 128) and M = 33..64 above 16 MiB
//                   (mixed_linear_sm90_preferred); this one keeps weights whose
//                   16-bit copy would exceed 512 MiB where the sm_90 GEMM does not apply.
//   M > 16, f32 x:  the exact-fp32 SIMT GEMM of simt_gemm.cuh, B tiles dequantised.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/simt_gemm.cuh"
#include "cuda/tc_gemm.cuh"

namespace portable_gemm {
namespace cuda {
namespace detail {

struct QuantParams {
  const uint8_t* q;
  int64_t q_rs;  // bytes
  int bits;
  int64_t gs;  // 0 = per channel
  const void* scales;
  int64_t s_rs;
  int s_dt;
  int64_t N, K;
  int wfast;    // aligned vector loads of weight rows are allowed (path-specific width)
  int uniform;  // every vector chunk of k values lies in one scale group (path-specific)
};

// Scale of (n, k), k < K.
__device__ __forceinline__ float scale_at(const QuantParams& p, int64_t n, int64_t k) {
  const int64_t g = p.gs > 0 ? div_nn(k, p.gs) : 0;
  return load_f32(p.scales, p.s_dt, n * p.s_rs + g);
}

// Quantised value (n, k) as float (n < N, k < K).
__device__ __forceinline__ float q_at(const QuantParams& p, int64_t n, int64_t k) {
  const uint8_t* row = p.q + n * p.q_rs;
  if (p.bits == 8) return static_cast<float>(static_cast<int8_t>(row[k]));
  const unsigned byte = row[k >> 1];
  const int nib = static_cast<int>((k & 1) ? (byte >> 4) : (byte & 0xFu));
  return static_cast<float>((nib ^ 8) - 8);
}

// ---- tensor-core B loader: 128 n x 32 k tile, dequantised into smem [n][k] ---------------
// Thread tid covers n = tid / 2, k = (tid % 2) * 16 .. + 15: one 16-byte (int8) or 8-byte
// (int4) load in begin(), conversion and the shared stores in end().
template <typename T>
struct TcDequantLoader {
  using Params = QuantParams;
  static constexpr int OUTER = tc::BN, INNER = tc::BK;
  static constexpr int LD = INNER + tc::PAD;
  static constexpr int STAGE_ELEMS = OUTER * LD;
  static_assert(OUTER * INNER == tc::THREADS * 16, "16 values per thread");

  int64_t n0;
  uint4 raw;
  float s;

  __device__ __forceinline__ explicit TcDequantLoader(int64_t n0_) : n0(n0_) {}

  __device__ __forceinline__ void begin(const Params& p, T*, int64_t k0) {
    const int64_t n = n0 + threadIdx.x / 2;
    const int64_t kb = k0 + (threadIdx.x & 1) * 16;
    raw = make_uint4(0u, 0u, 0u, 0u);
    s = 0.f;
    if (n < p.N && kb < p.K) {
      const uint8_t* row = p.q + n * p.q_rs;
      const bool full = kb + 16 <= p.K;
      if (p.bits == 8) {
        if (p.wfast && full) {
          raw = __ldg(reinterpret_cast<const uint4*>(row + kb));
        } else {
          uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
          for (int b = 0; b < 16; ++b)
            if (kb + b < p.K) w[b / 4] |= static_cast<uint32_t>(row[kb + b]) << (8 * (b % 4));
          raw = make_uint4(w[0], w[1], w[2], w[3]);
        }
      } else {
        const uint8_t* src = row + kb / 2;
        if (p.wfast && full) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
          raw.x = v.x;
          raw.y = v.y;
        } else {
          uint32_t w[2] = {0u, 0u};
#pragma unroll
          for (int b = 0; b < 8; ++b)
            if (kb + 2 * b < p.K) w[b / 4] |= static_cast<uint32_t>(src[b]) << (8 * (b % 4));
          raw.x = w[0];
          raw.y = w[1];
        }
      }
      if (p.uniform) s = scale_at(p, n, kb);
    }
  }

  __device__ __forceinline__ void end(const Params& p, T* slot, int64_t k0) {
    const int nl = threadIdx.x / 2, kl = (threadIdx.x & 1) * 16;
    const int64_t n = n0 + nl;
    float v[16];
    if (p.bits == 8) {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = s8_to_f32(word_of(raw, i / 4), i % 4);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = s4_to_f32(word_of(raw, i / 8), i % 8);
    }
    if (p.uniform) {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] *= s;
    } else {
      // Group boundaries inside the 16 values: per-element scale (slow path, any group size).
      const int64_t k = k0 + kl;
#pragma unroll
      for (int i = 0; i < 16; ++i)
        v[i] *= (n < p.N && k + i < p.K) ? scale_at(p, n, k + i) : 0.f;
    }
    uint4 lo, hi;
    lo.x = pack2<T>(v[0], v[1]);
    lo.y = pack2<T>(v[2], v[3]);
    lo.z = pack2<T>(v[4], v[5]);
    lo.w = pack2<T>(v[6], v[7]);
    hi.x = pack2<T>(v[8], v[9]);
    hi.y = pack2<T>(v[10], v[11]);
    hi.z = pack2<T>(v[12], v[13]);
    hi.w = pack2<T>(v[14], v[15]);
    uint4* dst = reinterpret_cast<uint4*>(slot + nl * LD + kl);
    dst[0] = lo;
    dst[1] = hi;
  }
};

// ---- SIMT B loader: 16 k x 64 n tile, dequantised into Bs[k][n] (f32 activations) --------
struct SimtDequantLoader {
  using Params = QuantParams;
  QuantParams p;
  int64_t n0;
  float regs[4];
  __device__ __forceinline__ SimtDequantLoader(const Params& p_, int64_t n0_) : p(p_), n0(n0_) {}
  __device__ __forceinline__ void load(int64_t k0) {
    const int64_t n = n0 + threadIdx.x / 4;
    const int64_t k = k0 + (threadIdx.x % 4) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      regs[i] = (n < p.N && k + i < p.K) ? q_at(p, n, k + i) * scale_at(p, n, k + i) : 0.f;
  }
  __device__ __forceinline__ void store(float* Bs) const {
    const int nl = threadIdx.x / 4, kl = (threadIdx.x % 4) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) Bs[(kl + i) * simt::LDS + nl] = regs[i];
  }
};

// ---- GEMV (M <= 16) -------------------------------------------------------------------
// Block = 256 threads = 8 warps; LPR = 8 lanes per output channel (weight row), 4 rows per
// warp, 32 rows per block. K is walked in chunks of KC: every lane loads PPL
// 16-byte pieces of its row (V = 16 int8 or 32 int4 values each, pieces j, j+LPR, ...: the
// row's lanes read contiguous bytes), the block stages x[:, chunk] as fp32 in shared memory,
// then each
// lane dequantises in registers and FMAs against the M rows of x. A per-piece partial sum
// is scaled once (every piece must lie in one scale group: group_size % V == 0 or per
// channel; other group sizes go to gemv_generic_kernel). 8-lane shuffle reduction at the end.
constexpr int GEMV_THREADS = 256;

// Byte-wise load of one 16-byte piece (unaligned rows or the K tail), zero past K.
// Out of line: it is the rare path and would otherwise be unrolled into every variant.
__device__ __noinline__ uint4 load_piece_bytewise(const uint8_t* src, int64_t kb, int64_t K,
                                                  int bits) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int b = 0; b < 16; ++b) {
    const bool ok = bits == 8 ? kb + b < K : kb + 2 * b < K;
    if (ok) w[b / 4] |= static_cast<uint32_t>(src[b]) << (8 * (b % 4));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int BITS, int MAXM>
struct GemvCfg {
  static constexpr int V = BITS == 4 ? 32 : 16;  // values per 16-byte piece
  // Lanes per weight row (must divide 32). 8 measured better than 32 on H200 at M <= 4.
  static constexpr int LPR = 8;
  static constexpr int ROWS = (GEMV_THREADS / 32) * (32 / LPR);  // rows per block
  // Pieces per lane per chunk (keeps the staged x chunk <= ~36 KiB).
  static constexpr int PPL = MAXM <= 2 ? 8 : (MAXM <= 4 ? 4 : 2);
  static constexpr int KC = PPL * LPR * V;      // k values per chunk
  static constexpr int XP = KC + (KC / V) * 4;  // padded pitch: piece p starts at p*(V+4)
};

struct GemvParams {
  const void* x;
  int64_t x_rs, x_cs;
  int x_dt;
  QuantParams w;
  const void* bias;
  int64_t bias_stride;
  void* y;
  int64_t y_rs, y_cs;
  int M;
  int act;
};

template <int BITS, int MAXM>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_kernel(GemvParams p) {
  using Cfg = GemvCfg<BITS, MAXM>;
  constexpr int V = Cfg::V, PPL = Cfg::PPL, KC = Cfg::KC, XP = Cfg::XP, LPR = Cfg::LPR;
  extern __shared__ __align__(16) float xs[];  // [M][XP]

  const QuantParams& qp = p.w;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / LPR, j = lane % LPR;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * Cfg::ROWS + warp * (32 / LPR) + r;
  const bool n_ok = n < qp.N;
  const int M = p.M;
  const int64_t K = qp.K;
  const uint8_t* row = qp.q + (n_ok ? n : 0) * qp.q_rs;
  const float row_scale =
      (n_ok && qp.gs == 0) ? load_f32(qp.scales, qp.s_dt, n * qp.s_rs) : 0.f;

  float acc[MAXM];
#pragma unroll
  for (int m = 0; m < MAXM; ++m) acc[m] = 0.f;

  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    // Weight pieces of this chunk (issued before the x staging to overlap latencies).
    // The group scales of the pieces are fetched here too, off the FMA path.
    uint4 wr[PPL];
    float ws[PPL];
#pragma unroll
    for (int t = 0; t < PPL; ++t) {
      const int64_t kb = k0 + (j + t * LPR) * V;
      wr[t] = make_uint4(0u, 0u, 0u, 0u);
      ws[t] = row_scale;
      if (n_ok && kb < K) {
        if (qp.gs != 0) ws[t] = load_f32(qp.scales, qp.s_dt, n * qp.s_rs + div_nn(kb, qp.gs));
        const uint8_t* src = row + (BITS == 8 ? kb : kb / 2);
        wr[t] = (qp.wfast && kb + V <= K) ? __ldg(reinterpret_cast<const uint4*>(src))
                                          : load_piece_bytewise(src, kb, K, BITS);
      }
    }

    __syncthreads();  // the previous chunk's x is no longer read
    for (int e = threadIdx.x; e < M * KC; e += GEMV_THREADS) {
      const int m = e / KC, kk = e % KC;
      const int64_t gk = k0 + kk;
      xs[m * XP + kk + (kk / V) * 4] =
          gk < K ? load_f32(p.x, p.x_dt, m * p.x_rs + gk * p.x_cs) : 0.f;
    }
    __syncthreads();

#pragma unroll
    for (int t = 0; t < PPL; ++t) {
      const int piece = j + t * LPR;
      const int64_t kb = k0 + piece * V;
      if (!(n_ok && kb < K)) continue;
      // Every piece lies in one scale group (gemv_dispatch checks; else gemv_generic_kernel).
      const float s = ws[t];
      float part[MAXM];
#pragma unroll
      for (int m = 0; m < MAXM; ++m) part[m] = 0.f;
      const float* xp = xs + piece * (V + 4);
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        float q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          q[u] = BITS == 8 ? s8_to_f32(word_of(wr[t], (i + u) / 4), (i + u) % 4)
                           : s4_to_f32(word_of(wr[t], (i + u) / 8), (i + u) % 8);
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
          if (m < M) {
            const float4 xv = *reinterpret_cast<const float4*>(xp + m * XP + i);
            part[m] = fmaf(q[0], xv.x, part[m]);
            part[m] = fmaf(q[1], xv.y, part[m]);
            part[m] = fmaf(q[2], xv.z, part[m]);
            part[m] = fmaf(q[3], xv.w, part[m]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MAXM; ++m) acc[m] = fmaf(s, part[m], acc[m]);
    }
  }

  const float bv = (n_ok && p.bias) ? load_f32(p.bias, p.x_dt, n * p.bias_stride) : 0.f;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (j == 0 && n_ok && m < M)
      store_f32(p.y, p.x_dt, m * p.y_rs + n * p.y_cs, apply_act(v + bv, p.act));
  }
}

// Small-M fallback for group sizes that are not a multiple of the GEMV piece width (any
// divisor of K): one warp per output channel, lanes stride over k, element-wise dequant,
// x read straight from global memory. Simple and slow; rare group sizes only.
constexpr int GEMV_GENERIC_MAXM = 16;
__global__ void __launch_bounds__(GEMV_THREADS) gemv_generic_kernel(GemvParams p) {
  const QuantParams& qp = p.w;
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (GEMV_THREADS / 32) + threadIdx.x / 32;
  if (n >= qp.N) return;  // whole warp leaves together
  float acc[GEMV_GENERIC_MAXM];
#pragma unroll
  for (int m = 0; m < GEMV_GENERIC_MAXM; ++m) acc[m] = 0.f;
  for (int64_t k = lane; k < qp.K; k += 32) {
    const float w = q_at(qp, n, k) * scale_at(qp, n, k);
#pragma unroll
    for (int m = 0; m < GEMV_GENERIC_MAXM; ++m)
      if (m < p.M) acc[m] = fmaf(w, load_f32(p.x, p.x_dt, m * p.x_rs + k * p.x_cs), acc[m]);
  }
  const float bv = p.bias ? load_f32(p.bias, p.x_dt, n * p.bias_stride) : 0.f;
#pragma unroll
  for (int m = 0; m < GEMV_GENERIC_MAXM; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0 && m < p.M)
      store_f32(p.y, p.x_dt, m * p.y_rs + n * p.y_cs, apply_act(v + bv, p.act));
  }
}

template <int BITS, int MAXM>
Status launch_gemv(GemvParams p, cudaStream_t stream) {
  using Cfg = GemvCfg<BITS, MAXM>;
  p.w.uniform = 1;
  p.w.wfast = aligned_to(p.w.q, 16) && p.w.q_rs % 16 == 0;
  const size_t smem = static_cast<size_t>(p.M) * Cfg::XP * sizeof(float);
  const int64_t blocks = ceil_div(p.w.N, Cfg::ROWS);
  if (blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  gemv_kernel<BITS, MAXM><<<static_cast<unsigned>(blocks), GEMV_THREADS, smem, stream>>>(p);
  return launch_status();
}

template <int BITS>
Status gemv_dispatch(const GemvParams& p, cudaStream_t stream) {
  constexpr int V = GemvCfg<BITS, 1>::V;
  if (p.w.gs != 0 && p.w.gs % V != 0) {
    const int64_t blocks = ceil_div(p.w.N, GEMV_THREADS / 32);
    if (blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
    gemv_generic_kernel<<<static_cast<unsigned>(blocks), GEMV_THREADS, 0, stream>>>(p);
    return launch_status();
  }
  if (p.M <= 1) return launch_gemv<BITS, 1>(p, stream);
  if (p.M <= 2) return launch_gemv<BITS, 2>(p, stream);
  if (p.M <= 4) return launch_gemv<BITS, 4>(p, stream);
  if (p.M <= 8) return launch_gemv<BITS, 8>(p, stream);
  return launch_gemv<BITS, 16>(p, stream);
}

// ---- tensor-core GEMV (M <= 16, f16 / bf16 x) ------------------------------------------
// y^T[N, M] = W[N, K] . x^T: the weight is the A operand of mma.sync m16n8k16 (16 weight
// rows per tile, dequantised in registers straight into the A fragment), x^T the B operand
// (8 rows of x per n8 tile, MT = 1 or 2 tiles for M <= 8 / <= 16), fp32 accumulate.
// The 4 lanes of a fragment row (t = lane % 4) each load one 16-byte piece of the row: a
// chunk is 4 consecutive pieces (CHUNK = 128 k for int4, 64 for int8; int4 at M > 8 takes
// half chunks of 8-byte pieces where K <= 8192 or they pair up, see tcv_half and tcv_pair).
// Inside a chunk the k order of the MMAs is permuted (the dot product does not care) so that
// every lane uses only its own piece, and x is loaded in the same permutation (16-byte loads
// + prmt).
// Block = 8 warps over the same 16 * RT rows, splitting K (warp w takes chunks w, w + 8, ..);
// the 8 partial results are summed through shared memory. M > 16 runs in slices of 16 rows
// of x, one block per (32 weight rows, slice), the slices of a row block next to each other
// in launch order: they run at the same time on neighbouring SMs, and all but the first to
// ask for a weight line find it in L2, so DRAM reads the weight about once. int8 at M > 16
// runs all rows of x in one pass instead (MT = 4 x tiles over RT = 1, see tcv_four).
// Scales: per channel at the end; groups that cover whole chunks on the fp32 partial of
// each chunk (exact); smaller groups (a multiple of the piece) folded into the 16-bit
// weight before the MMA (q * s rounded once to f16/bf16). int4 without folding (OFFSET)
// feeds the MMA OFF + q straight out of the magic-number trick and subtracts OFF . x per
// chunk (one extra MMA per k step, shared by all RT tiles) instead of a subtraction per
// weight pair: 3-5% faster on the H200 (bench/GPU_NOTES.md, run 12), where this kernel is
// bound neither by the bytes in flight (runs 11, 13) nor by this arithmetic alone.
namespace tcv {
constexpr int THREADS = 256;
constexpr int KW = THREADS / 32;  // warps per block, splitting K
constexpr int RT = 2;             // 16-row weight tiles per warp
constexpr int ROWS = 16 * RT;     // weight rows (outputs) per block
// int8 at M > 16: four 8-row x tiles over one 16-row weight tile per warp (tcv_four), in
// slices of 32 rows of x from M = 33, instead of slices of 16 rows (two x tiles and two
// weight tiles).
constexpr int FOUR_RT = 1;
constexpr int FOUR_ROWS = 16 * FOUR_RT;
}  // namespace tcv

// k per lane per chunk (LK): one 16-byte piece of each weight row, or with HALF (int4 at
// M > 8 only) an 8-byte piece. Two tiles of x for a half chunk take 16 registers, so there x
// is prefetched a chunk ahead like the weights; for a whole chunk they take 32, and x is
// loaded at the start of each chunk (two stages would spill).
template <int BITS, bool HALF = false>
struct TcvCfg {
  static constexpr int LK = BITS == 4 ? (HALF ? 16 : 32) : 16;
  static constexpr int CHUNK = 4 * LK;        // k per chunk
  static constexpr int XU = LK * 2 / 16;      // 16-byte x loads per lane per x row
  static constexpr int WW = LK * BITS / 32;   // 32-bit weight words per lane per row
};

// Half chunks in pairs (p.pair, the kernels with OFFSET, HALF and PAIR_): a warp takes both
// halves of a whole chunk one after the other (half chunks 2w, 2w + 1, then 2w + 16, ..) and
// pays the per-chunk work (OFF . x subtracted, the scale applied) once per pair, as whole
// chunks do, with half chunks' registers. Needs one scale for both halves: per channel, or
// groups of whole chunks. The loop is 320 instead of 390 instructions per two half chunks
// (sm_90a); on the H200 (bench/GPU_NOTES.md, run 77) 0.90-0.96x the time of single half
// chunks at M = 9..16 and 0.84-0.88x at M = 17..32.
constexpr bool tcv_pair(int64_t group_size) {
  return group_size == 0 || group_size % 128 == 0;
}
// int4 at M > 8 takes half chunks where K <= 8192 or the chunks pair up. Single half chunks
// against whole chunks on the H200 (run 39), at M = 16: 0.85-0.96x the time where
// K <= 8192 and the grid spans more or less than one wave of blocks, 1.00 at 8192^2, but
// 1.04-1.16x at K = 11008 and 28672, where a warp walks 11-28 whole chunks and paid the
// per-chunk work twice as often; in pairs 0.92-1.01x the whole chunks' time there (run 77).
constexpr int64_t TCV_HALF_MAX_K = 8192;
constexpr bool tcv_half(int64_t m, int64_t k, int64_t group_size) {
  return m > 8 && (k <= TCV_HALF_MAX_K || tcv_pair(group_size));
}

// int8 at M = 17..32 (16 < M, the sliced range; more rows in slices of 32) takes one pass
// with four x tiles (MT = 4) over one 16-row weight tile per warp: each weight is
// dequantised once for all rows of x, where two slices of 16 rows dequantised it twice. On
// the H200 (bench/GPU_NOTES.md, run 54) that took 0.85-0.98x the time of the slices on every
// shape of issue 7 (outputs bit-equal: the same MMAs in the same order). x is loaded per
// chunk (a prefetch stage would spill). int4 stays on the slices: its B fragments for four
// tiles take 64 registers.
template <int BITS>
constexpr bool tcv_four(int64_t m) {
  return BITS == 8 && m > 16;
}

struct TcvParams {
  const void* x;
  int64_t x_rs;
  const uint8_t* q;
  int64_t q_rs;
  const void* scales;
  int64_t s_rs;  // elements of the scales' type (the kernel's S)
  int mode;  // 0 per channel, 1 group scale on the chunk's fp32 partial, 2 folded
  int64_t gs;
  const void* bias;
  int64_t bias_stride;
  void* y;
  int64_t y_rs, y_cs;
  int64_t N, K;
  int M, act;
  int slices;  // blocks per weight row block: x in slices of 8 MT rows (1 when M <= 8 MT)
  // Set by the host from the above: the stride between a lane's weight rows (8 rows) in
  // bytes of weight and in bytes of scales, and how far the group index moves between two
  // chunks a warp loads (KW chunks apart): gstep whole groups plus grstep elements of k.
  // gs32, gstep and grstep fit 32 bits (gemv_tc_ok bounds the group size and count).
  int64_t q_rs8, s_rs8;
  int gs32, gstep, grstep;
  bool half;  // int4 half chunks (tcv_half)
  bool pair;  // half chunks in pairs (tcv_pair; the offset form's kernels take them so)
  // The last N % ROWS rows' launch overlaps the whole blocks' (programmatic dependent launch,
  // sm_90): 1 in the whole blocks' launch (let the next launch start), 2 in the last rows'
  // (finish only after the whole blocks have: the stream's order for what follows).
  int pdl;
};

__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_wait_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Streaming 16-byte weight load: read once, keep it out of L1 (x lives there). No bound
// test: the kernel only runs over whole blocks of rows (gemv_tc_dispatch runs the last
// N % ROWS rows as one more whole block).
__device__ __forceinline__ void ldg_stream(uint32_t (&r)[4], const void* p) {
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "l"(p));
}
__device__ __forceinline__ void ldg_stream(uint32_t (&r)[2], const void* p) {
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];"
      : "=r"(r[0]), "=r"(r[1])
      : "l"(p));
}
// Loads predicated on `pred` without a branch (a branch per load cost ~10 instructions of
// the small-M loop: BSSY/BRA/BSYNC, the zero fill; bench/GPU_NOTES.md, run 31). Where pred
// is false the destination is left undefined: the callers only switch the scale loads of
// per-channel weights off, and never read those registers.
// A scale's raw bits (S = float, __half or __nv_bfloat16; 16-bit ones zero-extended),
// converted only where it is used: a conversion next to the load would make the warp wait
// for it one chunk early (the scales are read once, from DRAM, so that wait is a full memory
// latency per chunk). S is a template parameter of the kernel: with the type read at run
// time, every scale cost two predicated loads and a branch per conversion (~90 of the int4
// loop's 338 instructions went to that and the row bounds; bench/GPU_NOTES.md, run 35).
template <typename S>
__device__ __forceinline__ void ldg_scale_if(uint32_t& r, const char* a, bool pred) {
  if constexpr (sizeof(S) == 4)
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.u32 %0, [%1];\n}\n"
        : "=r"(r)
        : "l"(a), "r"(static_cast<int>(pred)));
  else
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.u16 %0, [%1];\n}\n"
        : "=r"(r)
        : "l"(a), "r"(static_cast<int>(pred)));
}
template <typename S>
__device__ __forceinline__ float scale_from_bits(uint32_t b) {
  if constexpr (std::is_same<S, __half>::value)
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  else if constexpr (std::is_same<S, __nv_bfloat16>::value)
    return __uint_as_float(b << 16);
  else
    return __uint_as_float(b);
}

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t sub2<__half>(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t sub2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  __nv_bfloat162 r =
      __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <typename T>
__host__ __device__ constexpr uint32_t dq4_offset_pair() {  // OFF in both halves: 1032 (f16) / 136 (bf16)
  return std::is_same<T, __half>::value ? 0x64086408u : 0x43084308u;
}

// (a & b) ^ c as one LOP3: written as (a & imm) | imm the compiler emits two, since an
// instruction carries one immediate.
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Nibbles i and i + 4 of the packed word w (signed q, two's complement) as two exact 16-bit
// values still offset by the magic number and the bias of 8: u = q + 8 is the nibble xor 8,
// and 0x6400 | u = 1024 + u (f16), 0x4300 | u = 128 + u (bf16); the magic's low bits are
// zero, so (nibble ^ 8) | magic = nibble ^ (magic | 8) = nibble ^ OFF's bits. That gives
// OFF + q (1032 + q in f16, 136 + q in bf16): the MMA then sums (OFF + q) x, and OFF . x is
// subtracted once per chunk (see gemv_tc_kernel) instead of once per weight pair.
template <typename T>
__device__ __forceinline__ uint32_t dq4_offset(uint32_t w, int i) {
  return and_xor(w >> (4 * i), 0x000F000Fu, dq4_offset_pair<T>());
}
// The same two nibbles as the exact values q.
template <typename T>
__device__ __forceinline__ uint32_t dq4(uint32_t w, int i) {
  return sub2<T>(dq4_offset<T>(w, i), dq4_offset_pair<T>());
}

// Bytes h and h + 2 of w (signed int8) as two exact bf16 values, in two LOP3 (and a shift
// for h = 1) and one add (dq8's bf16 form takes two prmt, two FADD and a conversion per
// pair): with u = q & 127, 0x4300 | u is 128 + u, and the sign bit of q picks -128
// (0xC300) or -256 (0xC380), so the sum is q (exact: both terms and q are bf16 values).
// The pair is (k, k + 2), not (k, k + 1): x goes into the MMA in the same order (see
// SPLIT8 in gemv_tc_kernel).
__device__ __forceinline__ uint32_t dq8_bf16_split(uint32_t w, int h) {
  const uint32_t v = h ? w >> 8 : w;
  const uint32_t lo = and_xor(v, 0x007F007Fu, 0x43004300u);  // 128 + (q & 127)
  const uint32_t hi = and_xor(v, 0x00800080u, 0xC300C300u);  // -128, or -256 where q < 0
  __nv_bfloat162 r = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&lo),
                             *reinterpret_cast<const __nv_bfloat162*>(&hi));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Two words of 16-bit pairs (a0, a1) and (b0, b1) as (a0, b0) and (a1, b1): x's B fragment
// in the k order of a weight decoder that pairs k with k + 2 (int4 and dq8_bf16_split).
__device__ __forceinline__ void halves_paired(uint32_t lo, uint32_t hi, uint32_t (&out)[2]) {
  out[0] = __byte_perm(lo, hi, 0x5410u);
  out[1] = __byte_perm(lo, hi, 0x7632u);
}

// Bytes 2h and 2h + 1 of w (signed int8) as two exact 16-bit values.
template <typename T>
__device__ __forceinline__ uint32_t dq8(uint32_t w, int h) {
  if constexpr (std::is_same<T, __half>::value) {
    // (b ^ 0x80) in the mantissa of 1024: 1024 + q + 128, minus 1152 (0x6480).
    const uint32_t v = __byte_perm(w ^ 0x80808080u, 0x64646464u, h ? 0x4342u : 0x4140u);
    return sub2<__half>(v, 0x64806480u);
  } else {
    return pack2<__nv_bfloat16>(s8_to_f32(w, 2 * h), s8_to_f32(w, 2 * h + 1));
  }
}

// Preconditions (gemv_tc_ok, launch_gemv_tc): p.N % ROWS == 0, K % CHUNK == 0, S the
// scales' element type.
// RT_: 16-row weight tiles per warp (a block's rows are 16 RT_).
// PAIR_: half chunks in pairs (p.pair; with OFFSET and HALF only).
template <typename T, typename S, int BITS, int MT, bool OFFSET, bool HALF, bool SLICED = false,
          int RT_ = tcv::RT, bool PAIR_ = false>
__global__ void __launch_bounds__(tcv::THREADS, 2) gemv_tc_kernel(TcvParams p) {
  using Cfg = TcvCfg<BITS, HALF>;
  constexpr int LK = Cfg::LK, CHUNK = Cfg::CHUNK, XU = Cfg::XU, WW = Cfg::WW;
  constexpr int RT = RT_, KW = tcv::KW, NACC = RT * MT * 4;
  // int8 with bf16 x: weights through dq8_bf16_split, x permuted to match (two prmt per
  // pair of x words). Not with four x tiles: there the x permutes cost what the weights
  // save.
  constexpr bool SPLIT8 = BITS == 8 && std::is_same<T, __nv_bfloat16>::value && MT <= 2;
  __shared__ float red[KW][NACC][32];
  if (p.pdl == 1) grid_launch_dependents();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  // SLICED: block b multiplies rows r0 .. r0 + 8 MT - 1 of x (slices of 16 rows, or of 32
  // with four x tiles); otherwise all M <= 8 MT rows (a variant of its own: at the register
  // cap, the slice's offset cost spills).
  const int64_t n0 = static_cast<int64_t>(SLICED ? blockIdx.x / p.slices : blockIdx.x) * (16 * RT);
  const int r0 = SLICED ? static_cast<int>(blockIdx.x % p.slices) * (8 * MT) : 0;
  const int64_t nchunks = p.K / CHUNK;
  const T* xg = static_cast<const T*>(p.x);
  // PAIR (see tcv_pair): warp w's first chunk is 2w, and chunks come in pairs 2c, 2c + 1.
  constexpr bool PAIR = PAIR_ && HALF && OFFSET;
  constexpr int CP = PAIR ? 2 : 1;  // chunks a warp takes in a row

  // The lane's weight rows are n0 + g + 8 j (j = 2 rt + h), all < N (whole blocks only):
  // one base address (strides from the parameters) and the scale group of the next chunk
  // to load, advanced without a division. Few registers: the kernel is at its cap of 128.
  const uint8_t* wbase = p.q + (n0 + g) * p.q_rs + tig * (LK * BITS / 8);
  // Scales: the row's first byte, then 32-bit counters (gemv_tc_ok: < 2^28 groups a row,
  // so gidx << SSHIFT stays below 2^31).
  constexpr int SSHIFT = sizeof(S) == 4 ? 2 : 1;
  const char* sbase = static_cast<const char*>(p.scales) + (((n0 + g) * p.s_rs) << SSHIFT);
  int gidx = 0, grem = 0;  // group of k; k - group * gs
  if (p.mode != 0) {
    const int64_t k0 = static_cast<int64_t>(warp) * (CP * CHUNK) + tig * LK, g0 = k0 / p.gs;
    gidx = static_cast<int>(g0);
    grem = static_cast<int>(k0 - g0 * p.gs);
  }

  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[rt][mt][r] = 0.f;

  // x is prefetched one chunk ahead with the weights, except for whole int4 chunks at M > 8,
  // where the two register stages of x (64 registers) would spill: there x is loaded per
  // chunk.
  constexpr bool XPF = MT < 4 && !(BITS == 4 && MT == 2 && !HALF);  // MT = 4: x per chunk too
  struct Stage {
    uint32_t w[RT][2][WW];
    uint32_t s[RT][2];  // raw scale bits (mode 1, 2)
    uint4 x[MT][XU];
  };
  // x rows past M read row M - 1 instead (no bound test or zero fill in the loop): they
  // only feed MMA columns m >= M, which are never stored (columns of the MMA do not mix).
  auto x_row = [&](int mt) { return xg + min(r0 + mt * 8 + g, p.M - 1) * p.x_rs; };
  auto ldg_x = [](const T* at, uint4 (&xd)[XU]) {
    const uint4* src = reinterpret_cast<const uint4*>(at);
#pragma unroll
    for (int u = 0; u < XU; ++u) xd[u] = __ldg(src + u);
  };
  auto load_x = [&](int64_t c, uint4 (&xd)[MT][XU]) {
    const int64_t k = c * CHUNK + tig * LK;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldg_x(x_row(mt) + k, xd[mt]);
  };
  // With x prefetched, the loads' addresses are running pointers advanced by a constant
  // each chunk (RUNP). Written from the parameters, the compiler recomputed them at every
  // chunk (~30 of its instructions, at the register cap); this way the int4 loop is 458
  // instead of 518 instructions per two chunks at M <= 8 and 390 instead of 455 at M = 9..16,
  // 0.95-0.98x / 0.92-0.95x the time on the H200 (bench/GPU_NOTES.md, run 76). Not where
  // ptxas then spills: single half chunks with f16 scales or in slices (pairs do not).
  constexpr bool RUNP = XPF && (PAIR || !(HALF && (SLICED || std::is_same<S, __half>::value)));
  const uint8_t* pw = wbase + warp * (CP * CHUNK * BITS / 8);
  const char* psc = sbase + (static_cast<int64_t>(gidx) << SSHIFT);
  const T* pxr[MT];
  if constexpr (RUNP)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      pxr[mt] = x_row(mt) + warp * (CP * CHUNK) + tig * LK;
  // Loads chunk c into st; called for c = warp, warp + KW, ... in this order (in pairs:
  // 2 warp, 2 warp + 1, 2 warp + 2 KW, ..). ADV: the chunks from c to the next load's (the
  // running pointers' step); SCL: whether this load reads the scales (in pairs only the
  // second of a pair does: both halves share them).
  auto load = [&](int64_t c, Stage& st, auto adv, auto scl) {
    [[maybe_unused]] constexpr int ADV = decltype(adv)::value;  // used where RUNP
    constexpr bool SCL = decltype(scl)::value;
    const uint8_t* pc = RUNP ? pw : wbase + c * (CHUNK * BITS / 8);
    if constexpr (RUNP) pw += ADV * (CHUNK * BITS / 8);
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * rt + h;
        ldg_stream(st.w[rt][h], pc + j * p.q_rs8);
        const char* sp = (RUNP ? psc : sbase + (gidx << SSHIFT)) + j * p.s_rs8;
        // int4 whole chunks at M > 8 are at the register cap: there the branch form spills less.
        if constexpr (SCL) {
          if constexpr (XPF) ldg_scale_if<S>(st.s[rt][h], sp, p.mode != 0);
          else if (p.mode != 0) ldg_scale_if<S>(st.s[rt][h], sp, true);
        }
      }
    if (SCL && p.mode != 0) {
      if constexpr (RUNP) psc += p.gstep << SSHIFT;
      else gidx += p.gstep;
      grem += p.grstep;
      if (grem >= p.gs32) {
        grem -= p.gs32;
        if constexpr (RUNP) psc += 1 << SSHIFT;
        else ++gidx;
      }
    }
    if constexpr (RUNP) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldg_x(pxr[mt], st.x[mt]);
        pxr[mt] += ADV * CHUNK;
      }
    } else if constexpr (XPF) {
      load_x(c, st.x);
    }
  };
  // The chunk's partial sums (and OFF . x) before the scale: in pairs they carry over from
  // the first chunk of a pair to the second, which subtracts and scales them once.
  float part[RT][MT][4];
  float corr[MT][4];
  // Multiplies chunk c (loaded in st) into part; FIRST: part starts at zero; LAST: part goes
  // into acc (with its scale, from st).
  auto compute = [&](int64_t c, const Stage& st, auto first, auto last) {
    constexpr bool FIRST = decltype(first)::value, LAST = decltype(last)::value;
    uint4 xl[MT][XU];
    if constexpr (!XPF) load_x(c, xl);
    const uint4(*xc)[XU] = XPF ? st.x : xl;
    const bool fold = p.mode == 2;
    // x as B fragments, once per chunk for all RT weight tiles: [j][t][mt] for int4
    // (prmt into the permuted k order), [j][mt] for int8 (the words as they are, or with
    // SPLIT8 in dq8_bf16_split's pair order).
    constexpr int NB = BITS == 4 ? 2 * WW : WW;
    uint32_t bx[NB][MT][2];
#pragma unroll
    for (int j = 0; j < WW; ++j)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (BITS == 4) {
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            halves_paired(word_of(xc[mt][j], t), word_of(xc[mt][j], t + 2), bx[2 * j + t][mt]);
          }
        } else if constexpr (SPLIT8) {  // pairs (k, k + 2) and (k + 1, k + 3)
          halves_paired(word_of(xc[mt][j / 2], 2 * (j % 2)), word_of(xc[mt][j / 2], 2 * (j % 2) + 1),
                        bx[j][mt]);
        } else {
          bx[j][mt][0] = word_of(xc[mt][j / 2], 2 * (j % 2));
          bx[j][mt][1] = word_of(xc[mt][j / 2], 2 * (j % 2) + 1);
        }
      }
    // OFFSET: the chunk's OFF . x, the same for every weight row (A = OFF everywhere).
    // At M <= 8 (MT = 1) and on half chunks it is accumulated in the k loop below, next to
    // the weight tiles' MMAs, as a third chain to interleave with theirs (4-7% faster, run
    // 31); on whole chunks at MT = 2 that needs more registers than the kernel has, so there
    // it is computed first.
    constexpr bool CORR_IN_LOOP = OFFSET && (MT == 1 || HALF);
    const uint32_t off[4] = {dq4_offset_pair<T>(), dq4_offset_pair<T>(), dq4_offset_pair<T>(),
                             dq4_offset_pair<T>()};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (FIRST)
#pragma unroll
        for (int r = 0; r < 4; ++r) corr[mt][r] = 0.f;
      if constexpr (OFFSET && !CORR_IN_LOOP)
#pragma unroll
        for (int i = 0; i < NB; ++i) mma_16816<T>(corr[mt], off, bx[i][mt]);
    }
    // Scales converted here, a chunk after their loads were issued (see ldg_scale_if). In
    // pairs, the second chunk of a pair's (both share them).
    float sf[RT][2];
    uint32_t sfold[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sf[rt][h] = p.mode == 0 || !LAST ? 1.f : scale_from_bits<S>(st.s[rt][h]);
        sfold[rt][h] = fold ? pack2<T>(sf[rt][h], sf[rt][h]) : 0u;
      }
    // k outer, weight tiles inner: the RT accumulation chains of dependent MMAs interleave.
    if constexpr (FIRST)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) part[rt][mt][r] = 0.f;
#pragma unroll
    for (int j = 0; j < WW; ++j) {
      if constexpr (BITS == 4) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          if constexpr (CORR_IN_LOOP)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16816<T>(corr[mt], off, bx[2 * j + t][mt]);
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            const uint32_t w0 = st.w[rt][0][j], w1 = st.w[rt][1][j];
            uint32_t a[4];
            if constexpr (OFFSET) {
              a[0] = dq4_offset<T>(w0, 2 * t);
              a[1] = dq4_offset<T>(w1, 2 * t);
              a[2] = dq4_offset<T>(w0, 2 * t + 1);
              a[3] = dq4_offset<T>(w1, 2 * t + 1);
            } else {
              a[0] = dq4<T>(w0, 2 * t);
              a[1] = dq4<T>(w1, 2 * t);
              a[2] = dq4<T>(w0, 2 * t + 1);
              a[3] = dq4<T>(w1, 2 * t + 1);
              if (fold) {
                a[0] = mul2<T>(a[0], sfold[rt][0]);
                a[2] = mul2<T>(a[2], sfold[rt][0]);
                a[1] = mul2<T>(a[1], sfold[rt][1]);
                a[3] = mul2<T>(a[3], sfold[rt][1]);
              }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16816<T>(part[rt][mt], a, bx[2 * j + t][mt]);
          }
        }
      } else {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const uint32_t w0 = st.w[rt][0][j], w1 = st.w[rt][1][j];
          uint32_t a[4];
          if constexpr (SPLIT8) {
            a[0] = dq8_bf16_split(w0, 0);
            a[1] = dq8_bf16_split(w1, 0);
            a[2] = dq8_bf16_split(w0, 1);
            a[3] = dq8_bf16_split(w1, 1);
          } else {
            a[0] = dq8<T>(w0, 0);
            a[1] = dq8<T>(w1, 0);
            a[2] = dq8<T>(w0, 1);
            a[3] = dq8<T>(w1, 1);
          }
          if (fold) {
            a[0] = mul2<T>(a[0], sfold[rt][0]);
            a[2] = mul2<T>(a[2], sfold[rt][0]);
            a[1] = mul2<T>(a[1], sfold[rt][1]);
            a[3] = mul2<T>(a[3], sfold[rt][1]);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_16816<T>(part[rt][mt], a, bx[j][mt]);
        }
      }
    }
    // The tail inside the if (not after a return in the other branch): nvcc warned "loop is
    // not reachable" for every instantiation without LAST.
    if constexpr (LAST) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        if constexpr (OFFSET)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) part[rt][mt][r] -= corr[mt][r];
        const float f0 = p.mode == 1 ? sf[rt][0] : 1.f, f1 = p.mode == 1 ? sf[rt][1] : 1.f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          acc[rt][mt][0] = fmaf(f0, part[rt][mt][0], acc[rt][mt][0]);
          acc[rt][mt][1] = fmaf(f0, part[rt][mt][1], acc[rt][mt][1]);
          acc[rt][mt][2] = fmaf(f1, part[rt][mt][2], acc[rt][mt][2]);
          acc[rt][mt][3] = fmaf(f1, part[rt][mt][3], acc[rt][mt][3]);
        }
      }
    }
  };

  using kw_t = std::integral_constant<int, KW>;
  constexpr std::true_type yes{};
  constexpr std::false_type no{};
  // Each loop runs while the next load exists; the last chunk (or round) is peeled out
  // after it, so the loop body holds no test around its loads. That takes 10-30 of its
  // instructions (the branch, the pointer copies it needed) from the pair, int8 and one-tile
  // int4 loops (sm_90a; bench/GPU_NOTES.md, run 79). The two-tile int4 loops without pairs
  // keep the test: peeled, ptxas spills 80-300 bytes there.
  int64_t c = CP * warp;
  if constexpr (PAIR) {
    // Pairs: the first chunk of each in sa, the second in sb (K is a multiple of a whole
    // chunk, so every pair is complete). The loads stay one chunk ahead of the MMAs.
    Stage sa, sb;
    if (c < nchunks) {
      load(c, sa, std::integral_constant<int, 1>{}, no);
      for (; c + 2 * KW < nchunks; c += 2 * KW) {
        load(c + 1, sb, std::integral_constant<int, 2 * KW - 1>{}, yes);
        compute(c, sa, yes, no);
        load(c + 2 * KW, sa, std::integral_constant<int, 1>{}, no);
        compute(c + 1, sb, no, yes);
      }
      load(c + 1, sb, std::integral_constant<int, 2 * KW - 1>{}, yes);
      compute(c, sa, yes, no);
      compute(c + 1, sb, no, yes);
    }
  } else if constexpr (BITS == 4) {
    // Two stages used in turn (the loop body is written out twice), so that the stage being
    // loaded is never copied into the one being computed: the copy cost ~40 moves per
    // chunk, and int4 runs 8-22% faster without it (bench/GPU_NOTES.md, run 28).
    Stage sa, sb;
    if constexpr (MT > 1) {
      if (c < nchunks) load(c, sa, kw_t{}, yes);
      while (c < nchunks) {
        if (c + KW < nchunks) load(c + KW, sb, kw_t{}, yes);
        compute(c, sa, yes, yes);
        c += KW;
        if (c >= nchunks) break;
        if (c + KW < nchunks) load(c + KW, sa, kw_t{}, yes);
        compute(c, sb, yes, yes);
        c += KW;
      }
    } else if (c < nchunks) {
      load(c, sa, kw_t{}, yes);
      for (; c + 2 * KW < nchunks; c += 2 * KW) {
        load(c + KW, sb, kw_t{}, yes);
        compute(c, sa, yes, yes);
        load(c + 2 * KW, sa, kw_t{}, yes);
        compute(c + KW, sb, yes, yes);
      }
      if (c + KW < nchunks) {
        load(c + KW, sb, kw_t{}, yes);
        compute(c, sa, yes, yes);
        compute(c + KW, sb, yes, yes);
      } else {
        compute(c, sa, yes, yes);
      }
    }
  } else {
    // int8 keeps one loop body and copies the next stage: with the two stages in turn its
    // per-channel kernel was 2-7% slower (run 28).
    Stage next;
    if (c < nchunks) {
      load(c, next, kw_t{}, yes);
      for (; c + KW < nchunks; c += KW) {
        const Stage cur = next;
        load(c + KW, next, kw_t{}, yes);
        compute(c, cur, yes, yes);
      }
      compute(c, next, yes, yes);
    }
  }

#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[warp][(rt * MT + mt) * 4 + r][lane] = acc[rt][mt][r];
  __syncthreads();
  for (int e = threadIdx.x; e < NACC * 32; e += tcv::THREADS) {
    const int i = e / 32, ln = e % 32;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) v += red[w][i][ln];
    const int rt = i / (MT * 4), mt = (i / 4) % MT, r = i % 4;
    const int64_t n = n0 + rt * 16 + (ln >> 2) + 8 * (r >> 1);
    const int m = r0 + mt * 8 + 2 * (ln & 3) + (r & 1);
    if (n < p.N && m < p.M) {
      if (p.mode == 0) v *= to_f32(static_cast<const S*>(p.scales)[n * p.s_rs]);
      if (p.bias) v += to_f32(static_cast<const T*>(p.bias)[n * p.bias_stride]);
      static_cast<T*>(p.y)[m * p.y_rs + n * p.y_cs] = from_f32<T>(apply_act(v, p.act));
    }
  }
  if (p.pdl == 2) grid_wait_prerequisites();
}

// One gemv_tc_kernel launch; with p.pdl == 2 a programmatic dependent launch, which may
// start while the launch before it in the stream runs (that one set p.pdl = 1). Where the
// driver refuses the attribute, a plain launch.
inline void tc_launch(void (*kernel)(TcvParams), unsigned blocks, const TcvParams& p, cudaStream_t stream) {
  if (p.pdl == 2) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(tcv::THREADS);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, p) == cudaSuccess) return;
    cudaGetLastError();
  }
  kernel<<<blocks, tcv::THREADS, 0, stream>>>(p);
}

// The two-tile kernels (M > 8): whole chunks, half chunks or half chunks in pairs, offset
// form or not.
template <typename T, typename S, int BITS, bool SLICED>
void launch_gemv_tc2(const TcvParams& p, bool offset, unsigned nb, cudaStream_t stream) {
  if (p.half) {
    if (offset && p.pair)
      tc_launch(gemv_tc_kernel<T, S, 4, 2, true, true, SLICED, tcv::RT, true>, nb, p, stream);
    else if (offset)
      tc_launch(gemv_tc_kernel<T, S, 4, 2, true, true, SLICED>, nb, p, stream);
    else
      tc_launch(gemv_tc_kernel<T, S, 4, 2, false, true, SLICED>, nb, p, stream);
  } else {
    if (offset)
      tc_launch(gemv_tc_kernel<T, S, BITS, 2, BITS == 4, false, SLICED>, nb, p, stream);
    else
      tc_launch(gemv_tc_kernel<T, S, BITS, 2, false, false, SLICED>, nb, p, stream);
  }
}

// Launches gemv_tc_kernel over p.N rows (a multiple of tcv::ROWS, or of tcv::FOUR_ROWS where
// tcv_four) and p.slices slices of x.
template <typename T, typename S, int BITS>
Status launch_gemv_tc(const TcvParams& p, cudaStream_t stream) {
  const int64_t blocks = p.N / tcv::ROWS * p.slices;
  if (blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
  const unsigned nb = static_cast<unsigned>(blocks);
  // int4 with whole-chunk scales (per channel or groups of >= 128): the offset form.
  const bool offset = BITS == 4 && p.mode != 2;
  if constexpr (BITS == 8) {  // tcv_four: no int4 kernel with four x tiles is built
    if (tcv_four<BITS>(p.M)) {
      const int64_t four_blocks = p.N / tcv::FOUR_ROWS * p.slices;
      if (four_blocks > 0x7fffffff) return status_from(cudaErrorInvalidConfiguration);
      const unsigned fb = static_cast<unsigned>(four_blocks);
      if (p.slices == 1)
        tc_launch(gemv_tc_kernel<T, S, BITS, 4, false, false, false, tcv::FOUR_RT>, fb, p, stream);
      else
        tc_launch(gemv_tc_kernel<T, S, BITS, 4, false, false, true, tcv::FOUR_RT>, fb, p, stream);
      return launch_status();
    }
  }
  if (p.M <= 8) {
    if (offset) tc_launch(gemv_tc_kernel<T, S, BITS, 1, BITS == 4, false>, nb, p, stream);
    else tc_launch(gemv_tc_kernel<T, S, BITS, 1, false, false>, nb, p, stream);
  } else if (p.slices == 1) {
    launch_gemv_tc2<T, S, BITS, false>(p, offset, nb, stream);
  } else if constexpr (BITS == 4) {  // int8 takes every M > 16 above (tcv_four)
    launch_gemv_tc2<T, S, BITS, true>(p, offset, nb, stream);
  }
  return launch_status();
}

template <typename T, int BITS>
Status launch_gemv_tc(const TcvParams& p, DType scales, cudaStream_t stream) {
  switch (scales) {
    case DType::f16:
      return launch_gemv_tc<T, __half, BITS>(p, stream);
    case DType::bf16:
      return launch_gemv_tc<T, __nv_bfloat16, BITS>(p, stream);
    default:
      return launch_gemv_tc<T, float, BITS>(p, stream);
  }
}

static QuantParams quant_params(const MixedLinearArgs& args) {
  QuantParams qp;
  qp.q = static_cast<const uint8_t*>(args.w.data);
  qp.q_rs = args.w.row_stride;
  qp.bits = args.w.bits;
  qp.gs = args.w.group_size;
  qp.scales = args.w.scales;
  qp.s_rs = args.w.scales_row_stride;
  qp.s_dt = static_cast<int>(args.w.scales_dtype);
  qp.N = args.w.n;
  qp.K = args.x.cols;
  qp.wfast = 0;
  qp.uniform = 0;
  return qp;
}

// The small-M kernels take up to GEMV_MAX_M rows of x in one pass. With the tensor-core
// GEMV's preconditions, up to GEMV_SLICED_MAX_M rows run as slices in one launch
// (gemv_tc_kernel: int4 in slices of 16 rows, int8 in slices of 32 with four x tiles),
// whatever the weight's size. On the H200 (bench/GPU_NOTES.md, run 59) that beat
// dequantise + cuBLAS (1.30-3.0x the GEMV's time replayed) and this file's mma.sync GEMM (1.5-18x)
// on every case of issue 7's shapes at M = 17..64. Only the sm_90 CUTLASS GEMM outruns it,
// on large weights (runs 55 and 57): mixed_linear_path (the torch binding, the DLPack door)
// takes that one where mixed_linear_sm90_preferred says so.
constexpr int64_t GEMV_MAX_M = 16;
constexpr int64_t GEMV_SLICED_MAX_M = 64;

// The SIMT GEMV (M <= 16; more rows in slices of 16).
static Status gemv_simt(const MixedLinearArgs& args, cudaStream_t stream) {
  GemvParams p;
  p.w = quant_params(args);
  const int64_t xb = static_cast<int64_t>(dtype_size(args.x.dtype));
  p.x = args.x.data;
  p.x_rs = args.x.row_stride;
  p.x_cs = args.x.col_stride;
  p.x_dt = static_cast<int>(args.x.dtype);
  p.bias = args.bias;
  p.bias_stride = args.bias_stride;
  p.y = args.y.data;
  p.y_rs = args.y.row_stride;
  p.y_cs = args.y.col_stride;
  p.act = static_cast<int>(args.activation);
  // M > 16 (fewer weight rows than a block of the sliced tensor-core GEMV): one launch per
  // 16 rows of x.
  for (int64_t r0 = 0; r0 < args.x.rows; r0 += GEMV_MAX_M) {
    GemvParams ps = p;
    ps.x = static_cast<const char*>(args.x.data) + r0 * args.x.row_stride * xb;
    ps.y = static_cast<char*>(p.y) + r0 * args.y.row_stride * xb;
    ps.M = static_cast<int>(std::min<int64_t>(GEMV_MAX_M, args.x.rows - r0));
    const Status st = p.w.bits == 8 ? gemv_dispatch<8>(ps, stream) : gemv_dispatch<4>(ps, stream);
    if (!st.ok()) return st;
  }
  return Status{};
}

// The tensor-core GEMV's preconditions (else the SIMT GEMV): f16/bf16 x with unit column
// stride and 16-byte aligned rows, 16-byte aligned weight rows, K a multiple of the chunk,
// group size a multiple of the 16-byte piece, at most 2^30 and at most 2^28 groups a row
// (the kernel's 32-bit group counters).
template <int BITS>
bool gemv_tc_ok(const MixedLinearArgs& a) {
  using Cfg = TcvCfg<BITS>;  // its chunk and piece are multiples of the half ones
  const ConstMatrix& x = a.x;
  if (x.dtype != DType::f16 && x.dtype != DType::bf16) return false;
  if (x.cols % Cfg::CHUNK != 0) return false;
  if (a.w.group_size != 0 && a.w.group_size % Cfg::LK != 0) return false;
  // 32-bit group counters and byte offsets within a scale row.
  if (a.w.group_size > (int64_t(1) << 30) || (a.w.group_size && x.cols / a.w.group_size > (1 << 28)))
    return false;
  if (!aligned_to(a.w.data, 16) || a.w.row_stride % 16 != 0) return false;
  if (x.cols > 0 && (x.col_stride != 1 || !aligned_to(x.data, 16))) return false;
  if (x.rows > 1 && x.row_stride % 8 != 0) return false;
  return true;
}

template <int BITS>
Status gemv_tc_dispatch(const MixedLinearArgs& a, cudaStream_t stream) {
  TcvParams p;
  p.half = BITS == 4 && tcv_half(a.x.rows, a.x.cols, a.w.group_size);
  const int64_t chunk = p.half ? TcvCfg<BITS, true>::CHUNK : TcvCfg<BITS>::CHUNK;
  p.x = a.x.data;
  p.x_rs = a.x.row_stride;
  p.q = static_cast<const uint8_t*>(a.w.data);
  p.q_rs = a.w.row_stride;
  p.scales = a.w.scales;
  p.s_rs = a.w.scales_row_stride;
  const int s_shift = dtype_size(a.w.scales_dtype) == 4 ? 2 : 1;
  p.gs = a.w.group_size;
  p.mode = p.gs == 0 ? 0 : (p.gs % chunk == 0 ? 1 : 2);
  if (p.gs == 0) p.gs = 1;  // unused; keeps the division defined
  p.q_rs8 = 8 * p.q_rs;
  p.s_rs8 = (8 * p.s_rs) << s_shift;
  p.gs32 = static_cast<int>(p.gs);
  // The k between two loads of the scales by a warp: KW chunks, or KW pairs (tcv_pair).
  p.pair = p.half && tcv_pair(a.w.group_size);
  const int64_t step = tcv::KW * (p.pair ? 2 * chunk : chunk);
  p.gstep = static_cast<int>(step / p.gs);
  p.grstep = static_cast<int>(step - p.gstep * p.gs);
  p.bias = a.bias;
  p.bias_stride = a.bias_stride;
  p.y = a.y.data;
  p.y_rs = a.y.row_stride;
  p.y_cs = a.y.col_stride;
  // Whole blocks of rows, so that the kernel carries no row bounds; fewer rows than a block
  // take the SIMT GEMV.
  const bool four = tcv_four<BITS>(a.x.rows);
  const int64_t rows = four ? tcv::FOUR_ROWS : tcv::ROWS;
  if (a.w.n < rows) return gemv_simt(a, stream);
  p.N = a.w.n / rows * rows;
  p.K = a.x.cols;
  p.M = static_cast<int>(a.x.rows);
  p.act = static_cast<int>(a.activation);
  // slices of 8 MT rows of x, as gemv_tc_kernel takes them (MT = 4 with tcv_four, else 2)
  p.slices = static_cast<int>(ceil_div(a.x.rows, four ? 2 * GEMV_MAX_M : GEMV_MAX_M));
  // The last rows' launch overlaps this one where the device can (see below).
  const bool overlap = p.N != a.w.n && current_device_overlaps_launches();
  p.pdl = overlap ? 1 : 0;
  auto launch = [&](const TcvParams& q) {
    return a.x.dtype == DType::f16 ? launch_gemv_tc<__half, BITS>(q, a.w.scales_dtype, stream)
                                   : launch_gemv_tc<__nv_bfloat16, BITS>(q, a.w.scales_dtype, stream);
  };
  const Status st = launch(p);
  if (!st.ok() || p.N == a.w.n) return st;
  // The last N % rows rows: the same kernel once more, over the whole block of rows that ends
  // at row N (it shares rows with the last block above, which get the same values: the same
  // MMAs in the same order). A second launch rather than a moved last block in the first:
  // any block-dependent row start put the whole-chunk int4 kernels at the register cap to
  // 24-48 bytes of spills and 1.04-1.10x the time at K = 28672, M = 9..16 (run 62b). The
  // SIMT GEMV took these rows until run 62: its one block walked all of K for them, and
  // (K, N) = (8192, 8196) int4 g128 at M = 48 took 527 us against bf16 F.linear's 54 (run 61b).
  // On sm_90 the second launch runs beside the first (programmatic dependent launch): its
  // one block walks K while the whole blocks do, instead of after them; 0.56-0.95x the time
  // of the launches one after the other, 8192 x 8196 int4 g128 M = 16 34.1 -> 21.0 us
  // (bench/GPU_NOTES.md, run 67).
  const int64_t n0 = a.w.n - rows, tb = static_cast<int64_t>(dtype_size(a.x.dtype));
  TcvParams t = p;
  t.q += n0 * p.q_rs;
  t.scales = static_cast<const char*>(p.scales) + n0 * p.s_rs * static_cast<int64_t>(dtype_size(a.w.scales_dtype));
  if (p.bias) t.bias = static_cast<const char*>(p.bias) + n0 * p.bias_stride * tb;
  t.y = static_cast<char*>(p.y) + n0 * p.y_cs * tb;
  t.N = rows;
  t.pdl = overlap ? 2 : 0;
  return launch(t);
}

}  // namespace detail

namespace {
using namespace detail;

template <typename T>
Status mixed_tc(const MixedLinearArgs& args, QuantParams qp, const Epilogue& ep,
                cudaStream_t stream) {
  const ConstMatrix& x = args.x;
  typename TcALoader<T>::Params ap;
  ap.data = static_cast<const T*>(x.data);
  ap.so = x.row_stride;
  ap.si = x.col_stride;
  ap.olim = ep.M;
  ap.ilim = ep.K;
  ap.fast = x.col_stride == 1 && x.row_stride % 8 == 0 && aligned_to(x.data, 16);
  ap.inner_fast = x.col_stride <= x.row_stride;
  qp.uniform = qp.gs == 0 || qp.gs % 16 == 0;  // 16-value chunks start at multiples of 16
  qp.wfast = qp.bits == 8 ? (aligned_to(qp.q, 16) && qp.q_rs % 16 == 0)
                          : (aligned_to(qp.q, 8) && qp.q_rs % 8 == 0);
  return launch_tc_gemm<T, true, TcDequantLoader<T>>(ap, qp, ep, stream);
}

}  // namespace

bool mixed_linear_small_m(const MixedLinearArgs& args) {
  const int64_t M = args.x.rows;
  if (M <= GEMV_MAX_M) return true;
  const int bits = args.w.bits;
  if (M > GEMV_SLICED_MAX_M || (bits != 4 && bits != 8)) return false;
  return bits == 4 ? gemv_tc_ok<4>(args) : gemv_tc_ok<8>(args);
}

Status mixed_linear(const MixedLinearArgs& args, void* stream_ptr) {
  const Status v = validate_mixed_linear(args);
  if (!v.ok()) return v;
  const int64_t M = args.x.rows, K = args.x.cols, N = args.w.n;
  if (M <= 0 || N <= 0) return Status{};  // nothing to write
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  QuantParams qp = quant_params(args);
  if (qp.bits != 8 && qp.bits != 4)
    return Status{static_cast<int32_t>(cudaErrorInvalidValue),
                  "portable_gemm.cuda.mixed_linear: bits must be 4 or 8"};

  if (mixed_linear_small_m(args)) {
    if (qp.bits == 4 ? gemv_tc_ok<4>(args) : gemv_tc_ok<8>(args))
      return qp.bits == 4 ? gemv_tc_dispatch<4>(args, stream) : gemv_tc_dispatch<8>(args, stream);
    return gemv_simt(args, stream);
  }

  Epilogue ep;
  ep.c = args.y.data;
  ep.c_rs = args.y.row_stride;
  ep.c_cs = args.y.col_stride;
  ep.bias = args.bias;
  ep.bias_stride = args.bias_stride;
  ep.M = M;
  ep.N = N;
  ep.K = K;
  ep.act = static_cast<int>(args.activation);
  switch (args.x.dtype) {
    case DType::f16:
      return mixed_tc<__half>(args, qp, ep, stream);
    case DType::bf16:
      return mixed_tc<__nv_bfloat16>(args, qp, ep, stream);
    case DType::f32: {
      SimtStrided a{static_cast<const float*>(args.x.data), args.x.row_stride,
                    args.x.col_stride, M, K};
      return launch_simt_gemm<SimtDequantLoader>(a, qp, ep, stream);
    }
    default:
      return Status{static_cast<int32_t>(cudaErrorInvalidValue),
                    "portable_gemm.cuda.mixed_linear: x dtype must be f32, f16 or bf16"};
  }
}

}  // namespace cuda
}  // namespace portable_gemm
