// Weight-only quantised linear: y = act(x @ dequant(w)^T + bias).
//
// Two regimes:
//  * small M (decode; M <= 16, 32, 48, 64 or 128, see small_m_max_rows): threads take blocks of
//    output channels.
//    x is converted once to a contiguous fp32 buffer. For bf16 x on AVX512-BF16 CPUs
//    (groups of whole 64-byte weight blocks) also to a bf16 copy in the lane order of one
//    of two vdpbf16ps paths, both with exact int -> bf16 weights and group scales applied
//    in fp32 per group:
//    - the fewest rows (small_m_nib: int4 up to M = 7 with group scales, 3 per channel;
//      int8 up to 2 / 1): small_block_nib, memory-bound, the weight turned into bf16
//      128 + nibble words by a shift and a vpternlogd, the offset removed by per-group
//      seeds;
//    - more rows: small_rows_tile, compute-bound, a 4 x 4 register tile over weights
//      unpacked once per block of 4 rows into an L1 buffer.
//    Otherwise (f32 / f16 x, no AVX512-BF16; on AMX CPUs at M < amx_min_m, see fma_first,
//    and from amx_min_m to kAmxChunkMaxM amx_linear) each weight row is streamed once per chunk of
//    up to 8 rows of x (later chunks hit L1), dequantised in registers and FMA'd against
//    every row of the chunk (small_block_avx512; on AVX2-only CPUs small_block_avx2, up to
//    4 rows, and for int4 at M = 1 small_block_avx2_i4). Group scales are applied per
//    group, so no horizontal reductions happen inside K. Group sizes that are not a
//    multiple of the blocks' k step take a plain loop (small_rows_rowwise: a weight row
//    dequantised into L1, then a dot per row of x). On AVX2-only CPUs from 9 rows of x up
//    to 48 (on Zen 1 cores from 13, int4 per channel 16, up to 128; on the later Zen cores
//    only with PORTABLE_GEMM_AVX2_DQ=1), any group size: small_rows_dq_avx2, each pair of
//    weight rows dequantised once, then a 6 x 2 register tile over every row of x.
//  * large M: compute-bound like a dense GEMM. Blocks of the weight are dequantised
//    straight into the packed-B layout of the dense driver (gemm.cpp), which then runs
//    the same micro-kernels, blocking and fused epilogue as gemm: for bf16 x on CPUs with
//    AVX512-BF16 as bf16 pairs for the vdpbf16ps kernels, else as fp32.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/common.h"

#if PG_X86
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace portable_gemm {
namespace cpu {

namespace {

// Above these M the dense path wins (measured A/B, see small_m_max_rows): from 33 rows in
// general (on AVX2-only CPUs from dq_max_rows + 1 where small_rows_dq_avx2 applies), from 17
// when x is bf16 and the vdpbf16ps GEMM runs the dense path but the small one cannot use
// vdpbf16ps (groups that are not whole 64-byte blocks), and from 65 with the tile path
// (small_rows_tile) and per-channel scales where no AMX GEMM takes the dense path.
constexpr int64_t kSmallM = 32;
constexpr int64_t kSmallMPairs = 16;
constexpr int64_t kSmallMTile = 64;
// k per pass of small_rows_tile: 1024 rather than 512 halves the passes, each of which loads
// and stores its 4 x MB partial sums; the weights' bf16 copy (8 KB) and a chunk of x (8 KB)
// still sit in L1. On the Zen 5 VM of bench/CPU_NOTES.md 34: int8 M = 16 1.16x and int4 g128
// 1.06x faster at 4096^2, rows of x from 3 to 32 none slower beyond the rounds' spread.
constexpr int64_t kTileKc = 1024;

bool has_bf16_x_pairs(const MixedLinearArgs& a) {
  return a.x.dtype == DType::bf16 && has_bf16_pair_kernels();
}
// The vdpbf16ps small-M blocks apply (small_block_nib, small_rows_tile): whole 64-byte
// blocks of weight (128 k of int4, 64 k of int8) per group.
int64_t nib_bk(const QuantizedWeight& w) { return w.bits == 4 ? 128 : 64; }
bool small_m_bf16(const MixedLinearArgs& a) {
  const int64_t bk = nib_bk(a.w);
  return has_bf16_x_pairs(a) && a.w.k >= bk && (a.w.group_size == 0 || a.w.group_size % bk == 0);
}
// bf16 x on AMX (amx_linear) from this M up: below it the weight dequantisation (per
// weight, not per row of x, into a 16-row tile however few rows x has) costs more than the
// AVX-512 FMA blocks. One amx_linear pass holds up to kAmxMaxM rows; up to kAmxChunkMaxM it
// runs in chunks, above that the dense path takes over: its GEMM runs on the tile unit too
// (gemm.cpp, K % 32 == 0) and dequantises each weight once, where each chunk of
// amx_linear does it again (bench/CPU_NOTES.md 21, 59).
// Since the FMA blocks prefetch the next block's rows (section 54), their time over
// amx_linear's, one process, 6 rounds (section 56): on the 2-core Xeon VM int4 g128 4096^2
// 0.73 / 0.81 / 0.83 / 1.27x at M = 5 / 6 / 7 / 8, int8 per channel 0.83 / 0.72 / 0.81 /
// 1.58x; on the H200 host's Xeon (2 threads) int4 0.67 / 0.80 / 0.81 / 1.26x, int8 0.67 at
// 5, 0.72 at 6 (8192^2), 1.12 at 7, 1.00 at 8. So 5 and 6 rows took the FMA blocks. Since
// amx_linear pipelines its blocks (section 58) it takes 0.58-0.78x the FMA blocks' time at
// 5 and 6 rows on the VM (int8 and int4, 4096^2 to 8192^2), and 1.15-1.32x at 3 and 4.
// Since section 60 (epilogue, x packing, one table a row) int4 moved down to 3 rows:
// amx_linear took 0.82-0.93x the FMA blocks' time at 3 and 4 (g128 and per channel, K =
// 4096-11008) and 1.03-1.09x at 2; int8 stays at 5 (1.10-1.14x at 3 and 4, 1.06x at 2).
// Since section 61 (amx_rows_one for blocks in one group), int4 with groups of whole
// blocks (a multiple of kAmxKc, fewer than K) takes it from 2 rows: 0.84-1.00x the FMA
// blocks' time at M = 2 on six g128 shapes. Per channel (0.97-1.11x) and g64 (1.35x,
// two groups a block) stay at 3.
constexpr int64_t kAmxMinM = 5;      // int8
constexpr int64_t kAmxMinMInt4 = 3;  // int4
constexpr int64_t kAmxMinMInt4Groups = 2;  // int4, groups of whole blocks
// k per block of amx_linear's dequantisation (64 or 128 bytes of each weight row;
// bench/CPU_NOTES.md 58: blocks of 256 k were slower).
constexpr int64_t kAmxKc = 128;
inline int64_t amx_min_m(const QuantizedWeight& w) {
  if (w.bits != 4) return kAmxMinM;
  const bool whole_groups = w.group_size > 0 && w.group_size < w.k && w.group_size % kAmxKc == 0;
  return whole_groups ? kAmxMinMInt4Groups : kAmxMinMInt4;
}
constexpr int64_t kAmxMaxM = 32;
// Up to this M, amx_linear in even chunks of at most kAmxMaxM rows (amx_linear_chunks), each
// dequantising the weight again, rather than the dense path. On the 2-core Xeon VM (one
// process, 4 rounds; bench/CPU_NOTES.md 59), against the dense path: M = 33 / 40 / 48 / 56
// 0.79 / 0.88 / 0.92 / 0.69x; M = 64 0.70-0.98x on four shapes, 1.08x on int4 g128 4096^2;
// M = 96 0.95x, M = 128 1.07-1.25x. After section 60 (the same VM, 3 rounds): M = 80 / 96
// 0.75-0.88x, M = 112 0.95 / 1.04x, M = 128 0.98 / 1.03x, M = 160 1.07x; so up to 96.
constexpr int64_t kAmxChunkMaxM = 96;

inline float scale_at(const QuantizedWeight& w, int64_t n, int64_t g) {
  return load_f32(w.scales, n * w.scales_row_stride + g, w.scales_dtype);
}

// Signed nibbles: move the wanted one to the top of a byte, then shift arithmetically
// down (the left shift is done unsigned: shifting a negative value is UB in C++17).
inline int low_nibble(uint8_t byte) { return static_cast<int8_t>(uint8_t(byte << 4)) >> 4; }
inline int high_nibble(uint8_t byte) { return static_cast<int8_t>(byte) >> 4; }
inline int nibble(const uint8_t* q, int64_t k) {
  return (k & 1) ? high_nibble(q[k >> 1]) : low_nibble(q[k >> 1]);
}

#if PG_X86
// o[i] = q(k + i) * s for i < len; int4 needs an even k.
PG_TARGET_AVX512 void dequant_segment_avx512(const uint8_t* q, int bits, int64_t k, int64_t len,
                                             float s, float* o) {
  const __m512 sv = _mm512_set1_ps(s);
  if (bits == 8) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(q) + k;
    for (int64_t i = 0; i < len; i += 16) {
      const int64_t n = std::min<int64_t>(16, len - i);
      const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, qs + i)));
      _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(v, sv));
    }
    return;
  }
  // 16 bytes -> 32 values: low nibbles are the even k, high nibbles the odd k; two
  // permutes interleave them back into k order.
  const __m512i idx_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i idx_hi =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const uint8_t* qb = q + k / 2;
  for (int64_t i = 0; i < len; i += 32) {
    const int64_t n = std::min<int64_t>(32, len - i);  // even
    const __mmask16 mb = n == 32 ? __mmask16(0xFFFF) : __mmask16((1u << (n / 2)) - 1);
    const __m512i v = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mb, qb + i / 2));
    const __m512 lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28)), sv);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 4)), sv);
    const __m512 o0 = _mm512_permutex2var_ps(lo, idx_lo, hi);
    const __m512 o1 = _mm512_permutex2var_ps(lo, idx_hi, hi);
    if (n == 32) {
      _mm512_storeu_ps(o + i, o0);
      _mm512_storeu_ps(o + i + 16, o1);
    } else {
      const int64_t n0 = std::min<int64_t>(16, n);
      _mm512_mask_storeu_ps(o + i, __mmask16((1u << n0) - 1), o0);
      if (n > 16) _mm512_mask_storeu_ps(o + i + 16, __mmask16((1u << (n - 16)) - 1), o1);
    }
  }
}

// The same on AVX2 (k even for int4, len even): 8 weights per step, the rest in scalar.
PG_TARGET_AVX2 void dequant_segment_avx2(const uint8_t* q, int bits, int64_t k, int64_t len,
                                         float s, float* o) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  if (bits == 8) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(q) + k;
    for (; i + 8 <= len; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + i));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
    }
    for (; i < len; ++i) o[i] = float(qs[i]) * s;
    return;
  }
  // 8 bytes -> 16 values: low nibbles (even k) and high nibbles (odd k) of the 8 bytes,
  // interleaved back into k order by two unpacks and two lane permutes.
  const uint8_t* qb = q + k / 2;
  for (; i + 16 <= len; i += 16) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + i / 2)));
    const __m256 lo = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28)), sv);
    const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 4)), sv);
    const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
    _mm256_storeu_ps(o + i, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(o + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (; i < len; i += 2) {
    o[i] = float(low_nibble(qb[i / 2])) * s;
    o[i + 1] = float(high_nibble(qb[i / 2])) * s;
  }
}
#endif

// o[i] = q(k + i) * s for i < len (one scale: the segment lies within one group).
void dequant_segment(const uint8_t* q, int bits, int64_t k, int64_t len, float s, float* o) {
  if (bits == 4 && (k & 1) && len > 0) {  // odd group sizes only: align to a byte
    o[0] = float(nibble(q, k)) * s;
    ++k;
    ++o;
    --len;
  }
  const int64_t even = bits == 4 ? len & ~int64_t(1) : len;
#if PG_X86
  if (active_isa() == Isa::avx512) {
    dequant_segment_avx512(q, bits, k, even, s, o);
  } else if (active_isa() == Isa::avx2) {
    dequant_segment_avx2(q, bits, k, even, s, o);
  } else
#endif
  if (bits == 8) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(q) + k;
    for (int64_t i = 0; i < even; ++i) o[i] = float(qs[i]) * s;
  } else {
    const uint8_t* qb = q + k / 2;
    for (int64_t j = 0; j < even / 2; ++j) {
      o[2 * j] = float(low_nibble(qb[j])) * s;
      o[2 * j + 1] = float(high_nibble(qb[j])) * s;
    }
  }
  if (even < len) o[even] = float(nibble(q, k + even)) * s;
}

// out[k] = dequant(w)(n, k0 + k) for k < kc; with `scaled` false, the integers q alone
// (per-channel scales applied to the GEMM's results instead, see QuantB).
void dequant_row(const QuantizedWeight& w, int64_t n, int64_t k0, int64_t kc, float* out,
                 bool scaled = true) {
  const uint8_t* q = static_cast<const uint8_t*>(w.data) + n * w.row_stride;
  const int64_t gs = w.group_size > 0 ? w.group_size : w.k;
  int64_t k = k0;
  const int64_t kend = k0 + kc;
  while (k < kend) {
    const int64_t g = w.group_size > 0 ? k / gs : 0;
    const int64_t stop = std::min(kend, (g + 1) * gs);
    dequant_segment(q, w.bits, k, stop - k, scaled ? scale_at(w, n, g) : 1.f, out + (k - k0));
    k = stop;
  }
}

// The dense path's B: the weight, and whether its packers write it unscaled. Per-channel
// weights are packed as their integers (exact in bf16 and fp32), and the dense GEMM's
// epilogue multiplies each output column by its scale (DenseProblem::col_scale): fewer
// operations per weight in the packers, and no rounding of q * s to bf16. Group scales
// are applied in the packers.
struct QuantB {
  const QuantizedWeight* w;
  bool unscaled;
};

// PackB over the dequantised weight: B(k, n) = dequant(w)(n, k). Weight rows are
// dequantised 16 at a time into fp32 rows, then transposed into the sliver.
void pack_b_quant(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                  float* dst) {
  const QuantB& b = *static_cast<const QuantB*>(ctx);
  const QuantizedWeight& w = *b.w;
  float* tmp = scratch(5, size_t(16 * kc));
  for (int64_t s = 0; s * nr < nc; ++s) {
    float* d = dst + s * kc * nr;
    const int64_t cols = std::min<int64_t>(nr, nc - s * nr);
    for (int h = 0; h < nr; h += 16) {
      const int lanes = std::min(16, nr - h);
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(lanes, cols - h)));
      const void* rp[16];
      for (int j = 0; j < n; ++j) {
        dequant_row(w, n0 + s * nr + h + j, k0, kc, tmp + j * kc, !b.unscaled);
        rp[j] = tmp + j * kc;
      }
      pack_rows_transposed(rp, n, DType::f32, kc, d + h, nr, lanes);
    }
  }
}

// The same B as bf16 pair units for the vdpbf16ps kernels (bf16 x only): unit (p, n) holds
// bf16(dequant(w)(n, 2p)) in its low half and bf16(dequant(w)(n, 2p + 1)) in its high half,
// each the fp32 product q * scale rounded to bf16 (relative error 2^-9 per weight, as on
// the AMX path).
#if PG_X86
PG_TARGET_AVX512_BF16 void round_row_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// Entry i: the signed nibble i (i < 8 ? i : i - 16), for vpermps lookups of int4 values.
PG_TARGET_AVX512 inline __m512 nibble_table() {
  return _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0);
}

// vpshufb index: byte b of each 32-bit lane to the lane's top byte, its other bytes zero.
PG_TARGET_AVX512_BF16 inline __m512i byte_to_top_avx512(int b) {
  return _mm512_add_epi32(_mm512_set1_epi32(0x00808080 | (b << 24)),
                          _mm512_set4_epi32(12 << 24, 8 << 24, 4 << 24, 0));
}

// Elements of one 32-bit word of a weight row: 8 nibbles or 4 bytes.
constexpr int64_t word_elems(int bits) { return bits == 4 ? 8 : 4; }

