// Private helpers shared by the CPU kernels: scalar dtype conversion, activations, the
// fused epilogue, the run-time ISA choice and the dense GEMM driver that mixed_linear
// reuses for large M. Nothing here is part of the library's ABI.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "portable_gemm/kernels.h"

// PG_PORTABLE_ONLY builds the library as for a CPU without the x86 kernels, which is what
// an aarch64 build compiles (tests/test_kernels_cpu.py builds and runs it that way).
#if !defined(PG_PORTABLE_ONLY) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__))
// x86 kernels are compiled per function with target attributes, so that the library
// itself stays baseline x86-64 and picks an ISA at run time.
#define PG_X86 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's own AVX-512 headers trip -Wmaybe-uninitialized (_mm512_undefined_* is
// "initialised" from itself); the warning is about the header, not about our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define PG_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define PG_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define PG_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PG_TARGET_AMX                                                                    \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "fma,f16c")))
#else
#define PG_X86 0
#endif

#if PG_X86
#include <immintrin.h>
#endif

// For helpers whose loop bounds only become constants in their caller (GCC stops inlining
// once a caller has several instantiations, and the helper then loops on a runtime count).
#if defined(__GNUC__)
#define PG_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PG_ALWAYS_INLINE inline
#endif

#if defined(__clang__)
#define PG_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define PG_UNROLL _Pragma("GCC unroll 32")
#else
#define PG_UNROLL
#endif

namespace portable_gemm {
namespace cpu {

// ---- scalar conversions (bit-exact IEEE, round-to-nearest-even) --------------------

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round half to even; overflow correctly gives inf
  return uint16_t(u >> 16);
}

// The float-arithmetic formulation (after Maratyszcza's FP16 library) handles
// subnormals, overflow and rounding without branches; it relies on IEEE float math,
// which holds as long as the library is not built with -ffast-math.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized));
  return bits_to_f32(result);
}

inline uint16_t f32_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float load_f32(const void* base, int64_t index, DType t) {
  switch (t) {
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[index]);
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(base)[index]);
    default: return static_cast<const float*>(base)[index];
  }
}

inline void store_f32(void* base, int64_t index, DType t, float v) {
  switch (t) {
    case DType::f16: static_cast<uint16_t*>(base)[index] = f32_to_f16(v); break;
    case DType::bf16: static_cast<uint16_t*>(base)[index] = f32_to_bf16(v); break;
    default: static_cast<float*>(base)[index] = v; break;
  }
}

// dst[i] = src[i * stride] as fp32, for n elements; vectorised where the ISA allows.
void convert_to_f32(const void* src, int64_t stride, DType t, int64_t n, float* dst);

// dst[k * ld + r] = row r element k as fp32, for k < kc and r < lanes (<= 16); rows r >=
// nrows are written as 0. rows[r] points at element 0 of a contiguous row of dtype t.
// This is the transposing copy every packing routine needs (rows of a row-major operand
// become the lanes of a sliver); on AVX-512 it runs as in-register 16 x 16 transposes.
void pack_rows_transposed(const void* const* rows, int nrows, DType t, int64_t kc, float* dst,
                          int64_t ld, int lanes);

