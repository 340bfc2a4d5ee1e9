// Dense GEMM on the CPU: c = act(a @ b + bias).
//
// Goto/BLIS structure. Per task (a block of rows x columns of C):
//   jc: columns in blocks of nc          B panel (kc x nc, packed fp32) stays in L2
//    mo: rows in chunks of mch           bounds the fp32 accumulation workspace
//     pc: K in blocks of kc              packing converts f16/bf16 to fp32 once
//      ir: rows in slivers of MR         A sliver (kc x MR) stays in L1
//       jr: columns in slivers of NR     B slivers stream from L2 into the micro-kernel
// The micro-kernel keeps an MR x NR block of C in registers for a whole kc block. When
// K needs several kc blocks, partial sums live in a per-thread fp32 workspace; the last
// block's micro-kernel writes to a stack tile and the epilogue (bias, activation,
// rounding to the output dtype, arbitrary output strides) runs on it while it is hot.
// Rows beyond M and columns beyond N are zero-padded in the packed panels, so a
// micro-kernel only needs to know how many rows (1..MR) it computes.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "cpu/common.h"

#if PG_X86
#include <immintrin.h>
#endif

namespace portable_gemm {
namespace cpu {

// ---- ISA choice -------------------------------------------------------------------

namespace {

Isa detect_isa() {
  Isa best = Isa::generic;
#if PG_X86
  __builtin_cpu_init();
  // F16C is not queried: every AVX2 and AVX-512 CPU has it (and GCC 12 cannot ask).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::avx2;
  if (best == Isa::avx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = Isa::avx512;
#endif
  if (const char* env = std::getenv("PORTABLE_GEMM_ISA")) {
    Isa want = best;
    if (std::strcmp(env, "generic") == 0) want = Isa::generic;
    else if (std::strcmp(env, "avx2") == 0) want = Isa::avx2;
    else if (std::strcmp(env, "avx512") == 0) want = Isa::avx512;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* isa() {
  switch (active_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

// ---- scratch ------------------------------------------------------------------------

namespace {
struct AlignedFree {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
struct ScratchSlot {
  std::unique_ptr<float[], AlignedFree> ptr;
  size_t size = 0;
};
constexpr int kScratchSlots = 6;
thread_local ScratchSlot t_scratch[kScratchSlots];
}  // namespace

float* scratch(int slot, size_t floats) {
  ScratchSlot& s = t_scratch[slot];
  if (s.size < floats) {
    // Grow geometrically so that a sweep of slowly growing shapes does not reallocate on
    // every call; the extra 16 floats let vector code over-read a row end safely.
    size_t want = std::max(floats, s.size + s.size / 2) + 16;
    s.ptr.reset(static_cast<float*>(::operator new[](want * sizeof(float), std::align_val_t(64))));
    s.size = want - 16;
  }
  return s.ptr.get();
}

// ---- conversion ------------------------------------------------------------------------

namespace {

#if PG_X86
PG_TARGET_AVX2 void convert_f16_contig_avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = f16_to_f32(s[i]);
}
#endif

}  // namespace

void convert_to_f32(const void* src, int64_t stride, DType t, int64_t n, float* dst) {
  switch (t) {
    case DType::f32: {
      const float* s = static_cast<const float*>(src);
      if (stride == 1) {
        std::memcpy(dst, s, size_t(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = s[i * stride];
      }
      break;
    }
    case DType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      if (stride == 1) {
        for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_f32(uint32_t(s[i]) << 16);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i * stride]);
      }
      break;
    }
    case DType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
#if PG_X86
      if (stride == 1 && active_isa() != Isa::generic) {
        convert_f16_contig_avx2(s, n, dst);
        break;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i * stride]);
      break;
    }
    default:
      break;
  }
}

// ---- epilogue ---------------------------------------------------------------------------

void Epilogue::store(const float* tile, int64_t ldt, int64_t i0, int64_t m, int64_t j0,
                     int64_t n) const {
  constexpr int64_t kChunk = 64;
  alignas(64) float tmp[kChunk];
  const int64_t cs = c.col_stride;
  for (int64_t i = 0; i < m; ++i) {
    const float* src = tile + i * ldt;
    char* row = static_cast<char*>(c.data) + (i0 + i) * c.row_stride * int64_t(dtype_size(c.dtype));
    for (int64_t j = 0; j < n; j += kChunk) {
      const int64_t cnt = std::min(kChunk, n - j);
      const float* v = src + j;
      if (bias != nullptr || act != Activation::none) {
        if (bias != nullptr) {
          const float* bj = bias + j0 + j;
          for (int64_t x = 0; x < cnt; ++x) tmp[x] = v[x] + bj[x];
        } else {
          std::memcpy(tmp, v, size_t(cnt) * sizeof(float));
        }
        switch (act) {
          case Activation::relu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = tmp[x] > 0.f ? tmp[x] : 0.f;
            break;
          case Activation::silu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = activate(tmp[x], Activation::silu);
            break;
          case Activation::gelu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = activate(tmp[x], Activation::gelu);
            break;
          default:
            break;
        }
        v = tmp;
      }
      const int64_t col = j0 + j;
      switch (c.dtype) {
        case DType::f32: {
          float* d = reinterpret_cast<float*>(row) + col * cs;
          if (cs == 1) {
            std::memcpy(d, v, size_t(cnt) * sizeof(float));
          } else {
            for (int64_t x = 0; x < cnt; ++x) d[x * cs] = v[x];
          }
          break;
        }
        case DType::bf16: {
          uint16_t* d = reinterpret_cast<uint16_t*>(row) + col * cs;
          for (int64_t x = 0; x < cnt; ++x) d[x * cs] = f32_to_bf16(v[x]);
          break;
        }
        case DType::f16: {
          uint16_t* d = reinterpret_cast<uint16_t*>(row) + col * cs;
          for (int64_t x = 0; x < cnt; ++x) d[x * cs] = f32_to_f16(v[x]);
          break;
        }
        default:
          break;
      }
    }
  }
}

// ---- micro-kernels -----------------------------------------------------------------------

namespace {

// Computes an M x NR block (M <= MR): out = (in ? in : 0) + A_sliver @ B_sliver, where
// the A sliver is kc x MR (row k at a + k * MR) and the B sliver kc x NR (row k at
// b + k * ldb: ldb = NR when packed, B's row stride when read in place).
using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, int64_t ldb,
                             const float* in, int64_t ldin, float* out, int64_t ldout);

struct KernelSet {
  int mr, nr;
  int64_t kc, nc, mch;  // cache blocking (see the top of the file)
  MicroKernel kern[17];  // kern[m] for m = 1..mr
};

#if defined(__aarch64__)
constexpr int kGenericNR = 16;  // 32 vector registers: 4 x 16 accumulators fit
#else
constexpr int kGenericNR = 8;   // baseline x86-64 has 16 xmm registers
#endif
constexpr int kGenericMR = 4;

template <int M>
void kern_generic(int64_t kc, const float* a, const float* b, int64_t ldb, const float* in,
                  int64_t ldin, float* out, int64_t ldout) {
  constexpr int MR = kGenericMR, NR = kGenericNR;
  float acc[M][NR];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = in ? in[i * ldin + j] : 0.f;
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = b + k * ldb;
    const float* ak = a + k * MR;
    for (int i = 0; i < M; ++i) {
      const float ai = ak[i];
      for (int j = 0; j < NR; ++j) acc[i][j] += ai * bk[j];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldout + j] = acc[i][j];
}

#if PG_X86
// 6 x 16: 12 ymm accumulators + 2 for B + 1 broadcast of the 16 registers.
constexpr int kAvx2MR = 6, kAvx2NR = 16;

template <int M>
PG_TARGET_AVX2 void kern_avx2(int64_t kc, const float* a, const float* b, int64_t ldb,
                              const float* in, int64_t ldin, float* out, int64_t ldout) {
  __m256 c0[M], c1[M];
  PG_UNROLL for (int i = 0; i < M; ++i) {
    if (in) {
      c0[i] = _mm256_loadu_ps(in + i * ldin);
      c1[i] = _mm256_loadu_ps(in + i * ldin + 8);
    } else {
      c0[i] = _mm256_setzero_ps();
      c1[i] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    PG_UNROLL for (int i = 0; i < M; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + i);
      c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
    }
    a += kAvx2MR;
    b += ldb;
  }
  PG_UNROLL for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * ldout, c0[i]);
    _mm256_storeu_ps(out + i * ldout + 8, c1[i]);
  }
}

// 12 x 32: 24 zmm accumulators; B rows are two full vectors, A values are broadcast
// straight from memory (the FMA's embedded broadcast), so 26 of 32 registers are live.
constexpr int kAvx512MR = 12, kAvx512NR = 32;

template <int M>
PG_TARGET_AVX512 void kern_avx512(int64_t kc, const float* a, const float* b, int64_t ldb,
                                  const float* in, int64_t ldin, float* out, int64_t ldout) {
  __m512 c0[M], c1[M];
  PG_UNROLL for (int i = 0; i < M; ++i) {
    if (in) {
      c0[i] = _mm512_loadu_ps(in + i * ldin);
      c1[i] = _mm512_loadu_ps(in + i * ldin + 16);
    } else {
      c0[i] = _mm512_setzero_ps();
      c1[i] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    PG_UNROLL for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
    }
    a += kAvx512MR;
    b += ldb;
  }
  PG_UNROLL for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(out + i * ldout, c0[i]);
    _mm512_storeu_ps(out + i * ldout + 16, c1[i]);
  }
}
#endif

const KernelSet& kernel_set() {
  static const KernelSet set = [] {
    KernelSet s{};
#if PG_X86
    if (active_isa() == Isa::avx512) {
      s.mr = kAvx512MR;
      s.nr = kAvx512NR;
      s.kc = 384;
      s.nc = 512;
      s.mch = 480;
      s.kern[1] = kern_avx512<1>; s.kern[2] = kern_avx512<2>; s.kern[3] = kern_avx512<3>;
      s.kern[4] = kern_avx512<4>; s.kern[5] = kern_avx512<5>; s.kern[6] = kern_avx512<6>;
      s.kern[7] = kern_avx512<7>; s.kern[8] = kern_avx512<8>; s.kern[9] = kern_avx512<9>;
      s.kern[10] = kern_avx512<10>; s.kern[11] = kern_avx512<11>; s.kern[12] = kern_avx512<12>;
      return s;
    }
    if (active_isa() == Isa::avx2) {
      s.mr = kAvx2MR;
      s.nr = kAvx2NR;
      s.kc = 384;
      s.nc = 512;
      s.mch = 480;
      s.kern[1] = kern_avx2<1>; s.kern[2] = kern_avx2<2>; s.kern[3] = kern_avx2<3>;
      s.kern[4] = kern_avx2<4>; s.kern[5] = kern_avx2<5>; s.kern[6] = kern_avx2<6>;
      return s;
    }
#endif
    s.mr = kGenericMR;
    s.nr = kGenericNR;
    s.kc = 256;
    s.nc = 256;
    s.mch = 256;
    s.kern[1] = kern_generic<1>; s.kern[2] = kern_generic<2>;
    s.kern[3] = kern_generic<3>; s.kern[4] = kern_generic<4>;
    return s;
  }();
  return set;
}

// ---- packing ---------------------------------------------------------------------------

// A(i0 .. i0+mc, k0 .. k0+kc) -> slivers of kc x mr (row k of sliver s at
// dst[(s * kc + k) * mr]), rows past mc zero.
void pack_a(const ConstMatrix& a, int64_t i0, int64_t mc, int64_t k0, int64_t kc, int mr,
            float* dst) {
  const int64_t es = int64_t(dtype_size(a.dtype));
  const char* base = static_cast<const char*>(a.data);
  const bool k_major = a.row_stride == 1 && a.col_stride != 1;  // e.g. a transposed view
  float* row = scratch(5, size_t(std::max<int64_t>(kc, mr)));
  for (int64_t s = 0; s * mr < mc; ++s) {
    float* d = dst + s * kc * mr;
    const int64_t rows = std::min<int64_t>(mr, mc - s * mr);
    const int64_t r0 = i0 + s * mr;
    if (k_major) {
      for (int64_t k = 0; k < kc; ++k) {
        convert_to_f32(base + ((k0 + k) * a.col_stride + r0) * es, 1, a.dtype, rows, d + k * mr);
        for (int64_t i = rows; i < mr; ++i) d[k * mr + i] = 0.f;
      }
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        convert_to_f32(base + ((r0 + i) * a.row_stride + k0 * a.col_stride) * es, a.col_stride,
                       a.dtype, kc, row);
        for (int64_t k = 0; k < kc; ++k) d[k * mr + i] = row[k];
      }
      for (int64_t i = rows; i < mr; ++i)
        for (int64_t k = 0; k < kc; ++k) d[k * mr + i] = 0.f;
    }
  }
}

// PackB for a dense strided B.
void pack_b_dense(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                  float* dst) {
  const ConstMatrix& b = *static_cast<const ConstMatrix*>(ctx);
  const int64_t es = int64_t(dtype_size(b.dtype));
  const char* base = static_cast<const char*>(b.data);
  const bool k_major = b.row_stride == 1 && b.col_stride != 1;  // e.g. nn.Linear weight^T
  float* col = scratch(5, size_t(kc));
  for (int64_t s = 0; s * nr < nc; ++s) {
    float* d = dst + s * kc * nr;
    const int64_t cols = std::min<int64_t>(nr, nc - s * nr);
    const int64_t c0 = n0 + s * nr;
    if (!k_major) {
      for (int64_t k = 0; k < kc; ++k) {
        convert_to_f32(base + ((k0 + k) * b.row_stride + c0 * b.col_stride) * es, b.col_stride,
                       b.dtype, cols, d + k * nr);
        for (int64_t j = cols; j < nr; ++j) d[k * nr + j] = 0.f;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        convert_to_f32(base + (k0 + (c0 + j) * b.col_stride) * es, 1, b.dtype, kc, col);
        for (int64_t k = 0; k < kc; ++k) d[k * nr + j] = col[k];
      }
      for (int64_t j = cols; j < nr; ++j)
        for (int64_t k = 0; k < kc; ++k) d[k * nr + j] = 0.f;
    }
  }
}

// ---- driver ------------------------------------------------------------------------------

struct DenseJob {
  const DenseProblem* p;
  const KernelSet* ks;
  Epilogue ep;
  int64_t tm, tn;            // task grid
  int64_t m_units, n_units;  // rows / columns in units of mr / nr
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void run_block(const DenseJob& job, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi) {
  const DenseProblem& p = *job.p;
  const KernelSet& ks = *job.ks;
  const int mr = ks.mr, nr = ks.nr;
  const int64_t K = p.k;
  // Even kc blocks: a K of 400 becomes 2 x 200, not 384 + 16.
  const int64_t npc = (K + ks.kc - 1) / ks.kc;
  const int64_t kcb = round_up((K + npc - 1) / npc, 4);
  const int64_t ncb = std::min(ks.nc, round_up(n_hi - n_lo, nr));
  const int64_t mchb = std::min(ks.mch, round_up(m_hi - m_lo, mr));
  float* bp = scratch(0, size_t(kcb * ncb));
  float* ap = scratch(1, size_t(kcb * mchb));
  float* ws = npc > 1 ? scratch(2, size_t(mchb * ncb)) : nullptr;
  alignas(64) float tile[16 * 64];
  // With few rows of A, each B element is used by only a few micro-kernel calls, and
  // packing B (a read and a write of all of it) would cost about as much as the GEMM
  // itself: full-width slivers of a row-major fp32 B are then read in place.
  const bool direct_b = p.b_direct != nullptr && m_hi - m_lo <= 3 * int64_t(mr);

  for (int64_t jc = n_lo; jc < n_hi; jc += ncb) {
    const int64_t nc = std::min(ncb, n_hi - jc);
    for (int64_t mo = m_lo; mo < m_hi; mo += mchb) {
      const int64_t mch = std::min(mchb, m_hi - mo);
      for (int64_t pc = 0; pc < K; pc += kcb) {
        const int64_t kc = std::min(kcb, K - pc);
        const bool first = pc == 0, last = pc + kc == K;
        const int64_t n_full = direct_b ? nc / nr * nr : 0;  // slivers read in place
        if (n_full < nc) p.pack_b(p.b_ctx, pc, kc, jc + n_full, nc - n_full, nr, bp + n_full * kc);
        pack_a(p.a, mo, mch, pc, kc, mr, ap);
        for (int64_t ir = 0; ir < mch; ir += mr) {
          const int m = int(std::min<int64_t>(mr, mch - ir));
          const MicroKernel kern = ks.kern[m];
          const float* a_sl = ap + ir * kc;
          for (int64_t jr = 0; jr < nc; jr += nr) {
            const bool in_place = jr < n_full;
            const float* b_sl = in_place ? p.b_direct + pc * p.b_direct_ld + jc + jr : bp + jr * kc;
            const int64_t ldb = in_place ? p.b_direct_ld : nr;
            float* w = ws ? ws + ir * ncb + jr : nullptr;
            if (last) {
              kern(kc, a_sl, b_sl, ldb, first ? nullptr : w, ncb, tile, nr);
              job.ep.store(tile, nr, mo + ir, m, jc + jr, std::min<int64_t>(nr, nc - jr));
            } else {
              kern(kc, a_sl, b_sl, ldb, first ? nullptr : w, ncb, w, ncb);
            }
          }
        }
      }
    }
  }
}

void dense_task(void* ctx, int64_t begin, int64_t end) {
  const DenseJob& job = *static_cast<const DenseJob*>(ctx);
  const DenseProblem& p = *job.p;
  const int mr = job.ks->mr, nr = job.ks->nr;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t ti = t / job.tn, tj = t % job.tn;
    const int64_t m_lo = std::min(p.m, job.m_units * ti / job.tm * mr);
    const int64_t m_hi = std::min(p.m, job.m_units * (ti + 1) / job.tm * mr);
    const int64_t n_lo = std::min(p.n, job.n_units * tj / job.tn * nr);
    const int64_t n_hi = std::min(p.n, job.n_units * (tj + 1) / job.tn * nr);
    if (m_hi > m_lo && n_hi > n_lo) run_block(job, m_lo, m_hi, n_lo, n_hi);
  }
}

// c = act(bias) (or act(0)): the K == 0 case.
void fill_epilogue(const Epilogue& ep, int64_t m, int64_t n) {
  alignas(64) float zeros[256] = {};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; j += 256)
      ep.store(zeros, 0, i, 1, j, std::min<int64_t>(256, n - j));
}

}  // namespace