// The fused form: 16 weight rows (rows >= nrows are zero) straight from their quantised
// bytes to pair units, in one pass. 64 bytes of each row (128 k of int4, 64 of int8) are
// loaded and transposed as 16 x 16 32-bit words, so that lane r of word vector i holds
// word i of row r. SCALED: each pair of elements in it is then sign-extended, converted,
// scaled (the same fp32 multiply as dequant_segment), rounded to bf16 two vectors at a time
// and interleaved into units. Unscaled (QuantB), each unit is built in place:
// - int4: one vpermw into a table of the 16 nibble values in bf16, its index the pair's
//   two nibbles moved to the bottom of the unit's two halves (vpermw reads an index's low
//   five bits, and the table's two halves are the same, so nothing is masked);
// - int8: each byte moved to the top of a lane (vpshufb), shifted down arithmetically and
//   converted; the float's upper half is its bf16 (exact: 8 significant bits), and one
//   blend joins the two halves.
// A vector of 16 units (32 weights) then takes 7-8 vector operations for int8 and 3-4 for
// int4, none a multiply, against 10. The call gained less (0.95-1.00x the time at M = 256
// on the 2-core Xeon VM, bench/CPU_NOTES.md 62): the packer waits mostly on its loads. Bit
// for bit the result of the row-by-row path below it. Needs an even kc and scale groups of
// whole words (see quant_pairs_fused_ok).
template <int BITS, bool SCALED>
PG_TARGET_AVX512_BF16 void pack_quant_pairs_avx512(const QuantizedWeight& w, int64_t n0,
                                                   int nrows, int64_t k0, int64_t kc,
                                                   uint32_t* dst, int64_t ld, int lanes) {
  constexpr int64_t we = word_elems(BITS);
  const int64_t step = 16 * we;  // k per 64 bytes of a row
  const int64_t kp = kc / 2;
  const int64_t gs = w.group_size > 0 ? w.group_size : w.k;
  const __mmask16 store_mask = __mmask16((1u << lanes) - 1);
  // vpermw index: unit r = (element r of the low vector, element r of the high vector).
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  // Unscaled int4: words 0-15 and 16-31 the signed nibbles 0..7, -8..-1 in bf16.
  const __m512i nib_table = (__m512i)_mm512_cvtne2ps_pbh(nibble_table(), nibble_table());
  // Unscaled int8, vpshufb indices: byte b of each 32-bit lane to the lane's top byte, the
  // rest zero (index bit 7).
  const __m512i top_b0 = byte_to_top_avx512(0), top_b1 = byte_to_top_avx512(1),
                top_b2 = byte_to_top_avx512(2);
  const uint8_t* q = static_cast<const uint8_t*>(w.data);
  int64_t group = -1;
  __m512 sv = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kc; kk += step) {
    const int64_t nk = std::min(step, kc - kk);  // even
    const int64_t nbytes = nk * BITS / 8;
    const __mmask64 bmask = nbytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << nbytes) - 1;
    __m512 v[16];
    PG_UNROLL for (int r = 0; r < 16; ++r) {
      v[r] = r < nrows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(
                             bmask, q + (n0 + r) * w.row_stride + (k0 + kk) * BITS / 8))
                       : _mm512_setzero_ps();
    }
    // The same bytes of the next 16 rows (the packer's next call, or past the block's last
    // rows, a harmless prefetch) into L2: a B block gives each row only kc / 2 or kc bytes,
    // too short a stream for the hardware prefetchers, and the loads above stalled on
    // memory (a perf profile put them at about half of the packer's samples). On the 2-core
    // AMX Xeon VM at M = 256, K = 11008 (bench/CPU_NOTES.md 61; one process, 4 rounds): the
    // whole call 0.95x the time for int4 g128, 0.88x for int8; 32 rows ahead 0.95 / 0.94x,
    // into L1 0.97 / 0.91x, 1-4 steps ahead in the same rows 0.96-1.05 / 0.94x.
    PG_UNROLL for (int r = 0; r < 16; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(q + (n0 + 16 + r) * w.row_stride +
                                                 (k0 + kk) * BITS / 8), _MM_HINT_T1);
    transpose16_avx512(v);
    const int64_t nwords = (nk + we - 1) / we;
    for (int64_t i = 0; i < nwords; ++i) {
      const int64_t kw = k0 + kk + i * we;  // first element of word i
      if (SCALED && kw / gs != group) {
        group = kw / gs;
        alignas(64) float s[16] = {};  // rows past nrows: 0, so their units are 0
        for (int r = 0; r < nrows; ++r) s[r] = scale_at(w, n0 + r, group);
        sv = _mm512_load_ps(s);
      }
      const __m512i t = _mm512_castps_si512(v[i]);
      const int64_t p0 = (kk + i * we) / 2;
      const int64_t npairs = std::min<int64_t>(we / 2, kp - p0);
      PG_UNROLL for (int j = 0; j < we / 2; ++j) {
        if (j >= npairs) break;
        if constexpr (!SCALED) {
          __m512i unit;
          if (BITS == 4) {  // index: low nibble of byte j in bits 0-3, its high one in 16-19
            const __m512i a = j == 0 ? t : _mm512_srli_epi32(t, 8 * j);
            const __m512i b =
                j < 2 ? _mm512_slli_epi32(t, 12 - 8 * j) : _mm512_srli_epi32(t, 8 * j - 12);
            unit = _mm512_permutexvar_epi16(_mm512_mask_blend_epi16(0xAAAAAAAA, a, b), nib_table);
          } else {  // bytes 2j and 2j + 1
            const __m512i lo = _mm512_srai_epi32(_mm512_shuffle_epi8(t, j == 0 ? top_b0 : top_b2), 24);
            const __m512i hi =
                j == 0 ? _mm512_srai_epi32(_mm512_shuffle_epi8(t, top_b1), 24) : _mm512_srai_epi32(t, 24);
            const __m512i lof = _mm512_castps_si512(_mm512_cvtepi32_ps(lo));
            const __m512i hif = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
            unit = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(lof, 16), hif);
          }
          _mm512_mask_storeu_epi32(dst + (p0 + j) * ld, store_mask, unit);
          continue;
        }
        __m512i lo, hi;
        if (BITS == 4) {  // nibbles 2j (low half of byte j) and 2j + 1 (its high half)
          lo = _mm512_srai_epi32(_mm512_slli_epi32(t, 28 - 8 * j), 28);
          hi = _mm512_srai_epi32(_mm512_slli_epi32(t, 24 - 8 * j), 28);
        } else {  // bytes 2j and 2j + 1
          lo = _mm512_srai_epi32(_mm512_slli_epi32(t, 24 - 16 * j), 24);
          hi = _mm512_srai_epi32(_mm512_slli_epi32(t, 16 - 16 * j), 24);
        }
        const __m512 lof = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), sv);
        const __m512 hif = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), sv);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hif, lof);  // lo 0..15, hi 0..15
        _mm512_mask_storeu_epi32(dst + (p0 + j) * ld, store_mask,
                                 _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
}

// The fused packer's conditions: pairs of whole elements (even kc; int4 rows start on a
// byte) and no scale group boundary inside a 32-bit word.
bool quant_pairs_fused_ok(const QuantizedWeight& w, int64_t k0, int64_t kc) {
  return active_isa() == Isa::avx512 && kc % 2 == 0 && k0 % 2 == 0 &&
         (w.group_size == 0 || w.group_size % word_elems(w.bits) == 0);
}
#endif

void pack_b_quant_pairs(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                        float* dst_f) {
  const QuantB& b = *static_cast<const QuantB*>(ctx);
  const QuantizedWeight& w = *b.w;
  uint32_t* dst = reinterpret_cast<uint32_t*>(dst_f);
  const int64_t kp = (kc + 1) / 2;
#if PG_X86
  const bool fused = quant_pairs_fused_ok(w, k0, kc);
#else
  const bool fused = false;
#endif
  float* tmp = fused ? nullptr : scratch(5, size_t(kc));
  uint16_t* rows = fused ? nullptr : reinterpret_cast<uint16_t*>(scratch(6, size_t(8 * kc + 8)));
  for (int64_t s = 0; s * nr < nc; ++s) {
    const int64_t cols = std::min<int64_t>(nr, nc - s * nr);
    for (int h = 0; h < nr; h += 16) {
      const int lanes = std::min(16, nr - h);
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(lanes, cols - h)));
      uint32_t* d = dst + s * kp * nr + h;
#if PG_X86
      if (fused) {
        const int64_t c0 = n0 + s * nr + h;
        if (b.unscaled) {
          if (w.bits == 4)
            pack_quant_pairs_avx512<4, false>(w, c0, n, k0, kc, d, nr, lanes);
          else
            pack_quant_pairs_avx512<8, false>(w, c0, n, k0, kc, d, nr, lanes);
        } else {
          if (w.bits == 4)
            pack_quant_pairs_avx512<4, true>(w, c0, n, k0, kc, d, nr, lanes);
          else
            pack_quant_pairs_avx512<8, true>(w, c0, n, k0, kc, d, nr, lanes);
        }
        continue;
      }
#endif
      for (int j = 0; j < n; ++j) {
        dequant_row(w, n0 + s * nr + h + j, k0, kc, tmp, !b.unscaled);
#if PG_X86
        round_row_bf16(tmp, kc, rows + j * kc);
#else
        for (int64_t k = 0; k < kc; ++k) rows[j * kc + k] = f32_to_bf16(tmp[k]);
#endif
      }
      pack_pairs_transposed(rows, kc, 1, n, kc, d, nr, lanes);
    }
  }
}

// ---- small-M path ------------------------------------------------------------------

enum class Vec { none, avx2, avx512 };
struct SmallJob {
  const MixedLinearArgs* args;
  const float* x;  // M x K fp32, row stride ldx (int4 vector path: permuted, see below)
  int64_t ldx;
  int64_t m, n, k;
  Epilogue ep;
  // The FMA blocks apply (group sizes a multiple of their k step): avx512
  // (small_block_avx512) or avx2 (small_block_avx2); int4 x is then permuted (see there).
  Vec vec = Vec::none;
  // bf16 x, AVX512-BF16, more rows (see small_rows_tile): x as bf16 in the lane order of
  // the unpacked weights, K up to kvec in slices of kc.
  const uint16_t* xt = nullptr;
  int64_t ldxt = 0, kvec = 0, kc = 0, ngroups = 1;
  // bf16 x, AVX512-BF16, per-channel or group scales in whole blocks (see small_block_nib):
  // x as bf16 in the nibble lane order, and per row of x and group the 16-lane offset
  // correction that starts each group's partial sums.
  const uint16_t* xn = nullptr;
  int64_t ldxn = 0;
  const float* seed = nullptr;
  int64_t nseed = 0;
  // int4 at M = 1 on AVX2 (small_block_avx2_i4): x permuted per 64 k, and seed holds per
  // row of x and segment of seg k (a group; per channel 256 k) the 8-lane offset
  // correction that starts each segment's partial sums. 0: not this path.
  int64_t seg = 0;
  // AVX2, dq_applies (small_rows_dq_avx2): x in plain k order.
  bool dq = false;
  mutable std::atomic<bool> failed{false};
};

// Sum of a[k] * b[k], k < n. Portable: eight partial sums keep it vectorisable without
// -ffast-math.
float dot_portable(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[k + j] * b[k + j];
  float sum = 0.f;
  for (; k < n; ++k) sum += a[k] * b[k];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

#if PG_X86
PG_TARGET_AVX2 inline float hsum_avx2(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

// The same on AVX2 + FMA: 8 lanes in four chains. On an AVX2-only EPYC (2 threads, bf16 x)
// the portable loops read int8 / int4 weights at 4.4-4.9 / 1.9-2.0 GB/s at M = 1, 0.31-0.37x
// torch's weight-only kernels; with this and dequant_segment_avx2, 2.3-3.0x faster
// (bench/CPU_NOTES.md 24).
PG_TARGET_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), a3);
  }
  for (; k + 8 <= n; k += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
  float sum = hsum_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}
#endif

// Without the AVX-512 blocks: dequantise one weight row to fp32 (L1-resident; dequant_row
// uses AVX2 where the CPU has it), then Dot it with every row of x.
template <float (*Dot)(const float*, const float*, int64_t)>
void small_rows_rowwise(const SmallJob& job, int64_t n0, int64_t n1, float* res, int64_t ldr) {
  const QuantizedWeight& w = job.args->w;
  const int64_t K = job.k;
  float* row = scratch(4, size_t(K));
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(w, n, 0, K, row);
    for (int64_t m = 0; m < job.m; ++m) res[m * ldr + (n - n0)] = Dot(row, job.x + m * job.ldx, K);
  }
}

// Sum over k in [k0, k1) of q(k) * x[k]: the scalar tail of the vector blocks below (per
// channel only; group sizes are multiples of the vector step).
inline float tail_dot(const uint8_t* q, bool int4, const float* x, int64_t k0, int64_t k1) {
  float sum = 0.f;
  for (int64_t k = k0; k < k1; ++k)
    sum += float(int4 ? nibble(q, k) : reinterpret_cast<const int8_t*>(q)[k]) * x[k];
  return sum;
}

// What the FMA blocks share (small_block_avx512, small_block_avx2): NB weight rows, x from
// row m0, K in whole steps (per group) and a per-channel tail.
template <int NB>
struct FmaRows {
  const QuantizedWeight& w;
  const uint8_t* q[NB];
  const float* x;
  int64_t ldx, k, kvec, gs, groups;
  FmaRows(const SmallJob& job, const int64_t* rows, int64_t m0, int64_t step)
      : w(job.args->w), x(job.x + m0 * job.ldx), ldx(job.ldx), k(job.k) {
    for (int r = 0; r < NB; ++r) q[r] = static_cast<const uint8_t*>(w.data) + rows[r] * w.row_stride;
    kvec = k / step * step;
    gs = w.group_size > 0 ? w.group_size : kvec;
    groups = w.group_size > 0 ? k / gs : 1;
  }
  // out[r][m] (MB rows of x) += the tail k in [kvec, k) times the scale; per channel only
  // (group sizes are multiples of the step).
  template <int MB>
  void add_tail(const int64_t* rows, bool int4, float* out) const {
    if (kvec == k) return;
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m)
        out[r * MB + m] += tail_dot(q[r], int4, x + m * ldx, kvec, k) * scale_at(w, rows[r], 0);
  }
};