#if PG_X86
// In-register 16 x 16 transpose: v[r][c] -> v[c][r].
PG_TARGET_AVX512 inline void transpose16_avx512(__m512 v[16]) {
  __m512 t[16], u[16];
  PG_UNROLL for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  PG_UNROLL for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i+3
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  PG_UNROLL for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(u[c], u[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(u[c], u[c + 4], 0xDD);
    t[c + 8] = _mm512_shuffle_f32x4(u[c + 8], u[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(u[c + 8], u[c + 12], 0xDD);
  }
  PG_UNROLL for (int c = 0; c < 8; ++c) {
    v[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
    v[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xDD);
  }
}
#endif

// ---- activation ----------------------------------------------------------------------

inline float activate(float x, Activation a) {
  switch (a) {
    case Activation::relu: return x < 0.f ? 0.f : x;  // NaN stays NaN, as torch.relu
    case Activation::silu: return x / (1.f + std::exp(-x));
    case Activation::gelu: return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f));
    default: return x;
  }
}

// ---- fused epilogue ------------------------------------------------------------------

// Writes c[i0 + i, j0 + j] = act(tile[i * ldt + j] * col_scale[j0 + j] + bias[j0 + j])
// converted to c's dtype, for i < m, j < n. col_scale and bias are fp32 and contiguous
// (bias converted once per call), or null (no scale, no bias).
struct Epilogue {
  const float* col_scale = nullptr;
  const float* bias = nullptr;
  Activation act = Activation::none;
  Matrix c;
  void store(const float* tile, int64_t ldt, int64_t i0, int64_t m, int64_t j0,
             int64_t n) const;
};

// How many threads the executor offers (at least 1; 1 when it cannot run anything in
// parallel).
inline int64_t executor_threads(const Executor& exec) {
  if (exec.parallel_for == nullptr || exec.num_threads == nullptr) return 1;
  const int n = exec.num_threads(exec.self);
  return n < 1 ? 1 : n;
}

// ---- run-time ISA --------------------------------------------------------------------

enum class Isa { generic = 0, avx2 = 1, avx512 = 2 };
// Chosen once: the best the CPU supports, optionally lowered (never raised) with the
// environment variable PORTABLE_GEMM_ISA=generic|avx2|avx512|avx512_bf16|amx for testing
// fallbacks (avx512: no bf16 pair kernels; avx512_bf16: those, but no AMX).
Isa active_isa();

// True when the AMX tile unit (AMX-BF16) is used: the CPU has it, Linux granted this
// process the tile state (asked once), and PORTABLE_GEMM_ISA does not rule it out.
bool amx_supported();
// The tile configuration of every AMX kernel here (tiles 0-7, 16 rows of 64 bytes), loaded
// on / released from the calling thread.
void amx_begin();
void amx_end();
// amx_begin() for the scope (when `on`), amx_end() on the way out, exceptions included: a
// task that throws (bad_alloc from a scratch buffer) must not leave its thread holding the
// tile state.
struct AmxScope {
  bool on;
  explicit AmxScope(bool on_) : on(on_) {
    if (on) amx_begin();
  }
  ~AmxScope() {
    if (on) amx_end();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// ---- dense GEMM driver (gemm.cpp) -------------------------------------------------------

// Writes B(k0 .. k0+kc, n0 .. n0+nc) into dst as ceil(nc / nr) slivers of kc x nr fp32
// (sliver s, row k at dst[(s * kc + k) * nr]), zero-filling columns past nc. This is
// how mixed_linear feeds dequantised weights to the same micro-kernels as gemm.
// True when the bf16 pair (vdpbf16ps) micro-kernels run on this CPU (and are not ruled
// out by PORTABLE_GEMM_ISA).
bool has_bf16_pair_kernels();

// Units of elements k0 .. k0+kc of `lines` strided bf16 lines (line r at base + r *
// line_stride, elements `step` apart) as pairs (k, k + 1) in uint32, transposed into
// dst[p * ld + r]; lines past nlines are 0 (the pair-kernel panel layout, gemm.cpp).
void pack_pairs_transposed(const uint16_t* base, int64_t line_stride, int64_t step, int nlines,
                           int64_t kc, uint32_t* dst, int64_t ld, int lanes);

using PackB = void (*)(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc,
                       int nr, float* dst);

struct DenseProblem {
  int64_t m = 0, n = 0, k = 0;
  ConstMatrix a;                  // m x k, any float dtype and strides
  PackB pack_b = nullptr;         // k x n
  // The same B as bf16 pair units (see gemm.cpp) for the vdpbf16ps kernels, or null.
  // Used, with b_ctx, when A is bf16 and the CPU has AVX512-BF16.
  PackB pack_b_pairs = nullptr;
  const void* b_ctx = nullptr;
  const ConstMatrix* b_matrix = nullptr;  // B itself when it is a dense matrix (gemm)
  // n fp32 factors, one per column of c, applied to a @ B before the bias (mixed_linear's
  // per-channel scales, B then holding the unscaled integers), or null.
  const float* col_scale = nullptr;
  const void* bias = nullptr;     // n elements of c's dtype, or null
  int64_t bias_stride = 1;
  Matrix c;                       // m x n
  Activation act = Activation::none;
};

// c = act(a @ B + bias); assumes validated arguments, m, n > 0. Returns false when a
// scratch buffer could not be allocated (c is then partly written).
bool dense_gemm(const DenseProblem& p, const Executor& exec);

// Executor bodies must not throw and the API never throws; the one exception the kernels
// can meet is std::bad_alloc from a scratch buffer. Task bodies run through guarded(),
// which turns it into a flag the entry point reports as a Status.
template <class F>
void guarded(std::atomic<bool>& failed, F&& f) noexcept {
  try {
    f();
  } catch (...) {
    failed.store(true, std::memory_order_relaxed);
  }
}

// Marks the calling thread as inside a CPU call for its scope, so that
// portable_gemm_release_cpu_scratch leaves its buffers alone; nested scopes count once.
// Every entry point holds one, and run_tasks gives one to every task.
class ScratchUse {
 public:
  ScratchUse() noexcept;
  ~ScratchUse();
  ScratchUse(const ScratchUse&) = delete;
  ScratchUse& operator=(const ScratchUse&) = delete;
};

// exec.parallel_for with each task under a ScratchUse: the one way the kernels run tasks.
void run_tasks(const Executor& exec, int64_t begin, int64_t end, int64_t grain,
               Executor::Body body, void* ctx);

// Reusable per-thread scratch (kernels are called often with similar sizes: avoid the
// page faults of fresh large allocations on every call). Slot selects independent
// buffers; the pointer is 64-byte aligned and valid until the next call with that slot
// on this thread, or until the thread leaves its outermost ScratchUse (a release may then
// free it). Met outside any ScratchUse, it marks the thread busy for good.
float* scratch(int slot, size_t floats);

}  // namespace cpu
}  // namespace portable_gemm