void dense_gemm(const DenseProblem& p, const Executor& exec) {
  Epilogue ep;
  ep.act = p.act;
  ep.c = p.c;
  if (p.bias != nullptr) {
    // The caller's scratch: workers only read it while the caller waits in parallel_for.
    float* b = scratch(3, size_t(p.n));
    convert_to_f32(p.bias, p.bias_stride, p.c.dtype, p.n, b);
    ep.bias = b;
  }
  if (p.k == 0) {
    fill_epilogue(ep, p.m, p.n);
    return;
  }
  const KernelSet& ks = kernel_set();
  DenseJob job{&p, &ks, ep, 1, 1, (p.m + ks.mr - 1) / ks.mr, (p.n + ks.nr - 1) / ks.nr};
  int64_t threads = exec.num_threads ? exec.num_threads(exec.self) : 1;
  // Below ~0.1 MFLOP a wake-up of the pool costs more than it saves.
  if (double(p.m) * double(p.n) * double(p.k) < 64.0 * 64.0 * 32.0) threads = 1;
  if (threads > 1 && exec.parallel_for != nullptr) {
    // Split N first (each task then packs A on its own, which is cheap next to its
    // share of the FLOPs); split M only when N alone cannot feed every thread.
    job.tn = std::min(threads, job.n_units);
    job.tm = std::min(std::max<int64_t>(1, threads / job.tn), job.m_units);
    exec.parallel_for(exec.self, 0, job.tm * job.tn, 1, dense_task, &job);
  } else {
    dense_task(&job, 0, 1);
  }
}

Status gemm(const GemmArgs& args, const Executor& exec) {
  Status st = validate_gemm(args);
  if (!st.ok()) return st;
  DenseProblem p;
  p.m = args.a.rows;
  p.n = args.b.cols;
  p.k = args.a.cols;
  if (p.m == 0 || p.n == 0) return st;
  p.a = args.a;
  p.pack_b = pack_b_dense;
  p.b_ctx = &args.b;
  if (args.b.dtype == DType::f32 && args.b.col_stride == 1 && p.k > 0) {
    p.b_direct = static_cast<const float*>(args.b.data);
    p.b_direct_ld = args.b.row_stride;
  }
  p.bias = args.bias;
  p.bias_stride = args.bias_stride;
  p.c = args.c;
  p.act = args.activation;
  dense_gemm(p, exec);
  return st;
}

}  // namespace cpu
}  // namespace portable_gemm