#if PG_X86
// NB weight rows x MB rows of x. int8: 16 k per step. int4: 32 k per step from 16 bytes;
// the low nibbles (even k) and high nibbles (odd k) land in two vectors, so x was
// stored permuted per 32-block (16 even k, then 16 odd k) and no shuffles are needed.
//
// Work per 16 weights decides the speed at small M (the loads alone would stream at the
// memory's rate):
//  * int4: one vpermps per 16 nibbles turns the nibble straight into nibble * scale,
//    through a 16-entry table rebuilt per row and group (a lane's low 4 bits pick the
//    entry, so no masking or sign extension either).
//  * int8: sign-extend, convert, FMA. With few rows of x (FOLD) the scale is applied once
//    per group to a partial sum instead of once per 16 weights; with more rows the
//    multiply is shared by MB FMAs and the registers are needed for accumulators.
// Per channel (CHAN, int8 with more rows) the scale goes on the results instead.
// The scalar tail only exists per-channel (group sizes are multiples of step here).
template <int MB, int NB, bool INT4, bool CHAN>
PG_TARGET_AVX512 void small_block_avx512(const SmallJob& job, const int64_t* rows, int64_t m0,
                                         float* out /* [NB][MB] */) {
  constexpr bool FOLD = !INT4 && MB <= 2;
  static_assert(!CHAN || (!INT4 && !FOLD), "only int8 without FOLD scales every weight");
  constexpr int64_t step = INT4 ? 32 : 16;
  const FmaRows<NB> f(job, rows, m0, step);
  const QuantizedWeight& w = f.w;
  const int64_t gs = f.gs, groups = f.groups, ldx = f.ldx;
  const float* x = f.x;
  const uint8_t* const* q = f.q;
  const __m512 nibbles = nibble_table();
  const bool first_pass = MB == 1 || m0 == 0;  // later chunks of x find the rows in L1

  __m512 acc[NB][MB];
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();

  for (int64_t g = 0; g < groups && gs > 0; ++g) {
    __m512 s[NB];  // the scale, or (int4) the table of nibble * scale
    PG_UNROLL for (int r = 0; r < NB; ++r) {
      s[r] = _mm512_set1_ps(scale_at(w, rows[r], g));
      if (INT4) s[r] = _mm512_mul_ps(nibbles, s[r]);
    }
    __m512 part[FOLD ? NB : 1][FOLD ? MB : 1];
    if constexpr (FOLD)
      PG_UNROLL for (int r = 0; r < NB; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m) part[r][m] = _mm512_setzero_ps();
    const int64_t kend = (g + 1) * gs;
    for (int64_t k = g * gs; k < kend; k += step) {
      const int64_t byte = INT4 ? k / 2 : k;
      // The first pass over a block of rows fetches the same k of the next quad's rows
      // (RowQuads: one row on), as small_block_avx2 does: at the end of a block the hardware
      // prefetchers would start those rows cold (an int4 row is 2 KB at K = 4096). Measured
      // with the next block of consecutive rows (before RowQuads), on the 2-core AMX Xeon VM
      // (bench/CPU_NOTES.md 54, one process, 8 alternating rounds, weights rotated over
      // 960 MB) against 512 bytes ahead in the same row at M = 1 only: int4 g128 M = 4 took
      // 0.65-0.66x the time at K = 4096 and 0.94x at 8192; int8 M = 2 and 4 0.84-0.99x;
      // M = 1 int8 0.94x, int4 1.00x. Into L2 instead of L1: the same within noise.
      if (first_pass && (byte & 63) == 0)
        PG_UNROLL for (int r = 0; r < NB; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q[r]) + byte + w.row_stride, _MM_HINT_T0);
      if (INT4) {
        __m512 lo[NB], hi[NB];
        PG_UNROLL for (int r = 0; r < NB; ++r) {
          const __m512i v = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + k / 2)));
          lo[r] = _mm512_permutexvar_ps(v, s[r]);
          hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), s[r]);
        }
        PG_UNROLL for (int m = 0; m < MB; ++m) {
          const __m512 xe = _mm512_loadu_ps(x + m * ldx + k);
          const __m512 xo = _mm512_loadu_ps(x + m * ldx + k + 16);
          PG_UNROLL for (int r = 0; r < NB; ++r) {
            acc[r][m] = _mm512_fmadd_ps(lo[r], xe, acc[r][m]);
            acc[r][m] = _mm512_fmadd_ps(hi[r], xo, acc[r][m]);
          }
        }
      } else {
        __m512 wf[NB];
        PG_UNROLL for (int r = 0; r < NB; ++r) {
          wf[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + k))));
          if constexpr (!FOLD && !CHAN) wf[r] = _mm512_mul_ps(wf[r], s[r]);
        }
        PG_UNROLL for (int m = 0; m < MB; ++m) {
          const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
          PG_UNROLL for (int r = 0; r < NB; ++r) {
            if constexpr (FOLD)
              part[r][m] = _mm512_fmadd_ps(wf[r], xv, part[r][m]);
            else
              acc[r][m] = _mm512_fmadd_ps(wf[r], xv, acc[r][m]);
          }
        }
      }
    }
    if constexpr (FOLD)
      PG_UNROLL for (int r = 0; r < NB; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(part[r][m], s[r], acc[r][m]);
  }
  // Fully unrolled like every access to acc: one non-constant index would force the
  // whole array into memory, with a store per FMA in the loop above.
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m)
      out[r * MB + m] = _mm512_reduce_add_ps(acc[r][m]) * (CHAN ? scale_at(w, rows[r], 0) : 1.f);
  f.template add_tail<MB>(rows, INT4, out);
}

// The AVX2 form of small_block_avx512 (16 ymm registers), 16 k per step: int8 as two
// 8-byte halves (lo: k .. k + 7, hi: k + 8 .. k + 15), int4 from 8 bytes with x permuted
// per 16-block (8 even k, then 8 odd k; lo: the low nibbles, hi: the high ones). vpermps
// has only 8 entries here, so nibbles are sign-extended by shifts and converted instead of
// looked up. With one or two rows of x (FOLD) the scale goes on partial sums once per
// group, and lo and hi go into separate partial sums: with one chain per weight row and row
// of x, the FMA latency bounds a step (int8 M = 2 ran at 20 GB/s on the AVX2 EPYC of
// bench/CPU_NOTES.md 25, M = 1 at 37). With more rows the scale goes on the weights (one
// multiply per 8 shared by MB FMAs), as the accumulators need the registers; per channel
// (CHAN) it goes on the results instead (see small_pass).
template <int MB, int NB, bool INT4, bool CHAN>
PG_TARGET_AVX2 void small_block_avx2(const SmallJob& job, const int64_t* rows, int64_t m0,
                                     float* out /* [NB][MB] */) {
  constexpr bool FOLD = MB <= 2;
  static_assert(!(FOLD && CHAN), "FOLD scales once per group already");
  constexpr int64_t step = 16;
  // The first pass over these weight rows (see the prefetch below); MB = 1 always, at
  // compile time, which keeps M = 1's loop as measured.
  const bool first_pass = MB == 1 || m0 == 0;
  const FmaRows<NB> f(job, rows, m0, step);
  const QuantizedWeight& w = f.w;
  const int64_t gs = f.gs, groups = f.groups, ldx = f.ldx;
  const float* x = f.x;
  const uint8_t* const* q = f.q;

  __m256 acc[NB][MB];
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();

  for (int64_t g = 0; g < groups && gs > 0; ++g) {
    __m256 s[NB];
    PG_UNROLL for (int r = 0; r < NB; ++r) s[r] = _mm256_set1_ps(scale_at(w, rows[r], g));
    __m256 plo[FOLD ? NB : 1][FOLD ? MB : 1], phi[FOLD ? NB : 1][FOLD ? MB : 1];
    if constexpr (FOLD)
      PG_UNROLL for (int r = 0; r < NB; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m) plo[r][m] = phi[r][m] = _mm256_setzero_ps();
    const int64_t kend = (g + 1) * gs;
    for (int64_t k = g * gs; k < kend; k += step) {
      const int64_t byte = INT4 ? k / 2 : k;
      // The first pass over a block of rows (m0 = 0: later chunks of x find it in L1)
      // fetches the same k of the next quad's rows (RowQuads; as small_block_nib does), rather
      // than 512 bytes ahead in the same row (as it did before): each row is a short
      // stream, and at the end of a block the hardware prefetchers start the next block's
      // rows cold. On the AVX2 EPYC of bench/CPU_NOTES.md 32, M = 1 read its weights
      // 1.10-1.21x faster (median of 8 alternating rounds, 31 of 32 won); on the AVX2 Zen 4
      // VM of section 47 M = 2, 4, 8 and 16 took 0.73-0.82, 0.80-0.93, 0.88-0.98 and
      // 0.94-0.96x the time with it (int4 and int8, three runs of alternating rounds in one
      // process; one noisy run read 1.01 at M = 2). int8 fetches into
      // L2 only: there that took 0.92-0.93x the time of fetching into L1 at M = 1, where
      // int4, bound by its own instructions, was 1.03x slower with it.
      if (first_pass && (byte & 63) == 0)
        PG_UNROLL for (int r = 0; r < NB; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q[r]) + byte + w.row_stride,
                       INT4 ? _MM_HINT_T0 : _MM_HINT_T1);
      __m256 lo[NB], hi[NB];
      PG_UNROLL for (int r = 0; r < NB; ++r) {
        const __m256i v = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + byte)));
        if (INT4) {
          lo[r] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28));
          hi[r] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 4));
        } else {
          lo[r] = _mm256_cvtepi32_ps(v);
          hi[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + k + 8))));
        }
        if constexpr (!FOLD && !CHAN) {
          lo[r] = _mm256_mul_ps(lo[r], s[r]);
          hi[r] = _mm256_mul_ps(hi[r], s[r]);
        }
      }
      PG_UNROLL for (int m = 0; m < MB; ++m) {
        const __m256 xl = _mm256_loadu_ps(x + m * ldx + k);
        const __m256 xh = _mm256_loadu_ps(x + m * ldx + k + 8);
        PG_UNROLL for (int r = 0; r < NB; ++r) {
          if constexpr (FOLD) {
            plo[r][m] = _mm256_fmadd_ps(lo[r], xl, plo[r][m]);
            phi[r][m] = _mm256_fmadd_ps(hi[r], xh, phi[r][m]);
          } else {
            acc[r][m] = _mm256_fmadd_ps(lo[r], xl, acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(hi[r], xh, acc[r][m]);
          }
        }
      }
    }
    if constexpr (FOLD)
      PG_UNROLL for (int r = 0; r < NB; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m)
          acc[r][m] = _mm256_fmadd_ps(_mm256_add_ps(plo[r][m], phi[r][m]), s[r], acc[r][m]);
  }
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m)
      out[r * MB + m] = hsum_avx2(acc[r][m]) * (CHAN ? scale_at(w, rows[r], 0) : 1.f);
  f.template add_tail<MB>(rows, INT4, out);
}

// int4 at one row of x on AVX2 (job.seg > 0: M = 1, groups of a multiple of 64 or per
// channel), 64 k per step from one 32-byte load per weight row, with no integer to
// float conversion. t = the low nibble of every byte, u = the high one (a shift and two
// ANDs); per 8 weights one vpshufb moves byte b of every dword of t or u to bits 16-23 of
// that dword, and an XOR with 0x3F88 << 16 makes it the fp32 1 + (nibble ^ 8) / 128 =
// 1.0625 + q / 128, exactly (two's complement: nibble ^ 8 = q + 8). Dword l of the load
// holds k = 8l .. 8l + 7, so x is permuted per 64 k (x'[8 j + l] = x[8 l + j]), and byte b
// of t (u) pairs with x' at 16 b (16 b + 8). The sums are of (1.0625 + q / 128) x; each
// segment's partial sums start from -1.0625 times the sum of x over their lane and segment
// (job.seed), so they end as q x / 128 and go into the accumulators times 128 s.
// Per 8 weights: a vpshufb, an XOR and an FMA, plus a shift and two ANDs per 64; in
// small_block_avx2 a widening load, three shifts and two converts per 16 besides the FMAs,
// and the widening load and the shifts share two of the four vector pipes of these cores.
// Rounding: the partial sums add terms of the size of 136 |x| per weight instead of |q x|
// (in units of the result), so an absolute error of about 2^-24 * 136 * s times the sum of
// |x| over a segment, far below the bf16 output's rounding (small_block_nib takes the same
// offset, see there). On the AVX2 Zen 4 VM of bench/CPU_NOTES.md 47: 1.16-1.18x the
// weight rate of small_block_avx2 on cache-resident weights, 0.83-0.90x its time at
// 4096^2 and 8192^2 g128 (one process, alternating rounds).
template <int NB>
PG_TARGET_AVX2 void small_block_avx2_i4(const SmallJob& job, const int64_t* rows, float* out /* [NB] */) {
  const FmaRows<NB> f(job, rows, 0, 64);
  const QuantizedWeight& w = f.w;
  const bool grouped = w.group_size > 0;
  const int64_t seg = job.seg, kvec = f.kvec;
  const float* x = f.x;
  const uint8_t* const* q = f.q;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bits = _mm256_set1_epi32(0x3F880000);
  __m256i sel[4];  // byte b of each dword to byte 2, zeros elsewhere (vpshufb: -128)
  PG_UNROLL for (int b = 0; b < 4; ++b) {
    const char z = -128;
    sel[b] = _mm256_setr_epi8(z, z, char(b), z, z, z, char(4 + b), z, z, z, char(8 + b), z, z, z,
                              char(12 + b), z, z, z, char(b), z, z, z, char(4 + b), z, z, z,
                              char(8 + b), z, z, z, char(12 + b), z);
  }
  // The accumulators stay in memory between segments: the loop needs every register.
  alignas(32) float acc[NB][8] = {};
  for (int64_t g = 0; g < job.nseed; ++g) {
    __m256 plo[NB], phi[NB];
    const __m256 sd = _mm256_loadu_ps(job.seed + g * 8);
    PG_UNROLL for (int r = 0; r < NB; ++r) {
      plo[r] = sd;
      phi[r] = _mm256_setzero_ps();
    }
    const int64_t kend = std::min(kvec, (g + 1) * seg);
    for (int64_t k = g * seg; k < kend; k += 64) {
      // As small_block_avx2: the same k of the next quad's rows, once per 64 bytes.
      if ((k & 127) == 0)
        PG_UNROLL for (int r = 0; r < NB; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q[r]) + k / 2 + w.row_stride, _MM_HINT_T0);
      PG_UNROLL for (int r = 0; r < NB; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + k / 2));
        const __m256i t = _mm256_and_si256(v, low4);
        const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        PG_UNROLL for (int b = 0; b < 4; ++b) {
          const __m256 ft = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_shuffle_epi8(t, sel[b]), bits));
          const __m256 fu = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_shuffle_epi8(u, sel[b]), bits));
          plo[r] = _mm256_fmadd_ps(ft, _mm256_loadu_ps(x + k + 16 * b), plo[r]);
          phi[r] = _mm256_fmadd_ps(fu, _mm256_loadu_ps(x + k + 16 * b + 8), phi[r]);
        }
      }
    }
    PG_UNROLL for (int r = 0; r < NB; ++r) {
      const __m256 sv = _mm256_set1_ps(grouped ? 128.f * scale_at(w, rows[r], g) : 1.f);
      _mm256_store_ps(acc[r], _mm256_fmadd_ps(_mm256_add_ps(plo[r], phi[r]), sv, _mm256_load_ps(acc[r])));
    }
  }
  PG_UNROLL for (int r = 0; r < NB; ++r)
    out[r] = hsum_avx2(_mm256_load_ps(acc[r])) * (grouped ? 1.f : 128.f * scale_at(w, rows[r], 0));
  f.template add_tail<1>(rows, true, out);
}

// Weight-only block with vdpbf16ps and no shuffles, for bf16 x (per-channel scales, or
// groups of whole blocks). A block is one 64-byte load per weight row: 128 k of int4 or
// 64 k of int8, seen as 32 16-bit words of 4 nibbles each. Nibble j of every word becomes
// a bf16 word by one shift and one vpternlogd: (word >> 4j) & 0xF, OR'd with 0x4300 (bf16
// 128.0, whose last mantissa bit is worth 1) so the word reads 128 + nibble exactly, and
// XOR'd with 8 for signed nibbles (two's complement: nibble ^ 8 = value + 8):
//  * int4: every nibble is a signed value q, the bf16 word is 136 + q;
//  * int8: q = 16 h + l (h the signed high nibble, l the unsigned low one): words 136 + h
//    against x and 128 + l against x / 16 (exact in bf16), together q x / 16 + 144 x; the
//    16 goes into the scale.
// Four vdpbf16ps per block (one per j) add 32 weights each against the job's bf16 x copy
// in the same lane order (xn). The constant part (136 or 144 times the sum of the x of a
// lane) is taken off by starting the partial sums of every group (per-channel: of every
// block) from the precomputed seed, and each group's sums go into the accumulators with
// one FMA by the scale (per-channel: one add, the scale comes last). Products are exact
// in fp32 (8-bit by 8-bit mantissas); the sums are rounded like on the FMA path, but at
// the size of 136 |x| per weight instead of |q x|: an absolute error of about 2^-24 *
// 136 * max|x| * scale per group. That stays far below the bf16 output rounding unless a
// single x is ~1000x the typical one and its weight is 0.
template <int MB, int NB, bool INT4, bool PREFETCH>
PG_TARGET_AVX512_BF16 void small_block_nib(const SmallJob& job, const int64_t* rows, int64_t m0,
                                           float* out /* [NB][MB] */) {
  constexpr int64_t BK = INT4 ? 128 : 64;
  constexpr float kUnit = INT4 ? 1.f : 16.f;  // the sums are of q x / kUnit
  const QuantizedWeight& w = job.args->w;
  const int64_t K = job.k;
  const int64_t kvec = K / BK * BK;
  const bool grouped = w.group_size > 0;
  const int64_t gs = grouped ? w.group_size : BK;  // k per seed
  const int64_t nseed = job.nseed;
  const uint8_t* q[NB];
  for (int r = 0; r < NB; ++r) q[r] = static_cast<const uint8_t*>(w.data) + rows[r] * w.row_stride;
  const uint16_t* xn = job.xn + m0 * job.ldxn;
  const int64_t ldxn = job.ldxn;
  const float* seed = job.seed + m0 * nseed * 16;
  const int64_t lds = nseed * 16;
  const int64_t pf = w.row_stride;  // the same rows of the next quad (RowQuads)
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i c_lo = _mm512_set1_epi16(INT4 ? 0x4308 : 0x4300);
  const __m512i c_hi = _mm512_set1_epi16(0x4308);

  __m512 acc[NB][MB];
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nseed; ++g) {
    __m512 part[NB][MB];
    PG_UNROLL for (int m = 0; m < MB; ++m) {
      const __m512 sd = _mm512_load_ps(seed + m * lds + g * 16);
      PG_UNROLL for (int r = 0; r < NB; ++r) part[r][m] = sd;
    }
    const int64_t kend = (g + 1) * gs;
    for (int64_t k = g * gs; k < kend; k += BK) {
      const int64_t xo = k / BK * 128;
      __m512i raw[NB];
      PG_UNROLL for (int r = 0; r < NB; ++r)
        raw[r] = _mm512_loadu_si512(q[r] + (INT4 ? k / 2 : k));
      // The hardware prefetchers alone keep too few lines in flight per core (each row
      // is a short stream): fetch the same k of the next quad's rows (RowQuads: the next
      // row of each) into L2 now. PREFETCH: the first pass over these rows (m0 = 0); as a
      // template argument, not a runtime flag, it took 0.97-0.98x the time at M = 1, and
      // with RowQuads 0.79-0.88x where RowQuads alone took 0.91-0.97x (CPU_NOTES 61).
      if (PREFETCH)
        PG_UNROLL for (int r = 0; r < NB; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q[r]) + (INT4 ? k / 2 : k) + pf, _MM_HINT_T1);
      PG_UNROLL for (int j = 0; j < 4; ++j) {
        __m512bh wj[NB];
        PG_UNROLL for (int r = 0; r < NB; ++r) {
          const __m512i v = j == 0 ? raw[r] : _mm512_srli_epi16(raw[r], 4 * j);
          // imm 0x6A: (A & B) ^ C
          wj[r] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, (j & 1) ? c_hi : c_lo, 0x6A);
        }
        PG_UNROLL for (int m = 0; m < MB; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xn + m * ldxn + xo + j * 32);
          PG_UNROLL for (int r = 0; r < NB; ++r)
            part[r][m] = _mm512_dpbf16_ps(part[r][m], wj[r], xv);
        }
      }
    }
    if (grouped) {
      PG_UNROLL for (int r = 0; r < NB; ++r) {
        const __m512 sv = _mm512_set1_ps(kUnit * scale_at(w, rows[r], g));
        PG_UNROLL for (int m = 0; m < MB; ++m)
          acc[r][m] = _mm512_fmadd_ps(part[r][m], sv, acc[r][m]);
      }
    } else {
      PG_UNROLL for (int r = 0; r < NB; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_add_ps(acc[r][m], part[r][m]);
    }
  }
  PG_UNROLL for (int r = 0; r < NB; ++r)
    PG_UNROLL for (int m = 0; m < MB; ++m) out[r * MB + m] = _mm512_reduce_add_ps(acc[r][m]);
  if (!grouped)  // job.x is in plain k order on this path
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m)
        out[r * MB + m] = scale_at(w, rows[r], 0) *
                          (kUnit * out[r * MB + m] +
                           (kvec < K ? tail_dot(q[r], INT4, job.x + (m0 + m) * job.ldx, kvec, K) : 0.f));
}

// One pass of a block over the NB weight rows from n and the MB rows of x from m0, into
// res. A short last block repeats its final row: the extra results are dropped, and it
// avoids instantiating every kernel for every row count. Register budgets:
//  * small_block_avx512 (32 zmm): NB x MB accumulators + NB (int4: 2 NB) dequantised
//    weight vectors + the x operand. MB = 8 pairs with NB = 2; smaller MB takes NB = 4 so
//    that each x load feeds four FMAs and four independent weight streams are in flight.
//  * small_block_nib (32 zmm; it prefetches the next block of rows on its first pass over
//    x) keeps a partial sum per group next to each accumulator: 2 NB MB registers, + NB
//    raw weight vectors + NB unpacked ones + x + 3 constants. MB = 1, 2 with NB = 4; MB = 3,
//    4 with NB = 2.
//  * small_block_avx2 (16 ymm): MB = 1 with NB = 4 and MB = 2 with NB = 2 (accumulators
//    and partial sums: 2 NB MB); MB = 3, 4 with NB = 2 (NB MB accumulators + NB scales +
//    2 NB weights + x).
enum class Blk { avx512, nib, avx2 };
// small_block_avx2_i4 where the job set it up (int4, M = 1: small_rows_fma passes it two
// weight rows at a time); false: not taken.
template <int MB, int NB, bool INT4>
bool avx2_i4_block(const SmallJob& job, const int64_t* rows, float* out) {
  if constexpr (INT4 && MB == 1 && NB == 2)
    if (job.seg > 0) {
      small_block_avx2_i4<NB>(job, rows, out);
      return true;
    }
  return false;
}
// The weight rows [n0, n1) of a thread in blocks of four ("quads"), one row from each
// quarter of the range: quad i holds rows n0 + i, n0 + q + i, n0 + 2q + i and n0 + 3q + i
// (q the quarter, rounded up; rows at or past n1 are left out, always the last ones of a
// quad). A block's rows are then four streams, each through consecutive memory from one
// quad to the next, and the blocks' prefetch of "the same k of the next quad" is one row
// ahead. With four consecutive rows per block instead, at K = 2048 (1 KB int4 rows) the
// four rows were four short streams in one 4 KB page, and the next block began four new
// ones: the hardware prefetchers lost a fifth of the weight rate. On the 2-core AMX Xeon
// VM (bench/CPU_NOTES.md 61; int4 g128 M = 1, one process, 5 rounds, with small_block_nib's
// PREFETCH): 0.80x the time at K = 2048, 0.86-0.89x at 4096, 0.96-0.99x at 8192 and
// 11008 (4-5.5 KB rows); int8 per channel M = 1 and 2, g128 M = 4: 0.98-0.99x.
struct RowQuads {
  int64_t n0, n1, q;
  RowQuads(int64_t a, int64_t b) : n0(a), n1(b), q((b - a + 3) / 4) {}
  // quad i's rows into rows[4]; returns how many there are (the rest repeat the last).
  // i < q, so row n0 + i < n1 is always there: starting from it keeps the index of the
  // repeated row at 0 or more where the compiler can see it (-Warray-bounds).
  int at(int64_t i, int64_t* rows) const {
    int nb = 1;
    rows[0] = n0 + i;
    for (int r = 1; r < 4; ++r) {
      const int64_t n = n0 + r * q + i;
      if (n < n1) nb = r + 1;
      rows[r] = n < n1 ? n : rows[nb - 1];
    }
    return nb;
  }
};

// One block over the nb weight rows rows[0 .. nb) (at most NB) and the MB rows of x from
// m0, into res (column rows[r] - n0).
template <int MB, int NB, bool INT4, Blk B>
void small_pass(const SmallJob& job, const int64_t* quad, int nb, int64_t m0, float* res,
                int64_t ldr, int64_t n0) {
  int64_t rows[NB];
  for (int r = 0; r < NB; ++r) rows[r] = quad[std::min(r, nb - 1)];
  float out[NB * MB];
  // The FMA blocks that scale every weight vector (more than 2 rows of x; on AVX-512 int8
  // only, as int4's lookup table holds the scale) take a per-channel scale on the results.
  constexpr bool scales_weights = MB > 2 && (B == Blk::avx2 || (B == Blk::avx512 && !INT4));
  const bool chan = scales_weights && job.args->w.group_size == 0;
  if constexpr (B == Blk::nib) {
    if (m0 == 0)  // the first pass over these rows: it prefetches the next quad's
      small_block_nib<MB, NB, INT4, true>(job, rows, m0, out);
    else
      small_block_nib<MB, NB, INT4, false>(job, rows, m0, out);
  } else if constexpr (B == Blk::avx512) {
    if (chan)
      small_block_avx512<MB, NB, INT4, scales_weights>(job, rows, m0, out);
    else
      small_block_avx512<MB, NB, INT4, false>(job, rows, m0, out);
  } else if (!avx2_i4_block<MB, NB, INT4>(job, rows, out)) {
    if (chan)
      small_block_avx2<MB, NB, INT4, scales_weights>(job, rows, m0, out);
    else
      small_block_avx2<MB, NB, INT4, false>(job, rows, m0, out);
  }
  for (int r = 0; r < nb; ++r)
    for (int m = 0; m < MB; ++m) res[(m0 + m) * ldr + (rows[r] - n0)] = out[r * MB + m];
}
// small_pass over the nb4 <= 4 rows of a quad, NB at a time.
template <int MB, int NB, bool INT4, Blk B>
void small_passes(const SmallJob& job, const int64_t* quad, int nb4, int64_t m0, float* res,
                  int64_t ldr, int64_t n0) {
  for (int h = 0; h < nb4; h += NB)
    small_pass<MB, NB, INT4, B>(job, quad + h, std::min(NB, nb4 - h), m0, res, ldr, n0);
}

template <bool INT4>
void small_rows_nib(const SmallJob& job, int64_t n0, int64_t n1, float* res, int64_t ldr) {
  const RowQuads quads(n0, n1);
  for (int64_t i = 0; i < quads.q; ++i) {
    int64_t n[4];
    const int nb4 = quads.at(i, n);
    int64_t m0 = 0;
    if constexpr (INT4) {
      if (job.m & 4) { small_passes<4, 2, INT4, Blk::nib>(job, n, nb4, m0, res, ldr, n0); m0 += 4; }
      if ((job.m & 3) == 3) {  // one pass, not 2 + 1 (see small_rows_fma)
        small_passes<3, 2, INT4, Blk::nib>(job, n, nb4, m0, res, ldr, n0);
        continue;
      }
    }
    if (job.m & 2) { small_pass<2, 4, INT4, Blk::nib>(job, n, nb4, m0, res, ldr, n0); m0 += 2; }
    if (job.m & 1) { small_pass<1, 4, INT4, Blk::nib>(job, n, nb4, m0, res, ldr, n0); m0 += 1; }
  }
}

// ---- the tile path: more rows of x (bf16 x, AVX512-BF16) ----
//
// With more rows of x, the nibble block unpacks the weights again for every chunk of
// rows, and its per-group partial sums take half of the registers. Here the work is
// split like a small GEMM. Per block of 4 weight rows, K goes in chunks of kTileKc k; the
// first chunk of up to 4 rows of x unpacks the weights to exact bf16 (int4: a shift and
// one vpermw lookup per 32 weights; int8: through fp32) on the way and stores them in a
// 8 KB L1 buffer, from which every further chunk of rows of x reads them. Each chunk runs
// a 4 x MB register tile of vdpbf16ps (one load of x feeds 4, one load of weights MB).
// q itself is the bf16 value, so there are no offsets and no seeds. Group scales: each
// group's 16-lane partial sums go into fp32 sums in memory (4 MB vectors, next to the
// partial sums there is no room for them in registers) with one FMA by the scale; per
// channel the partial sums just carry over and the scale comes last. After the last chunk
// the 4 x MB vectors are reduced across lanes together (reduce16).
// Tried (A/B in bench/CPU_NOTES.md): slicing K so that x stays in L1 for all blocks of
// rows (x is read from L2 at 1/4 line per vdpbf16ps, which is not what bounds it).
// Lane i of the result: the sum of the 16 lanes of v[i].
PG_TARGET_AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  PG_UNROLL for (int i = 0; i < 8; ++i)  // 256-bit halves: v[2i] in lanes 0-7, v[2i+1] 8-15
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  PG_UNROLL for (int i = 0; i < 4; ++i)  // 128-bit lane t: v[4i + t]
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
  PG_UNROLL for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
  // Lane 4t + u: the sum of v[4u + t]; transposed back by the caller's index order.
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

// Word i of the table (i < 32): bf16 of the signed nibble i & 15. vpermw only looks at the
// low 5 bits of an index, so the next nibble up needs no masking.
alignas(64) const uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};

// One chunk k0 .. k0 + kc of the dot products of weight rows rows[r] (r < 4) with x rows
// m0 + m (m < MB). The weights as bf16 come from wb[r][k] (in the lane order of job.xt),
// or with UNPACK (the first chunk of rows of x) straight from the quantised rows, written
// to wb on the way for the other chunks: int4 per 128 k one 64-byte load, shifts and a
// vpermw lookup per 32 k (word i of vector j is k = 4i + j); int8 through fp32 (k order).
// UNPACK also fetches the same k of the next block of rows into L2. The fp32 sums
// [r][m][16 lanes] carry over between chunks in acc; after the last chunk they are
// reduced and res[m0 + m][col + r] (r < nb) written.
template <int MB, bool GROUPED, bool UNPACK, bool INT4>
PG_TARGET_AVX512_BF16 void tile_block(const SmallJob& job, const int64_t* rows, uint16_t* wb,
                                      int64_t k0, int64_t kc, int64_t m0, float* acc,
                                      const float* sc, bool first, bool last, bool prefetch,
                                      int nb, float* res, int64_t ldr, int64_t col) {
  const QuantizedWeight& w = job.args->w;
  const uint16_t* x = job.xt + m0 * job.ldxt + k0;
  const int64_t ldx = job.ldxt;
  const int64_t gs = GROUPED ? w.group_size : kc;
  constexpr int J = UNPACK && INT4 ? 4 : 1;  // steps of 32 k per 64-byte weight load
  const uint8_t* q[4];
  PG_UNROLL for (int r = 0; r < 4; ++r)
    q[r] = static_cast<const uint8_t*>(w.data) + rows[r] * w.row_stride + (INT4 ? k0 / 2 : k0);
  const int64_t pf = 4 * w.row_stride;
  const __m512i table = _mm512_load_si512(kNibbleBf16);
  __m512 part[4][MB];
  for (int64_t g = 0; g < kc; g += gs) {
    PG_UNROLL for (int r = 0; r < 4; ++r)
      PG_UNROLL for (int m = 0; m < MB; ++m)
        part[r][m] = GROUPED || first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r * MB + m) * 16);
    for (int64_t k = g; k < g + gs; k += 32 * J) {
      __m512i raw[4];
      if constexpr (UNPACK && INT4)
        PG_UNROLL for (int r = 0; r < 4; ++r) {
          raw[r] = _mm512_loadu_si512(q[r] + k / 2);
          if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(q[r] + k / 2 + pf), _MM_HINT_T1);
        }
      PG_UNROLL for (int j = 0; j < J; ++j) {
        const int64_t kk = k + 32 * j;
        __m512bh wv[4];
        PG_UNROLL for (int r = 0; r < 4; ++r) {
          if constexpr (!UNPACK) {
            wv[r] = (__m512bh)_mm512_load_si512(wb + r * kc + kk);
            continue;
          } else if constexpr (INT4) {
            wv[r] = (__m512bh)_mm512_permutexvar_epi16(
                j == 0 ? raw[r] : _mm512_srli_epi16(raw[r], 4 * j), table);
          } else {
            const int8_t* src = reinterpret_cast<const int8_t*>(q[r]) + kk;
            if (prefetch && (kk & 63) == 0)
              _mm_prefetch(reinterpret_cast<const char*>(src) + pf, _MM_HINT_T1);
            const __m512 lo = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
            const __m512 hi = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
            wv[r] = _mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128
          }
          _mm512_store_si512(wb + r * kc + kk, (__m512i)wv[r]);
        }
        PG_UNROLL for (int m = 0; m < MB; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + kk);
          PG_UNROLL for (int r = 0; r < 4; ++r) part[r][m] = _mm512_dpbf16_ps(part[r][m], wv[r], xv);
        }
      }
    }
    if constexpr (GROUPED) {
      PG_UNROLL for (int r = 0; r < 4; ++r) {
        const __m512 sv = _mm512_set1_ps(sc[r * job.ngroups]);
        PG_UNROLL for (int m = 0; m < MB; ++m) {
          float* a = acc + (r * MB + m) * 16;
          _mm512_store_ps(a, first && g == 0 ? _mm512_mul_ps(part[r][m], sv)
                                             : _mm512_fmadd_ps(part[r][m], sv, _mm512_load_ps(a)));
        }
      }
      ++sc;
    } else if (!last) {
      PG_UNROLL for (int r = 0; r < 4; ++r)
        PG_UNROLL for (int m = 0; m < MB; ++m) _mm512_store_ps(acc + (r * MB + m) * 16, part[r][m]);
    }
  }
  if (!last) return;
  __m512 v[16];
  PG_UNROLL for (int m = 0; m < 4; ++m)
    PG_UNROLL for (int r = 0; r < 4; ++r) {
      if (m >= MB)
        v[4 * m + r] = _mm512_setzero_ps();
      else if constexpr (GROUPED)
        v[4 * m + r] = _mm512_load_ps(acc + (r * MB + m) * 16);
      else
        v[4 * m + r] = part[r][m];
    }
  alignas(64) float sums[16];  // sums[4 r + m]
  _mm512_store_ps(sums, reduce16(v));
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < nb; ++r)
      res[(m0 + m) * ldr + col + r] = sums[4 * r + m] * (GROUPED ? 1.f : sc[r]);
}

template <int MB, bool INT4>
void tile_block_any(const SmallJob& job, const int64_t* rows, uint16_t* wb, int64_t k0,
                    int64_t kc, int64_t m0, float* acc, const float* sc, bool first, bool last,
                    bool prefetch, int nb, float* res, int64_t ldr, int64_t col) {
  const bool grouped = job.args->w.group_size > 0;
  auto* f = m0 == 0 ? (grouped ? tile_block<MB, true, true, INT4> : tile_block<MB, false, true, INT4>)
                    : (grouped ? tile_block<MB, true, false, INT4> : tile_block<MB, false, false, INT4>);
  f(job, rows, wb, k0, kc, m0, acc, sc, first, last, prefetch, nb, res, ldr, col);
}

// Blocks of 4 weight rows; per block, K in chunks of job.kc, each for every chunk of up
// to 4 rows of x (the first one unpacks the weights).
template <bool INT4>
void small_rows_tile(const SmallJob& job, int64_t n0, int64_t n1, float* res, int64_t ldr) {
  const QuantizedWeight& w = job.args->w;
  const int64_t M = job.m, K = job.k, kvec = job.kvec, kcmax = job.kc;
  uint16_t* wb = reinterpret_cast<uint16_t*>(scratch(6, size_t(2 * kcmax)));
  const int64_t ng = job.ngroups;
  float* acc = scratch(7, size_t(4 * 16 * M + 4 * ng));
  float* scales = acc + 4 * 16 * M;  // [4][ng] the rows' scales as fp32
  for (int64_t n = n0; n < n1; n += 4) {
    const int nb = int(std::min<int64_t>(4, n1 - n));
    int64_t rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = n + std::min(r, nb - 1);
    for (int r = 0; r < 4; ++r)
      for (int64_t g = 0; g < ng; ++g) scales[r * ng + g] = scale_at(w, rows[r], g);
    for (int64_t k0 = 0; k0 < kvec; k0 += kcmax) {
      const int64_t kc = std::min(kcmax, kvec - k0);
      const bool first = k0 == 0, last = k0 + kc >= kvec, pf = n + 4 < n1;
      const float* sc = scales + (w.group_size > 0 ? k0 / w.group_size : 0);
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4)
        tile_block_any<4, INT4>(job, rows, wb, k0, kc, m0, acc + 64 * m0, sc, first, last, pf, nb, res, ldr, n - n0);
      switch (M - m0) {
        case 3: tile_block_any<3, INT4>(job, rows, wb, k0, kc, m0, acc + 64 * m0, sc, first, last, pf, nb, res, ldr, n - n0); break;
        case 2: tile_block_any<2, INT4>(job, rows, wb, k0, kc, m0, acc + 64 * m0, sc, first, last, pf, nb, res, ldr, n - n0); break;
        case 1: tile_block_any<1, INT4>(job, rows, wb, k0, kc, m0, acc + 64 * m0, sc, first, last, pf, nb, res, ldr, n - n0); break;
        default: break;
      }
    }
  }
  if (kvec < K)  // per-channel only; job.x is in plain k order on this path
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = static_cast<const uint8_t*>(w.data) + n * w.row_stride;
      const float s = scale_at(w, n, 0);
      for (int64_t m = 0; m < M; ++m)
        res[m * ldr + (n - n0)] += s * tail_dot(q, INT4, job.x + m * job.ldx, kvec, K);
    }
}

// The FMA blocks (B: avx512 or avx2) over weight rows n0 .. n1 and every row of x.
template <bool INT4, Blk B>
void small_rows_fma(const SmallJob& job, int64_t n0, int64_t n1, float* res, int64_t ldr) {
  // Rows of x in chunks of C, then (avx512) at most one of 4, and one of 3, 2 or 1; each
  // block of weight rows is read from memory by the first chunk and from L1 by the others.
  // Every chunk dequantises the block again, so 3 rows are one chunk, not 2 + 1 (as 2 + 1,
  // M = 3 took 1.2x the time of M = 4 on the AMX host, bench/CPU_NOTES.md 23). On AVX2,
  // chunks of 4 rows x 2 weight rows beat 8 x 1 (the 16 ymm fit either) by 10-30 % at
  // M = 8 and 16 (bench/CPU_NOTES.md 25): half the loads of x per FMA.
  constexpr bool Z = B == Blk::avx512;
  constexpr int C = Z ? 8 : 4;
  constexpr int NBS = Z ? 4 : 2;  // weight rows per block for 2 and 3 rows (see small_pass)
  const int64_t mc = job.m / C * C;
  const int64_t rest = job.m - mc;
  const RowQuads quads(n0, n1);
  for (int64_t i = 0; i < quads.q; ++i) {
    int64_t n[4];
    const int nb4 = quads.at(i, n);
    for (int64_t m0 = 0; m0 < mc; m0 += C) small_passes<C, 2, INT4, B>(job, n, nb4, m0, res, ldr, n0);
    int64_t m0 = mc;
    if constexpr (Z)
      if (rest & 4) { small_passes<4, 4, INT4, B>(job, n, nb4, m0, res, ldr, n0); m0 += 4; }
    switch (rest & 3) {
      case 3: small_passes<3, NBS, INT4, B>(job, n, nb4, m0, res, ldr, n0); break;
      case 2: small_passes<2, NBS, INT4, B>(job, n, nb4, m0, res, ldr, n0); break;
      case 1:
        // small_block_avx2_i4 takes two weight rows: with four its constants left the
        // registers (a memory operand per vpshufb), 1.13x slower on cache-resident weights.
        if constexpr (B == Blk::avx2 && INT4)
          if (job.seg > 0) {
            small_passes<1, 2, INT4, B>(job, n, nb4, m0, res, ldr, n0);
            break;
          }
        small_pass<1, 4, INT4, B>(job, n, nb4, m0, res, ldr, n0);
        break;
      default: break;
    }
  }
}

// ---- AVX2, more rows of x: each weight dequantised once ----
//
// small_rows_fma dequantises a block of weight rows again for every chunk of 4 rows of x:
// per 8 weights a widening load, shifts, a convert and a multiply, against 4 FMAs a chunk.
// From dq_min_rows rows (job.dq), each pair of weight rows is instead dequantised once into
// a buffer (dequant_row over all of K: q * s in fp32, the products small_block_avx2 forms
// when it scales the weights; any group size), and a register tile of up to 6 rows of x
// x the 2 weight rows runs FMAs along k over every row of x, with x in plain k order.
// Chunks of K small enough for L1 were slower on the Zen 1 VM of bench/CPU_NOTES.md 53
// (one thread, M = 16, 4096^2, time against small_rows_fma: 1.36x at 128 k, 1.24x at
// 256, 1.04x at 512, 0.98x with all of K; at 28672 k and M = 32 chunks of 2048 took 0.89x,
// all of K 0.80x), so a pass takes the whole rows.

// The AVX2 cores whose crossovers below were measured apart. Zen and Zen+ (AMD family 17h
// below model 30h, and Hygon's family 18h built on them) run every 256-bit AVX2 operation
// as two 128-bit halves: there the dense path's FMA-bound micro-kernel is relatively slower
// than on cores with two full-width FMA pipes (Intel's, Zen 2 on). The later Zen cores
// (AMD family 17h from model 30h, 19h and on) are full-width, but small_rows_dq_avx2 ran
// slower there than what it replaced (bench/CPU_NOTES.md 73).
enum class Avx2Core { zen_half_width, zen, other };
Avx2Core avx2_core() {
  static const Avx2Core core = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return Avx2Core::other;
    char vendor[12];
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    if (!__get_cpuid(1, &a, &b, &c, &d)) return Avx2Core::other;
    unsigned family = (a >> 8) & 0xF, model = (a >> 4) & 0xF;
    if (family == 0xF) {
      family += (a >> 20) & 0xFF;
      model |= ((a >> 16) & 0xF) << 4;
    }
    const bool amd = std::memcmp(vendor, "AuthenticAMD", 12) == 0;
    if ((amd && family == 0x17 && model < 0x30) ||
        (std::memcmp(vendor, "HygonGenuine", 12) == 0 && family == 0x18))
      return Avx2Core::zen_half_width;
    return amd && family >= 0x17 ? Avx2Core::zen : Avx2Core::other;
  }();
  return core;
}
bool avx2_half_width() { return avx2_core() == Avx2Core::zen_half_width; }

// PORTABLE_GEMM_AVX2_DQ, read once: "0" never runs small_rows_dq_avx2, "1" runs it on every
// AVX2 core over that core's rows below (on the later Zen cores Intel's), anything else
// leaves the choice to the core (the Python layer warns about other values).
enum class DqRequest { none, off, on };
DqRequest dq_request() {
  static const DqRequest req = [] {
    const char* env = std::getenv("PORTABLE_GEMM_AVX2_DQ");
    if (env == nullptr) return DqRequest::none;
    if (std::strcmp(env, "0") == 0) return DqRequest::off;
    if (std::strcmp(env, "1") == 0) return DqRequest::on;
    return DqRequest::none;
  }();
  return req;
}

// Rows of x from which small_rows_dq_avx2 runs, against small_rows_fma, which needs a
// pass over the weights per 4 rows of x. Time against small_rows_fma's, 2 threads, 4096^2
// unless said (bench/CPU_NOTES.md 53, 55, 73):
//  * the Zen 1 VM: int8 g128 1.26x at M = 8, 1.03x at 12, 0.89x at 13, 0.85-0.94x at 16,
//    0.77-0.86x at 32; int8 per channel 0.90x at 13; int4 g128 0.92x at 13, 0.88x at 16;
//    int4 per channel 0.95-0.99x small_rows_fma's time at 13-15 (there small_rows_fma
//    scales the results, not the weights), this path 0.95x its time at 16. From 13 rows
//    (int4 per channel 16).
//  * a Xeon VM under PORTABLE_GEMM_ISA=avx2: int8 g128 1.07x at M = 8, 0.92x at 10, 0.83x
//    at 12; int8 per channel 0.90x at 9, 0.89x at 10; int4 g128 0.82x at 12, 0.84x at 10
//    (8192^2); int4 per channel 0.81x at 10 and 12, 0.80x at 15. From 9 rows.
//  * a Zen 3 VM (AVX2 only): 1.11-1.54x small_rows_fma's time at M = 9, 12 and 16 (int8
//    per channel and int4 g128 at 4096^2, int8 g128 and int4 per channel at 11008 x 4096),
//    1.04-1.20x at 24 and 32, 0.88-1.06x the dense path's at 48 (8 alternating rounds
//    each, medians).
//    Not run there (nor, unmeasured, on the other full-width Zen cores) unless asked.
int64_t dq_min_rows(const QuantizedWeight& w) {
  if (!avx2_half_width()) return 9;
  return w.bits == 4 && w.group_size == 0 ? 16 : 13;
}

// Up to dq_max_rows it also beats the dense path (dequantised B panels, gemm.cpp's 6 x 16
// kernel), whose packing (a dequantised row, then a transpose) was 22 % of its samples at
// M = 64 on the Zen 1 VM (perf). Time against the dense path's (section 53, 55):
//  * the Zen 1 VM: 0.68-0.89x at M = 33-64 (int8 and int4, 4096^2 and 11008 x 4096; int4
//    g128 at 4096 x 12288 0.97x), at 96 int8 g128 0.82x and int4 g128 1.00x, at 128 0.85x
//    (int8) and 0.94x (int4 per channel), at 160 0.93x, at 192 0.98x, at 256 1.16x.
//  * the Xeon VM as AVX2: 0.87x at 48 (int8 per channel), 0.84x at 40 (8192^2); at 64
//    1.04x / 0.97x (4096^2), 1.27x (8192^2), 1.58x (K = 12288); 1.06x at 96, 1.2-1.25x at
//    128.
// Every pair of weight rows reads all of x, so x (as fp32) must stay in the caches: at
// most kDqMaxX bytes (M = 32 at 28672 k, 3.7 MB, ran 0.80x small_rows_fma's time on the
// Zen 1 VM's 8 MB of L3; M = 16 at 28672 k 0.80x on the Xeon VM).
int64_t dq_max_rows() { return avx2_half_width() ? 128 : 48; }
constexpr int64_t kDqMaxX = int64_t(4) << 20;
bool dq_applies(const MixedLinearArgs& a) {
  const int64_t m = a.x.rows;
  const DqRequest req = dq_request();
  if (req == DqRequest::off || (req == DqRequest::none && avx2_core() == Avx2Core::zen)) return false;
  return active_isa() == Isa::avx2 && m >= dq_min_rows(a.w) && m <= dq_max_rows() &&
         m * a.w.k * int64_t(sizeof(float)) <= kDqMaxX;
}

}  // namespace

const char* avx2_dq_path() {
  if (active_isa() != Isa::avx2) return "";
  const DqRequest req = dq_request();
  if (req == DqRequest::off) return "off (PORTABLE_GEMM_AVX2_DQ=0)";
  // dq_min_rows / dq_max_rows / kDqMaxX in words ("int4 per channel": group_size 0)
#define PG_DQ_ZEN1_ROWS "13 to 128 rows of x (int4 per channel from 16) while x fits 4 MiB as fp32 ("
#define PG_DQ_ROWS "9 to 48 rows of x while x fits 4 MiB as fp32"
  if (avx2_core() == Avx2Core::zen_half_width)
    return req == DqRequest::on
               ? PG_DQ_ZEN1_ROWS "PORTABLE_GEMM_AVX2_DQ=1; a Zen / Zen+ core: half-width AVX2)"
               : PG_DQ_ZEN1_ROWS "a Zen / Zen+ core: half-width AVX2)";
  if (req == DqRequest::on) return PG_DQ_ROWS " (PORTABLE_GEMM_AVX2_DQ=1)";
  if (avx2_core() == Avx2Core::zen)
    return "off on this core (a later Zen: AMD family 17h from model 30h, 19h on; "
           "PORTABLE_GEMM_AVX2_DQ=1 turns it on)";
  return PG_DQ_ROWS;
#undef PG_DQ_ZEN1_ROWS
#undef PG_DQ_ROWS
}

namespace {

// res[m * ldr + r] = sum over k < k8 (a multiple of 8) of w_r[k] * x[m][k], for r < 1 + two.
// Per 8 k: 2 + MB loads for 2 MB FMAs; MB = 6 holds 12 sums, 2 weights and x (15 ymm).
template <int MB>
PG_TARGET_AVX2 void dq_tile_avx2(const float* x, int64_t ldx, const float* w0, const float* w1,
                                 int64_t k8, float* res, int64_t ldr, bool two) {
  __m256 a0[MB], a1[MB];
  PG_UNROLL for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    const __m256 b0 = _mm256_loadu_ps(w0 + k), b1 = _mm256_loadu_ps(w1 + k);
    PG_UNROLL for (int m = 0; m < MB; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      // One load of x for both FMAs: gcc otherwise folds it into each as a memory operand,
      // 14 loads per 12 FMAs (bench/CPU_NOTES.md 53).
      asm("" : "+x"(xv));
      a0[m] = _mm256_fmadd_ps(b0, xv, a0[m]);
      a1[m] = _mm256_fmadd_ps(b1, xv, a1[m]);
    }
  }
  PG_UNROLL for (int m = 0; m < MB; ++m) {
    res[m * ldr] = hsum_avx2(a0[m]);
    if (two) res[m * ldr + 1] = hsum_avx2(a1[m]);
  }
}

// Weight rows n0 .. n1 against every row of x (rows zero-padded from K to ldx).
PG_TARGET_AVX2 void small_rows_dq_avx2(const SmallJob& job, int64_t n0, int64_t n1, float* res,
                                       int64_t ldr) {
  const QuantizedWeight& w = job.args->w;
  const int64_t M = job.m, K = job.k, ldx = job.ldx, k8 = (K + 7) / 8 * 8;
  float* wb = scratch(6, size_t(2 * k8));
  std::fill(wb, wb + 2 * k8, 0.f);  // the pads from K to k8 stay zero
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;  // a single last row: its twin's sums are dropped
    dequant_row(w, n, 0, K, wb);
    dequant_row(w, two ? n + 1 : n, 0, K, wb + k8);
    float* r = res + (n - n0);
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) dq_tile_avx2<6>(job.x + m * ldx, ldx, wb, wb + k8, k8, r + m * ldr, ldr, two);
    const float* x = job.x + m * ldx;
    r += m * ldr;
    switch (M - m) {
      case 5: dq_tile_avx2<5>(x, ldx, wb, wb + k8, k8, r, ldr, two); break;
      case 4: dq_tile_avx2<4>(x, ldx, wb, wb + k8, k8, r, ldr, two); break;
      case 3: dq_tile_avx2<3>(x, ldx, wb, wb + k8, k8, r, ldr, two); break;
      case 2: dq_tile_avx2<2>(x, ldx, wb, wb + k8, k8, r, ldr, two); break;
      case 1: dq_tile_avx2<1>(x, ldx, wb, wb + k8, k8, r, ldr, two); break;
      default: break;
    }
  }
}
#else
}  // namespace

const char* avx2_dq_path() { return ""; }  // no AVX2 kernels in this build

namespace {
#endif

void small_task_impl(const SmallJob& job, int64_t n0, int64_t n1) {
  const int64_t cols = n1 - n0;
  float* res = scratch(0, size_t(job.m * cols));
#if PG_X86
  if (job.xt != nullptr) {
    if (job.args->w.bits == 4)
      small_rows_tile<true>(job, n0, n1, res, cols);
    else
      small_rows_tile<false>(job, n0, n1, res, cols);
  } else if (job.xn != nullptr) {
    if (job.args->w.bits == 4)
      small_rows_nib<true>(job, n0, n1, res, cols);
    else
      small_rows_nib<false>(job, n0, n1, res, cols);
  } else if (job.vec == Vec::avx512) {
    if (job.args->w.bits == 4)
      small_rows_fma<true, Blk::avx512>(job, n0, n1, res, cols);
    else
      small_rows_fma<false, Blk::avx512>(job, n0, n1, res, cols);
  } else if (job.dq) {
    small_rows_dq_avx2(job, n0, n1, res, cols);
  } else if (job.vec == Vec::avx2) {
    if (job.args->w.bits == 4)
      small_rows_fma<true, Blk::avx2>(job, n0, n1, res, cols);
    else
      small_rows_fma<false, Blk::avx2>(job, n0, n1, res, cols);
  } else if (active_isa() == Isa::avx2) {
    small_rows_rowwise<dot_avx2>(job, n0, n1, res, cols);
  } else
#endif
  {
    small_rows_rowwise<dot_portable>(job, n0, n1, res, cols);
  }
  job.ep.store(res, cols, 0, job.m, n0, cols);
}

void small_task(void* ctx, int64_t n0, int64_t n1) {
  const SmallJob& job = *static_cast<const SmallJob*>(ctx);
  guarded(job.failed, [&] { small_task_impl(job, n0, n1); });
}

// small_block_nib, for the fewest rows of x (from more rows on, small_rows_tile).
int64_t nib_max_m(const QuantizedWeight& w) {
  const bool grouped = w.group_size > 0;
  return w.bits == 4 ? (grouped ? 7 : 3) : (grouped ? 2 : 1);
}
// On AMX CPUs, M below amx_min_m (above it amx_linear) takes the fp32 FMA blocks instead of
// the vdpbf16ps ones (small_block_nib, small_rows_tile), except int4 at M = 1. By the
// timings there, vdpbf16ps does no more multiply-adds per cycle than the FMA units, so the
// bf16 blocks' extra work (unpacking nibbles; int8 as two nibble dot products) is not paid
// back where the weights come from cache.
// Measured on the AMX Xeon of bench/CPU_NOTES.md 21, 23 and 27 (2 threads, against torch's
// weight-only kernels): int8 per channel M = 1 1.11-1.25x on the FMA blocks, 0.73-0.81x on
// the nibble blocks; int8 M = 2 and 4 1.07-1.37x against 0.65-0.77x on the tile blocks.
// int4 with the weights streaming from memory (as in decoding, and in bench/cpu_bench.py)
// took the nibble block up to M = 3 while the FMA blocks prefetched only 512 bytes ahead
// at M = 1 (sections 27, 51). Since they fetch the next block's rows (section 54), the FMA
// blocks' time over the nibble block's on the 2-core Xeon VM, one process: M = 2 0.84-0.89,
// M = 3 0.65-0.78 (int4 g128 and per channel, K = 4096 and 8192), M = 1 1.01 (0.92-1.56
// over rounds). On the Zen 4 dev VM (no AMX) the bf16 blocks are the faster ones; AMX
// stands for that kind of core here.
bool fma_first(const MixedLinearArgs& a) {
  const int64_t m = a.x.rows;
  return m < amx_min_m(a.w) && (a.w.bits == 8 || m > 1) && amx_supported();
}
bool small_m_nib(const MixedLinearArgs& a) {
  return small_m_bf16(a) && a.x.rows <= nib_max_m(a.w) && !fma_first(a);
}

// Every |x| < 2^100 (no inf or NaN either): the seeds cannot overflow, and x / 16 stays
// far from the bf16 subnormals (which vdpbf16ps flushes) unless x itself is tiny.
bool x_fits_nib(const ConstMatrix& x) {
  const uint16_t* p = static_cast<const uint16_t*>(x.data);
  uint16_t worst = 0;
  for (int64_t m = 0; m < x.rows; ++m)
    for (int64_t k = 0; k < x.cols; ++k)
      worst = std::max<uint16_t>(worst, p[m * x.row_stride + k * x.col_stride] & 0x7FFF);
  return worst < 0x7180;  // bf16 2^100
}

// job.xn and job.seed from the plain fp32 x (job.x, exact copies of the bf16 values). Per
// block b of BK k, 4 vectors of 32 bf16 words in the lane order of small_block_nib:
//  * int4: vector j, word i = x[b + 4i + j]; lane p of the results sums k = b + 8p .. +7;
//  * int8: x[b + 2i] / 16, x[b + 2i], x[b + 2i + 1] / 16, x[b + 2i + 1]; lane p sums
//    k = b + 4p .. +3.
// seed[m][g][p] = -136 (int4) or -144 (int8) times the sum of x over lane p's k in group
// g (per-channel: in block g).
void prepare_nib(const MixedLinearArgs& args, SmallJob& job) {
  const bool int4 = args.w.bits == 4;
  const int64_t bk = int4 ? 128 : 64, K = job.k, M = job.m;
  const int64_t kvec = K / bk * bk;
  const int64_t gs = args.w.group_size > 0 ? args.w.group_size : bk;
  job.nseed = kvec / gs;
  job.ldxn = kvec / bk * 128 + 32;  // + one cache line: rows of x in different L1 sets
  uint16_t* xn = reinterpret_cast<uint16_t*>(scratch(1, size_t(M * job.ldxn / 2 + 16)));
  float* seed = scratch(5, size_t(M * job.nseed * 16));
  const float c = int4 ? -136.f : -144.f;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = job.x + m * job.ldx;
    uint16_t* d = xn + m * job.ldxn;
    float* sd = seed + m * job.nseed * 16;
    for (int64_t i = 0; i < job.nseed * 16; ++i) sd[i] = 0.f;
    for (int64_t b = 0; b < kvec; b += bk) {
      uint16_t* v = d + b / bk * 128;
      float* sg = sd + (b / gs) * 16;
      const float* xb = xm + b;
      if (int4) {
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 32; ++i) v[j * 32 + i] = f32_to_bf16(xb[4 * i + j]);
        for (int p = 0; p < 16; ++p)
          for (int t = 0; t < 8; ++t) sg[p] += xb[8 * p + t];
      } else {
        for (int i = 0; i < 32; ++i) {
          v[i] = f32_to_bf16(xb[2 * i] * 0.0625f);
          v[32 + i] = f32_to_bf16(xb[2 * i]);
          v[64 + i] = f32_to_bf16(xb[2 * i + 1] * 0.0625f);
          v[96 + i] = f32_to_bf16(xb[2 * i + 1]);
        }
        for (int p = 0; p < 16; ++p)
          for (int t = 0; t < 4; ++t) sg[p] += xb[4 * p + t];
      }
    }
    for (int64_t i = 0; i < job.nseed * 16; ++i) sd[i] *= c;
  }
  job.xn = xn;
  job.seed = seed;
}

// job.xt for small_rows_tile from the plain fp32 x (exact copies of the bf16 values): int4
// in the nibble lane order (per 128 k, vector j word i = x[k + 4i + j]), int8 in k order;
// and the chunk of K per pass (kTileKc, whole groups).
void prepare_tile(const MixedLinearArgs& args, SmallJob& job) {
  const bool int4 = args.w.bits == 4;
  const int64_t bk = nib_bk(args.w), K = job.k, M = job.m;
  const int64_t unit = args.w.group_size > 0 ? args.w.group_size : bk;
  job.kvec = K / bk * bk;
  job.kc = std::min(job.kvec, std::max<int64_t>(1, kTileKc / unit) * unit);
  job.ngroups = args.w.group_size > 0 ? K / args.w.group_size : 1;
  job.ldxt = job.kvec + 32;  // + one cache line: rows of x in different L1 sets
  uint16_t* xt = reinterpret_cast<uint16_t*>(scratch(1, size_t(M * job.ldxt / 2 + 16)));
  // job.x holds exact copies of bf16 values (the tile path takes bf16 x only): the high
  // half of each float is the bf16 word. Taken as it is, without f32_to_bf16's rounding
  // and NaN branch, the copy of 16 rows at K = 4096 took 0.009 ms instead of 0.023
  // (bench/CPU_NOTES.md 34).
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = job.x + m * job.ldx;
    uint16_t* d = xt + m * job.ldxt;
    if (!int4) {
      for (int64_t k = 0; k < job.kvec; ++k) d[k] = uint16_t(f32_to_bits(xm[k]) >> 16);
      continue;
    }
    for (int64_t b = 0; b < job.kvec; b += 128)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) d[b + 32 * j + i] = uint16_t(f32_to_bits(xm[b + 4 * i + j]) >> 16);
  }
  job.xt = xt;
}

// Every |x| < limit (so no inf or NaN either).
bool x_below(const float* x, int64_t M, int64_t K, int64_t ldx, float limit) {
  bool ok = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) ok &= std::fabs(x[m * ldx + k]) < limit;
  return ok;
}

// job.seed for small_block_avx2_i4 from the permuted x: per row of x and segment of job.seg
// k (the last one ends at the last whole 64 k), -1.0625 times the sum of x over each lane.
void prepare_avx2_i4(SmallJob& job) {
  const int64_t kvec = job.k / 64 * 64;
  job.nseed = (kvec + job.seg - 1) / job.seg;
  float* seed = scratch(5, size_t(job.m * job.nseed * 8));
  for (int64_t m = 0; m < job.m; ++m) {
    const float* xm = job.x + m * job.ldx;
    float* sd = seed + m * job.nseed * 8;
    for (int64_t i = 0; i < job.nseed * 8; ++i) sd[i] = 0.f;
    for (int64_t b = 0; b < kvec; b += 64)
      for (int64_t i = 0; i < 64; ++i) sd[b / job.seg * 8 + i % 8] += xm[b + i];
    for (int64_t i = 0; i < job.nseed * 8; ++i) sd[i] *= -1.0625f;
  }
  job.seed = seed;
}

bool small_m(const MixedLinearArgs& args, const Executor& exec) {
  const int64_t M = args.x.rows, N = args.w.n, K = args.w.k;
  SmallJob job;
  job.args = &args;
  job.m = M;
  job.n = N;
  job.k = K;
  job.ep.act = args.activation;
  job.ep.c = args.y;
  const Vec vec = active_isa() == Isa::avx512 ? Vec::avx512
                  : active_isa() == Isa::avx2 ? Vec::avx2
                                              : Vec::none;
  // The k step of the FMA blocks, and for int4 the k of one nibble half of it.
  const int64_t half = vec == Vec::avx512 ? 16 : 8;
  const int64_t step = args.w.bits == 4 || vec == Vec::avx2 ? 2 * half : half;
  if (args.w.group_size == 0 || args.w.group_size % step == 0) job.vec = vec;
  const bool avx512 = job.vec == Vec::avx512;
  if (args.bias != nullptr) {
    float* b = scratch(3, size_t(N));
    convert_to_f32(args.bias, args.bias_stride, args.y.dtype, N, b);
    job.ep.bias = b;
  }
  // x as contiguous fp32, shared read-only by all threads; row stride padded to 16
  // floats so vector loads of different rows start on cache-line boundaries.
  job.ldx = (K + 15) / 16 * 16;
#if PG_X86
  job.dq = dq_applies(args);
#endif
  float* x = scratch(2, size_t(M * job.ldx));
  const int64_t es = int64_t(dtype_size(args.x.dtype));
  const char* xb = static_cast<const char*>(args.x.data);
  const bool nib = avx512 && small_m_nib(args) && x_fits_nib(args.x);
  const bool tile = avx512 && !nib && small_m_bf16(args) && !fma_first(args);
  const bool permute = job.vec != Vec::none && args.w.bits == 4 && !nib && !tile && !job.dq;
  for (int64_t m = 0; m < M; ++m) {
    float* xm = x + m * job.ldx;
    convert_to_f32(xb + m * args.x.row_stride * es, args.x.col_stride, args.x.dtype, K, xm);
    std::fill(xm + K, xm + job.ldx, 0.f);  // small_rows_dq_avx2 reads whole vectors
  }
  // int4 at M = 1 on AVX2: small_block_avx2_i4 for a bf16 or f16 output (its offset
  // sums' rounding, ~2^-16 of the result, is far below theirs but not below fp32's),
  // unless x is so large (or not finite) that those sums could overflow. At M = 2 it was
  // 1.06x slower than small_block_avx2 (bench/CPU_NOTES.md 47).
  if (permute && job.vec == Vec::avx2 && M == 1 && K >= 64 && args.w.group_size % 64 == 0 &&
      args.y.dtype != DType::f32 && x_below(x, M, K, job.ldx, 0x1p100f))
    job.seg = args.w.group_size > 0 ? args.w.group_size : 256;
  if (permute) {
    float* tmp = scratch(4, size_t(K));
    const int64_t blk = job.seg > 0 ? 64 : step;  // k per permuted block
    const int64_t kvec = K / blk * blk;
    for (int64_t m = 0; m < M; ++m) {
      float* xm = x + m * job.ldx;
      std::memcpy(tmp, xm, size_t(kvec) * sizeof(float));
      for (int64_t b = 0; b < kvec; b += blk) {
        if (job.seg > 0) {
          for (int64_t j = 0; j < 8; ++j)
            for (int64_t l = 0; l < 8; ++l) xm[b + 8 * j + l] = tmp[b + 8 * l + j];
        } else {
          for (int64_t j = 0; j < half; ++j) {
            xm[b + j] = tmp[b + 2 * j];
            xm[b + half + j] = tmp[b + 2 * j + 1];
          }
        }
      }
    }
  }
  job.x = x;
  if (job.seg > 0) prepare_avx2_i4(job);
  if (nib)  // both need AVX512-BF16, so never on other CPUs
    prepare_nib(args, job);
  else if (tile)
    prepare_tile(args, job);
  const int64_t threads = executor_threads(exec);
  // Threads get contiguous blocks of whole weight rows, at least 16 each, and only
  // when the weight is big enough to amortise waking them.
  if (threads > 1 && exec.parallel_for != nullptr && N * K * (M + 1) >= (1 << 20))
    run_tasks(exec, 0, N, std::max<int64_t>(16, (N + threads - 1) / threads), small_task, &job);
  else
    small_task(&job, 0, N);
  return !job.failed.load();
}

// ---- AMX path (bf16 activations) ---------------------------------------------------
//
// y^T = W x^T on the tile unit: the A operand is the weight (16 output channels x 32 k,
// dequantised in registers to bf16, stored row-major into a small L1 buffer: no
// transpose needed), the B operand is x^T in the VNNI pair layout (packed once per
// call), the fp32 accumulators are [16 channels x 16 rows of x]. bf16 x is used as is,
// so this changes no rounding of x; int8 and int4 values are exact in bf16. Per-channel
// scales are applied to the fp32 results; group scales are folded into the weights
// before their rounding to bf16 (relative error 2^-9 per weight, far inside the bf16
// output tolerance). Only taken for bf16 x (f16 / f32 x would lose precision).

#if PG_X86
// The blocks of each row prefetched into L2 ahead of it (amx_dequant, amx_rows;
// bench/CPU_NOTES.md 58: one block ahead was slower; kAmxKc: see above).
constexpr int64_t kAmxPfBlocks = 2;

struct AmxJob {
  const MixedLinearArgs* args;
  const uint16_t* xp;  // [K / 2][mpad][2] bf16 (int4: k permuted, see int4_k_at)
  int64_t mpad;        // rows of x padded to 16 (to 32 when > 16)
  int64_t m, n, k;
  int64_t nbk;           // channels per block (amx_rows): 64 up to 16 rows of x, else 32
  bool scale_in_weight;  // group scales: folded into the bf16 weights
  Epilogue ep;
  mutable std::atomic<bool> failed{false};
};

// The table for int4 (amx_int4_row): words 0-15 the 16 nibble values times s_lo, words
// 16-31 times s_hi, in bf16 (the same rounding as converting q * s).
PG_TARGET_AMX inline __m512i int4_table(float s_lo, float s_hi) {
  const __m512 vals = nibble_table();
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(vals, _mm512_set1_ps(s_hi)),
                                      _mm512_mul_ps(vals, _mm512_set1_ps(s_lo)));
}
PG_TARGET_AMX inline __m512i int4_table(float s) {
  const __m512 v = _mm512_mul_ps(nibble_table(), _mm512_set1_ps(s));
  return (__m512i)_mm512_cvtne2ps_pbh(v, v);
}

// The group scales as the row helpers read them, copied out of the job into locals once
// per block: the vector stores into the buffer may alias anything, so fields read through
// the job were loaded again after each store.
struct AmxScales {
  const void* data;
  int64_t row_stride;
  DType dtype;
  bool grouped;  // job.scale_in_weight
  float at(int64_t n, int64_t g) const { return load_f32(data, n * row_stride + g, dtype); }
};

// int4: one row's k in [k0, k0 + kc) turned into bf16 through a 32-word table (vpermw):
// words 0-15 for a 64-k block's first 32 k, words 16-31 for its last 32 (two group scales
// when the groups are 32 wide). A 64-k block's even k go to one tile step and its odd k
// to the next; a trailing 32-k block (K % 64 == 32) takes its 16 even k, then its 16 odd
// k (xpack_task packs x in the same order). Per 64 weights: a zero-extension, two table
// lookups, a shift and two ORs, where converting through fp32 took fourteen vector
// operations, most of them on one port. Blocks of kAmxKc k in one group take amx_rows_one.
template <int NT>
PG_TARGET_AMX PG_ALWAYS_INLINE void amx_int4_row(const AmxScales& sc, const int64_t* g, int64_t n,
                                const uint8_t* q, int64_t k0, int64_t kc, uint16_t* dst) {
  const bool gscale = sc.grouped;
  const __m512i sel = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(0x10), 1);
  const __m512i c0f = _mm512_set1_epi16(0x0F);
  __m512i lut = int4_table(1.f, 1.f);
  int64_t glo = -1, ghi = -1;  // the groups the table is for (gscale)
  int64_t s = 0;
  for (; (s + 2) * 32 <= kc; s += 2) {
    if (gscale && (g[s] != glo || g[s + 1] != ghi)) {
      glo = g[s];
      ghi = g[s + 1];
      lut = int4_table(sc.at(n, glo), sc.at(n, ghi));
    }
    const __m512i wv = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (k0 + s * 32) / 2)));
    const __m512i lo =
        _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(wv, c0f, sel, 0xEA), lut);
    const __m512i hi =
        _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(wv, 4), sel), lut);
    _mm512_storeu_si512(dst + s * NT * 512, lo);
    _mm512_storeu_si512(dst + (s + 1) * NT * 512, hi);
  }
  if (s * 32 < kc) {
    if (gscale) {
      const float v = sc.at(n, g[s]);
      lut = int4_table(v, v);
    }
    const __m512i wv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k0 + s * 32) / 2))));
    const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(wv, c0f), lut);
    const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), lut);
    _mm512_storeu_si512(dst + s * NT * 512, _mm512_shuffle_i64x2(lo, hi, 0x44));
  }
}

// 32 int8 weights from p as bf16 through fp32, times sv when SCALED (exact when not).
template <bool SCALED>
PG_TARGET_AMX PG_ALWAYS_INLINE __m512i amx_int8_32(const uint8_t* p, __m512 sv) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  if constexpr (SCALED) {
    f0 = _mm512_mul_ps(f0, sv);
    f1 = _mm512_mul_ps(f1, sv);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
}

// int8: 32 k per step through fp32 (a group scale, if any, applied there).
template <int NT>
PG_TARGET_AMX PG_ALWAYS_INLINE void amx_int8_row(const AmxScales& sc, const int64_t* g, int64_t n,
                                const uint8_t* q, int64_t k0, int64_t kc, uint16_t* dst) {
  const bool gscale = sc.grouped;
  __m512 sv = _mm512_set1_ps(1.f);
  int64_t gcur = -1;
  for (int64_t s = 0; s < kc / 32; ++s) {
    if (gscale && g[s] != gcur) {
      gcur = g[s];
      sv = _mm512_set1_ps(sc.at(n, gcur));
    }
    _mm512_storeu_si512(dst + s * NT * 512, gscale ? amx_int8_32<true>(q + k0 + s * 32, sv)
                                                   : amx_int8_32<false>(q + k0 + s * 32, sv));
  }
}

// One block of k of a channel block, as amx_dequant_rows reads it.
struct AmxBlock {
  const uint8_t* data;  // the weight rows
  int64_t row_stride;
  AmxScales sc;
  int64_t g[kAmxKc / 32];  // the group of each 32-k step (group scales only)
  int64_t nb, nend;        // the channel block's first channel; channels from nend are zero
  int64_t k0, kc;
  int64_t pf_off, pf_len;  // the prefetch of each row: bytes from the row's start, length
  bool pf_last;            // the last block: rows from nend - 16 * NT prefetch nothing
  uint16_t* abuf;
};

// amx_dequant_rows for a whole block of kAmxKc k that lies in one group, or has
// per-channel scales (applied to the results; S = void): rows [r0, r1), those with data
// below rend, the rest zero; rows below rpf prefetch. Each row's scale is read as S, the
// scales' dtype, chosen once per call. The general loop (the row helpers above) spent more
// scalar instructions on a row than vector ones: the block's fields reloaded from the stack
// after each buffer store, the dtype switch, the nend and prefetch tests, the buffer
// address. Against it, on the 2-core Xeon VM (bench/CPU_NOTES.md 61): int4 0.93x the time
// at 3-8 rows, 0.91-0.98x at 16, 0.84-0.88x at 32-64; int8 1.00x (bound by memory).
// int4: both halves of the table are the same, and vpermw reads only an index's low five
// bits, so the nibbles need no mask and no half selector, 4 vector operations per 64
// weights instead of amx_int4_row's 6 (0.94-0.96x the time at 3-8 rows by itself).
template <int NT, bool INT4, typename S>
PG_TARGET_AMX PG_ALWAYS_INLINE void amx_rows_one(const AmxBlock& blk, int r0, int r1, int rend,
                                                 int rpf) {
  const int64_t row_stride = blk.row_stride;
  const uint8_t* q = blk.data + (blk.nb + r0) * row_stride + (INT4 ? blk.k0 / 2 : blk.k0);
  const uint8_t* pq = blk.data + (blk.nb + r0) * row_stride + blk.pf_off;
  const int64_t pf_len = blk.pf_len;
  [[maybe_unused]] const S* sp = nullptr;
  [[maybe_unused]] int64_t sstride = 0;
  if constexpr (!std::is_void_v<S>) {
    sp = static_cast<const S*>(blk.sc.data) + (blk.nb + r0) * blk.sc.row_stride + blk.g[0];
    sstride = blk.sc.row_stride;
  }
  uint16_t* dst = blk.abuf + r0 * 32;  // row r at (r / 16) * 512 + (r % 16) * 32
  const __m512i ones = int4_table(1.f);
  int r = r0;
  for (; r < rend; ++r, q += row_stride, pq += row_stride, dst += 32) {
    if (r < rpf)
      for (int64_t o = 0; o < pf_len; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pq + o), _MM_HINT_T2);
    float scale = 1.f;
    if constexpr (std::is_same_v<S, float>)
      scale = *sp;
    else if constexpr (std::is_same_v<S, uint16_t>)  // bf16
      scale = bf16_to_f32(*sp);
    else if constexpr (std::is_same_v<S, int16_t>)  // f16 (a distinct type to dispatch on)
      scale = f16_to_f32(uint16_t(*sp));
    if constexpr (!std::is_void_v<S>) sp += sstride;
    if constexpr (INT4) {
      const __m512i lut = std::is_void_v<S> ? ones : int4_table(scale);
      PG_UNROLL for (int s = 0; s < kAmxKc / 32; s += 2) {
        const __m512i wv = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + s * 16)));
        _mm512_storeu_si512(dst + s * NT * 512, _mm512_permutexvar_epi16(wv, lut));
        _mm512_storeu_si512(dst + (s + 1) * NT * 512,
                            _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), lut));
      }
    } else {  // as amx_int8_row
      const __m512 sv = _mm512_set1_ps(scale);
      PG_UNROLL for (int s = 0; s < kAmxKc / 32; ++s)
        _mm512_storeu_si512(dst + s * NT * 512, amx_int8_32<!std::is_void_v<S>>(q + s * 32, sv));
    }
  }
  for (; r < r1; ++r, dst += 32)  // channels at or past nend
    for (int64_t s = 0; s < kAmxKc / 32; ++s)
      _mm512_storeu_si512(dst + s * NT * 512, _mm512_setzero_si512());
}

// abuf[kstep][NT][16][32]: rows r in [r0, r1) of the block's 16 * NT, channels nb + r, k
// in [k0, k0 + kc); channels at or past nend are zero. amx_rows calls it for a quarter of
// the rows at a time, issuing the previous block's tile steps in between. Each row's next
// kAmxPfBlocks blocks (or, after the last, the next channel block's first) are prefetched
// into L2 on the way: with 32-64 rows read 64-128 bytes at a time, the hardware prefetchers
// alone left the reads latency-bound (bench/CPU_NOTES.md 28, 58). One instantiation per bit
// width; FULL for blocks of kAmxKc k (the row helpers' loops unroll), FULL and ONE for those
// in one group or with per-channel scales (amx_rows_one; bench/CPU_NOTES.md 60, 61).
template <int NT, bool INT4, bool FULL, bool ONE>
PG_TARGET_AMX PG_ALWAYS_INLINE void amx_dequant_rows(const AmxBlock& blk, int r0, int r1) {
  if constexpr (FULL && ONE) {
    const auto clamp = [&](int64_t v) { return int(std::max<int64_t>(r0, std::min<int64_t>(r1, v))); };
    const int rend = clamp(blk.nend - blk.nb);
    // the last block: rows from nend - 16 * NT prefetch nothing
    const int rpf = blk.pf_last ? clamp(blk.nend - 16 * NT - blk.nb) : rend;
    if (!blk.sc.grouped)
      amx_rows_one<NT, INT4, void>(blk, r0, r1, rend, rpf);
    else if (blk.sc.dtype == DType::f32)
      amx_rows_one<NT, INT4, float>(blk, r0, r1, rend, rpf);
    else if (blk.sc.dtype == DType::bf16)
      amx_rows_one<NT, INT4, uint16_t>(blk, r0, r1, rend, rpf);
    else
      amx_rows_one<NT, INT4, int16_t>(blk, r0, r1, rend, rpf);
    return;
  }
  const uint8_t* const data = blk.data;
  const int64_t row_stride = blk.row_stride;
  const AmxScales sc = blk.sc;
  const int64_t nb = blk.nb, nend = blk.nend, k0 = blk.k0;
  const int64_t kc = FULL ? kAmxKc : blk.kc;
  const int64_t pf_off = blk.pf_off, pf_len = blk.pf_len;
  const bool pf_last = blk.pf_last;
  uint16_t* const abuf = blk.abuf;
  int64_t g[kAmxKc / 32];
  for (int64_t s = 0; s < kAmxKc / 32; ++s) g[s] = blk.g[s];
  for (int r = r0; r < r1; ++r) {
    const int64_t n = nb + r;
    uint16_t* dst = abuf + (r >> 4) * 512 + (r & 15) * 32;
    if (n >= nend) {
      for (int64_t s = 0; s < kc / 32; ++s)
        _mm512_storeu_si512(dst + s * NT * 512, _mm512_setzero_si512());
      continue;
    }
    const uint8_t* q = data + n * row_stride;
    if (!pf_last || n + 16 * NT < nend)
      for (int64_t o = 0; o < pf_len; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + pf_off + o), _MM_HINT_T2);
    if (INT4)
      amx_int4_row<NT>(sc, g, n, q, k0, kc, dst);
    else
      amx_int8_row<NT>(sc, g, n, q, k0, kc, dst);
  }
}

// Channels [n0, n1) of the thread, all rows of x: writes res[m * ldr + (n - n0)]. Tiles:
// MT * NT accumulators of 16 channels x 16 rows of x (MT * NT = 4), A (weight) tiles 4 and
// 5, B (x) tiles 6 and 7. Up to 16 rows (MT = 1) a block has 64 channels (NT = 4), so each
// B tile serves four products; with 32 rows, 32 channels by 2 x 2. All rows of x (at most
// kAmxMaxM = 32, so mpad = 16 MT) fit the accumulators: they stay in the tiles for the
// whole of K.
template <int MT, int NT, bool INT4>
PG_TARGET_AMX void amx_rows(const AmxJob& job, int64_t n0, int64_t n1, float* res,
                            int64_t ldr) {
  static_assert(MT * NT == 4, "four accumulator tiles");
  const QuantizedWeight& w = job.args->w;
  const AmxScales sc{w.scales, w.scales_row_stride, w.scales_dtype, job.scale_in_weight};
  const int half = INT4;  // bytes = k >> half
  AmxBlock blk{};
  blk.data = static_cast<const uint8_t*>(w.data);
  blk.row_stride = w.row_stride;
  blk.sc = sc;
  blk.nend = n1;
  const int64_t K = job.k;
  const int64_t bstride = job.mpad * 4;  // bytes per k-pair row of xp
  // The blocks are pipelined: block i is dequantised into one of two buffers while the
  // tile steps of block i - 1 are issued from the other, one step after every few rows, so
  // the tile unit works while the vector units dequantise. Done in turn, the two added up
  // (timing-only builds that skipped either took 0.24 and 0.74 of the call at int8
  // M = 16, 4096^2). With blocks of 128 k and two prefetched ahead, on the 2-core Xeon VM
  // (one process, 5-6 rounds, weights rotated over 960 MiB), against blocks of 256 k done in
  // turn with one prefetched: 0.55-0.77x the time at 7-16 rows, 0.67-0.81x at 17-32, on 16
  // shapes of int8 and int4 (bench/CPU_NOTES.md 58).
  constexpr int64_t kBuf = kAmxKc / 32 * NT * 512;  // bf16 per buffer
  uint16_t* abuf = reinterpret_cast<uint16_t*>(scratch(6, size_t(kBuf)));  // 2 x kBuf bf16
  alignas(64) float ctile[4][256];
  const char* xp = reinterpret_cast<const char*>(job.xp);
  // One 32-k step of a dequantised block: a (its A rows), b (x's pair rows of that step).
  const auto step = [&](const uint16_t* a, const char* b) {
    _tile_loadd(6, b, bstride);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (NT == 4) {
      _tile_loadd(4, a + 1024, 64);
      _tile_loadd(5, a + 1536, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 5, 6);
    } else {
      _tile_loadd(7, b + 64, bstride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  };
  for (int64_t nb = n0; nb < n1; nb += 16 * NT) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* pa = nullptr;  // the block whose steps are pending, and its x
    const char* pb = nullptr;
    int64_t psteps = 0;
    for (int64_t k0 = 0, i = 0; k0 < K; k0 += kAmxKc, ++i) {
      const int64_t kc = std::min(kAmxKc, K - k0);
      uint16_t* cur = abuf + (i & 1) * kBuf;
      blk.nb = nb;
      blk.k0 = k0;
      blk.kc = kc;
      blk.abuf = cur;
      if (sc.grouped)
        for (int64_t s = 0; s < kc / 32; ++s) blk.g[s] = (k0 + s * 32) / w.group_size;
      // what each row prefetches: its next blocks, else the next channel block's first
      const bool more_k = k0 + kc < K;
      blk.pf_off = more_k ? (k0 + kc) >> half : 16 * NT * w.row_stride;
      blk.pf_len = std::min(kAmxPfBlocks * kAmxKc, more_k ? K - k0 - kc : K) >> half;
      blk.pf_last = !more_k;
      const bool full = kc == kAmxKc;
      const bool one = !sc.grouped || blk.g[0] == blk.g[kc / 32 - 1];
      // the rows in psteps parts (at least one), each after a pending step
      const int64_t parts = std::max<int64_t>(psteps, 1);
      for (int64_t c = 0; c < parts; ++c) {
        __asm__ volatile("" ::: "memory");
        if (c < psteps) step(pa + c * NT * 512, pb + c * 16 * bstride);
        __asm__ volatile("" ::: "memory");
        const int r0 = int(c * 16 * NT / parts), r1 = int((c + 1) * 16 * NT / parts);
        if (full && one)
          amx_dequant_rows<NT, INT4, true, true>(blk, r0, r1);
        else if (full)
          amx_dequant_rows<NT, INT4, true, false>(blk, r0, r1);
        else
          amx_dequant_rows<NT, INT4, false, false>(blk, r0, r1);
      }
      // GCC's _tile_loadd has no memory operand: a block's stores stay before its tile
      // loads (next iteration), and those loads before the stores that reuse the buffer.
      __asm__ volatile("" ::: "memory");
      pa = cur;
      pb = xp + (k0 / 2) * bstride;
      psteps = kc / 32;
    }
    for (int64_t d = 0; d < psteps; ++d) step(pa + d * NT * 512, pb + d * 16 * bstride);
    __asm__ volatile("" ::: "memory");
    // Results out: each tile (16 channels x 16 rows of x) transposed in registers, scaled
    // per channel, and stored as 16-channel pieces of rows of res. Written one float at a
    // time, this took a quarter of the call at K = 2048 (16 rows 4 KB apart share an L1
    // set; bench/CPU_NOTES.md 60).
    _tile_stored(0, ctile[0], 64); _tile_stored(1, ctile[1], 64);
    _tile_stored(2, ctile[2], 64); _tile_stored(3, ctile[3], 64);
    for (int t = 0; t < 4; ++t) {
      const int64_t nbase = nb + (t % NT) * 16;
      const int64_t mbase = (t / NT) * 16;
      if (nbase >= n1 || mbase >= job.m) continue;
      const int nc = int(std::min<int64_t>(16, n1 - nbase));
      const int mc = int(std::min<int64_t>(16, job.m - mbase));
      alignas(64) float chs[16];  // per-channel scales (1 where folded into the weights)
      for (int i = 0; i < 16; ++i)
        chs[i] = sc.grouped || i >= nc ? 1.f : sc.at(nbase + i, 0);
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(ctile[t] + i * 16);
      transpose16_avx512(v);  // v[j]: row j of x, 16 channels
      const __m512 scv = _mm512_load_ps(chs);
      const __mmask16 keep = __mmask16((1u << nc) - 1);
      float* out = res + mbase * ldr + (nbase - n0);
      for (int j = 0; j < mc; ++j)
        _mm512_mask_storeu_ps(out + j * ldr, keep, _mm512_mul_ps(v[j], scv));
    }
  }
}

void amx_task(void* ctx, int64_t b0, int64_t b1) {  // channel blocks [b0, b1)
  const AmxJob& job = *static_cast<const AmxJob*>(ctx);
  guarded(job.failed, [&] {
    const int64_t n0 = b0 * job.nbk, n1 = std::min(b1 * job.nbk, job.n);
    const int64_t cols = n1 - n0;
    const int64_t ldr = (cols + 15) / 16 * 16 + 16;
    float* res = scratch(0, size_t(job.m * ldr));
    {
      const AmxScope amx(true);
      const bool int4 = job.args->w.bits == 4;
      if (job.mpad > 16)
        int4 ? amx_rows<2, 2, true>(job, n0, n1, res, ldr)
             : amx_rows<2, 2, false>(job, n0, n1, res, ldr);
      else
        int4 ? amx_rows<1, 4, true>(job, n0, n1, res, ldr)
             : amx_rows<1, 4, false>(job, n0, n1, res, ldr);
    }
    job.ep.store(res, ldr, 0, job.m, n0, cols);
  });
}

// The k that position p of the int4 A rows holds (amx_int4_row): in each whole 64-k block
// the even k, then the odd k; in a trailing 32-k block likewise.
inline int64_t int4_k_at(int64_t p, int64_t K) {
  const int64_t width = p / 64 * 64 + 64 <= K ? 64 : 32;
  const int64_t base = p / width * width, o = p - base;
  return base + (o < width / 2 ? 2 * o : 2 * (o - width / 2) + 1);
}

struct XPackJob {
  const MixedLinearArgs* args;
  uint16_t* xp;
  int64_t mpad, m;
  bool int4;
  bool vec;  // contiguous rows of x: xpack_vec
};

// k-pairs [p0, p1), one value at a time (x with any strides).
void xpack_pairs(const XPackJob& j, int64_t p0, int64_t p1) {
  const ConstMatrix& x = j.args->x;
  const uint16_t* xs = static_cast<const uint16_t*>(x.data);
  for (int64_t p = p0; p < p1; ++p) {
    uint16_t* row = j.xp + p * j.mpad * 2;
    int64_t ka = 2 * p, kb = 2 * p + 1;
    if (j.int4) {
      ka = int4_k_at(ka, j.args->w.k);
      kb = int4_k_at(kb, j.args->w.k);
    }
    for (int64_t m = 0; m < j.m; ++m) {
      row[2 * m] = xs[m * x.row_stride + ka * x.col_stride];
      row[2 * m + 1] = xs[m * x.row_stride + kb * x.col_stride];
    }
    for (int64_t m = j.m; m < j.mpad; ++m) row[2 * m] = row[2 * m + 1] = 0;
  }
}

// 64-k blocks [b0, b1) of contiguous rows of x. Each row's 64 k are loaded as two vectors
// of 16 pairs (int4: first put in int4_k_at's order, its even k then its odd k, by two
// vpermt2w), then 16 rows x 16 pairs are transposed in registers, a pair being a 32-bit
// lane. A trailing 32 k (K % 64 == 32) go as one vector. Rows past m are zero. One value
// at a time (xpack_pairs) this took 5 % of the call at 16 rows, 4096^2, on one thread
// while the other waited (bench/CPU_NOTES.md 60).
PG_TARGET_AVX512 void xpack_vec(const XPackJob& j, int64_t b0, int64_t b1) {
  const ConstMatrix& x = j.args->x;
  const uint16_t* xs = static_cast<const uint16_t*>(x.data);
  const int64_t K = j.args->w.k;
  alignas(64) uint16_t ie[32], io[32], ih[32];
  for (int i = 0; i < 32; ++i) {
    ie[i] = uint16_t(2 * i);
    io[i] = uint16_t(2 * i + 1);
    ih[i] = uint16_t(i < 16 ? 2 * i : 2 * (i - 16) + 1);
  }
  const __m512i even = _mm512_load_si512(ie), odd = _mm512_load_si512(io);
  const __m512i half = _mm512_load_si512(ih);
  const int64_t ld = j.mpad * 2;  // uint16 per pair row of xp
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = b * 64;
    const bool full = k0 + 64 <= K;
    for (int64_t m0 = 0; m0 < j.mpad; m0 += 16) {
      __m512 lo[16], hi[16];
      for (int i = 0; i < 16; ++i) {
        lo[i] = hi[i] = _mm512_setzero_ps();
        if (m0 + i >= j.m) continue;
        const uint16_t* row = xs + (m0 + i) * x.row_stride + k0;
        const __m512i a = _mm512_loadu_si512(row);
        if (full) {
          const __m512i c = _mm512_loadu_si512(row + 32);
          lo[i] = _mm512_castsi512_ps(j.int4 ? _mm512_permutex2var_epi16(a, even, c) : a);
          hi[i] = _mm512_castsi512_ps(j.int4 ? _mm512_permutex2var_epi16(a, odd, c) : c);
        } else {
          lo[i] = _mm512_castsi512_ps(j.int4 ? _mm512_permutexvar_epi16(half, a) : a);
        }
      }
      uint16_t* dst = j.xp + (k0 / 2) * ld + m0 * 2;
      transpose16_avx512(lo);
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(dst + p * ld, lo[p]);
      if (!full) continue;
      transpose16_avx512(hi);
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(dst + (16 + p) * ld, hi[p]);
    }
  }
}

void xpack_task(void* ctx, int64_t u0, int64_t u1) {  // 64-k blocks (vec), else k-pairs
  const XPackJob& j = *static_cast<const XPackJob*>(ctx);
  if (j.vec)
    xpack_vec(j, u0, u1);
  else
    xpack_pairs(j, u0, u1);
}

bool amx_usable(const MixedLinearArgs& args) {
  const QuantizedWeight& w = args.w;
  if (args.x.dtype != DType::bf16 || w.k % 32 != 0 || w.k == 0) return false;
  if (w.group_size != 0 && w.group_size % 32 != 0) return false;
  return amx_supported();
}

bool amx_linear(const MixedLinearArgs& args, const Executor& exec) {
  const int64_t M = args.x.rows, N = args.w.n, K = args.w.k;
  AmxJob job;
  job.args = &args;
  job.m = M;
  job.n = N;
  job.k = K;
  job.mpad = M <= 16 ? 16 : (M + 31) / 32 * 32;
  job.nbk = job.mpad > 16 ? 32 : 64;
  job.scale_in_weight = args.w.group_size != 0 && args.w.group_size < K;
  job.ep.act = args.activation;
  job.ep.c = args.y;
  if (args.bias != nullptr) {
    float* b = scratch(3, size_t(N));
    convert_to_f32(args.bias, args.bias_stride, args.y.dtype, N, b);
    job.ep.bias = b;
  }
  uint16_t* xp = reinterpret_cast<uint16_t*>(scratch(2, size_t(K / 2 * job.mpad)));
  XPackJob pj{&args, xp, job.mpad, M, args.w.bits == 4, args.x.col_stride == 1};
  const int64_t units = pj.vec ? (K + 63) / 64 : K / 2;
  const int64_t threads = executor_threads(exec);
  if (threads > 1 && M * K >= (1 << 18))
    run_tasks(exec, 0, units, (units + threads - 1) / threads, xpack_task, &pj);
  else
    xpack_task(&pj, 0, units);
  job.xp = xp;
  // Threads take whole channel blocks: a range cut inside a block would leave the block
  // partly zero-filled on both sides.
  const int64_t blocks = (N + job.nbk - 1) / job.nbk;
  if (threads > 1 && N * K * (M + 1) >= (1 << 20))
    run_tasks(exec, 0, blocks, (blocks + threads - 1) / threads, amx_task, &job);
  else
    amx_task(&job, 0, blocks);
  return !job.failed.load();
}

// amx_linear over chunks of at most kAmxMaxM rows of x, as even as possible (33 rows go as
// 17 + 16): each chunk dequantises the weight again.
bool amx_linear_chunks(const MixedLinearArgs& args, const Executor& exec) {
  const int64_t M = args.x.rows;
  const int64_t chunks = (M + kAmxMaxM - 1) / kAmxMaxM;
  const int64_t xs = args.x.row_stride * int64_t(dtype_size(args.x.dtype));
  const int64_t ys = args.y.row_stride * int64_t(dtype_size(args.y.dtype));
  for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
    const int64_t mc = (M - m0 + (chunks - c) - 1) / (chunks - c);
    MixedLinearArgs sub = args;
    sub.x.data = static_cast<const char*>(args.x.data) + m0 * xs;
    sub.x.rows = mc;
    sub.y.data = static_cast<char*>(args.y.data) + m0 * ys;
    sub.y.rows = mc;
    if (!amx_linear(sub, exec)) return false;
    m0 += mc;
  }
  return true;
}
#endif

// Rows of x up to which mixed_linear takes the small-M path; above, the dense path (AMX
// CPUs run amx_linear for amx_min_m..kAmxChunkMaxM rows before either). On the Zen 5 VM of
// bench/CPU_NOTES.md 38 (6 alternating rounds, median of the per-round ratios), the tile
// path against the dense one: group scales (g128, int4 and int8, 8192^2 and 4096 x 12288)
// 0.73-0.85x the time at M = 24 and 0.87-0.96x at 32 (section 19 had found the opposite,
// before section 34 made the tile path 1.06-1.16x faster); per channel 0.78-0.86x at
// M = 33-64 for int8 at 8192^2 and 4096 x 12288, 0.82x at 48 and 0.88-1.01x at 64 for int4,
// and about even for int8 4096^2 at 64 (1.07x, 4 rounds of 0.93-1.66).
int64_t small_m_max_rows(const MixedLinearArgs& a) {
#if PG_X86
  if (dq_applies(a)) return dq_max_rows();
#endif
  if (!has_bf16_x_pairs(a)) return kSmallM;
  if (!small_m_bf16(a)) return kSmallMPairs;
  if (a.w.group_size != 0 && a.w.group_size < a.w.k) return kSmallM;
#if PG_X86
  if (amx_usable(a)) return kSmallM;  // the dense path's GEMM on the tile unit (CPU_NOTES 21)
#endif
  return kSmallMTile;
}

}  // namespace

Status mixed_linear(const MixedLinearArgs& args, const Executor& exec) {
  const ScratchUse use;
  Status st = validate_mixed_linear(args);
  if (!st.ok()) return st;
  const int64_t M = args.x.rows, N = args.w.n, K = args.w.k;
  if (M == 0 || N == 0) return st;
  bool ok = false;
  try {
    const bool pairs = has_bf16_x_pairs(args);
#if PG_X86
    if (K > 0 && M >= amx_min_m(args.w) && M <= kAmxChunkMaxM && amx_usable(args)) {
      ok = amx_linear_chunks(args, exec);
    } else
#endif
    if (M <= small_m_max_rows(args) || K == 0) {
      ok = small_m(args, exec);
    } else {
      // Per channel: the packers write q, and the epilogue multiplies by the scales.
      const bool per_channel = args.w.group_size == 0 || args.w.group_size >= K;
      const QuantB b{&args.w, per_channel};
      std::vector<float> col_scale(per_channel ? size_t(N) : 0);
      for (int64_t n = 0; n < int64_t(col_scale.size()); ++n) col_scale[n] = scale_at(args.w, n, 0);
      DenseProblem p;
      p.m = M;
      p.n = N;
      p.k = K;
      p.a = args.x;
      p.pack_b = pack_b_quant;
      if (pairs) p.pack_b_pairs = pack_b_quant_pairs;
      p.b_ctx = &b;
      if (per_channel) p.col_scale = col_scale.data();
      p.bias = args.bias;
      p.bias_stride = args.bias_stride;
      p.c = args.y;
      p.act = args.activation;
      ok = dense_gemm(p, exec);
    }
  } catch (...) {  // bad_alloc on the calling thread
  }
  return ok ? st : Status{2, "mixed_linear: out of memory (scratch buffers)"};
}

}  // namespace cpu
}  // namespace portable_gemm
