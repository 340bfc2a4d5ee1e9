// What one row-block of amx_linear's int4 / int8 dequantisation costs on one core, with the
// weights in L1 or L2 (no memory reads): the loop of amx_int4_row / amx_int8_row
// (src/kernels/cpu/mixed_linear.cpp), copied, over 64 weight rows x K, into the same
// [kstep][4][16][32] bf16 buffer, with variants that drop one part each (timing only).
//
//   g++ -O3 -std=c++17 -march=sapphirerapids bench/probes/cpu_amx_dequant_probe.cpp -o probe
//   ./probe [K [CB]]   (K = 2048: 64 KB of int4 rows, in L2; CB channel blocks of 64 rows,
//                      taken in turn as amx_rows does, 1 by default)
//   PGX_AMX=1 ./probe  (the same with the tiles configured and one zeroed first, and two
//                      more rows: amx_rows' tile steps alone, and interleaved as it does)
//   PGX_XBIG=1         x's tiles over all of K (K * 64 bytes), as the library packs them,
//                      instead of one block's 4 KiB that stay in L1
//   PGX_XPF=1          and the next block's x tile prefetched into L1, a line a row
//
// The weights' footprint and row stride decide much of the rate: 60's 42 weights/ns came
// from K = 2048 with one block (64 KiB); over 1 MiB, K = 1024 or 11008 read ~31-33, K = 4096
// ~49 (bench/CPU_NOTES.md 65).
//
// Prints ns per row-block of 128 k and weights per ns, fastest of 15 repetitions.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kRows = 64, kKc = 128, kNT = 4;
uint16_t* g_abuf = nullptr;  // the two dequantisation buffers

inline __m512i int4_table(float s_lo, float s_hi) {
  const __m512 vals = _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(vals, _mm512_set1_ps(s_hi)),
                                      _mm512_mul_ps(vals, _mm512_set1_ps(s_lo)));
}

enum Var { kShipped, kNoTable, kNoStore, kNoPrefetch, kSameRow, kNoPerm, kSteps, kStepsOnly,
           kStepsLoads, kStepsDp, kQuad, kQuadSteps, kOld, kOldSteps, kQuad2, kQuad2Steps,
           kNoPermSteps, kNoPermStepsScaled };

// One 32-k tile step of amx_rows at 16 rows of x (NT = 4): x's tile, then four weight tiles
// of the other buffer into four accumulators.
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_step(const uint16_t* a,
                                                                  const uint16_t* x) {
  _tile_loadd(6, x, 64);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 512, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_loadd(4, a + 1024, 64);
  _tile_loadd(5, a + 1536, 64);
  _tile_dpbf16ps(2, 4, 6);
  _tile_dpbf16ps(3, 5, 6);
}
// Its tile loads alone, and its multiplies alone (on whatever the tiles hold).
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_step_loads(const uint16_t* a,
                                                                        const uint16_t* x) {
  _tile_loadd(6, x, 64);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 512, 64);
  _tile_loadd(7, a + 1024, 64);
  _tile_loadd(4, a + 1536, 64);
}
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_step_dp() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_dpbf16ps(2, 4, 6);
  _tile_dpbf16ps(3, 5, 6);
}
// x's tiles (zero: only the time counts): one block's 4 KiB, or all of K's (g_xk = K)
uint16_t* g_x = nullptr;
int64_t g_xk = 0;
int g_xpf = 0;
alignas(64) float g_ctile[4][256];  // a block's four accumulator tiles, stored
alignas(64) float g_acc[64][16];    // fp32 sums of 64 channels x 16 rows of x
alignas(64) float g_xsum[16];       // the group's sums of x (the offset's correction)

// What group scales would cost the offset form (kNoPermStepsScaled): per block, its four
// tiles stored and each channel's 16 sums scaled into fp32 accumulators with the offset
// taken off, acc += s * (tile - 136 * xsum); the tiles zeroed for the next group.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void scale_block(const float* sc) {
  _tile_stored(0, g_ctile[0], 64);
  _tile_stored(1, g_ctile[1], 64);
  _tile_stored(2, g_ctile[2], 64);
  _tile_stored(3, g_ctile[3], 64);
  const __m512 xs = _mm512_mul_ps(_mm512_load_ps(g_xsum), _mm512_set1_ps(-136.f));
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 16; ++c) {
      const __m512 s = _mm512_set1_ps(sc[t * 16 + c]);
      float* a = g_acc[t * 16 + c];
      _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_add_ps(_mm512_load_ps(g_ctile[t] + c * 16), xs), s,
                                         _mm512_load_ps(a)));
    }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <int V>
__attribute__((noinline, target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
__m512i int4_block(const uint8_t* w, int64_t stride, const float* sc, int64_t k0, int64_t K,
                   uint16_t* abuf) {
  // kSteps / kStepsOnly: the other buffer's four tile steps, one before each 16 rows, as
  // amx_rows issues them (kStepsOnly: and no dequantisation).
  const uint16_t* other = abuf == g_abuf ? g_abuf + 8192 : g_abuf;
  // x's tiles of this block and of the next (the same 4 KiB unless PGX_XBIG)
  const auto x_at = [](int64_t k) { return g_x + (g_xk ? (k % g_xk) / 32 * 512 : 0); };
  const uint16_t* xb = x_at(k0);
  const uint16_t* xn = x_at(k0 + kKc);
  if (V == kStepsOnly) {
    for (int c = 0; c < 4; ++c) tile_step(other + c * 2048, xb + c * 512);
    return _mm512_setzero_si512();
  }
  const __m512i sel = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(0x10), 1);
  const __m512i c0f = _mm512_set1_epi16(0x0F);
  __m512i sink = _mm512_setzero_si512();
  const bool more_k = k0 + kKc < K;
  for (int r = 0; r < kRows; ++r) {
    if ((V == kSteps || V == kOldSteps || V == kNoPermSteps || V == kNoPermStepsScaled) && (r & 15) == 0) tile_step(other + (r >> 4) * 2048, xb + (r >> 4) * 512);
    if (V == kStepsLoads && (r & 15) == 0)
      tile_step_loads(other + (r >> 4) * 2048, xb + (r >> 4) * 512);
    if (V == kStepsDp && (r & 15) == 0) tile_step_dp();
    const uint8_t* q = w + (V == kSameRow ? 0 : r) * stride;
    uint16_t* dst = abuf + (r >> 4) * 512 + (r & 15) * 32;
    if (g_xpf) _mm_prefetch(reinterpret_cast<const char*>(xn + r * 32), _MM_HINT_T0);
    if (V != kNoPrefetch && more_k)
      for (int64_t o = 0; o < 128; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + (k0 + kKc) / 2 + o), _MM_HINT_T2);
    __m512i lut = int4_table(1.f, 1.f);
    if (V != kNoTable) lut = int4_table(sc[r * (K / 128) + k0 / 128], sc[r * (K / 128) + k0 / 128]);
    if (V == kQuad2 || V == kQuad2Steps) {
      // Four nibbles a word with no masking: the table's halves are equal (one scale), and
      // vpermw reads only an index's low five bits.
      if (V == kQuad2Steps && (r & 15) == 0)
        tile_step(other + (r >> 4) * 2048, xb + (r >> 4) * 512);
      const __m512i wv = _mm512_loadu_si512(q + k0 / 2);
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(wv, lut));
      _mm512_storeu_si512(dst + kNT * 512, _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), lut));
      _mm512_storeu_si512(dst + 2 * kNT * 512, _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 8), lut));
      _mm512_storeu_si512(dst + 3 * kNT * 512, _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 12), lut));
      continue;
    }
    if (V == kQuad || V == kQuadSteps) {
      // The block's 64 bytes as 32 words of four nibbles (k = 4j .. 4j + 3): vpermw reads the
      // low 5 bits of each index word, so each nibble is moved there, no zero-extension.
      if (V == kQuadSteps && (r & 15) == 0)
        tile_step(other + (r >> 4) * 2048, xb + (r >> 4) * 512);
      const __m512i wv = _mm512_loadu_si512(q + k0 / 2);
      const __m512i n0 = _mm512_ternarylogic_epi32(wv, c0f, sel, 0xEA);
      const __m512i n1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wv, 4), c0f, sel, 0xEA);
      const __m512i n2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wv, 8), c0f, sel, 0xEA);
      const __m512i n3 = _mm512_or_si512(_mm512_srli_epi16(wv, 12), sel);
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(n0, lut));
      _mm512_storeu_si512(dst + kNT * 512, _mm512_permutexvar_epi16(n1, lut));
      _mm512_storeu_si512(dst + 2 * kNT * 512, _mm512_permutexvar_epi16(n2, lut));
      _mm512_storeu_si512(dst + 3 * kNT * 512, _mm512_permutexvar_epi16(n3, lut));
      continue;
    }
    for (int s = 0; s < kKc / 32; s += 2) {
      const __m512i wv = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (k0 + s * 32) / 2)));
      __m512i lo, hi;
      if (V == kNoPerm || V == kNoPermSteps || V == kNoPermStepsScaled) {  // the cost of the offset form (bf16 0x4300 | u)
        lo = _mm512_ternarylogic_epi32(wv, c0f, sel, 0xEA);
        hi = _mm512_or_si512(_mm512_srli_epi16(wv, 4), sel);
      } else if (V != kOld && V != kOldSteps) {  // the library's ONE blocks (one scale a row)
        lo = _mm512_permutexvar_epi16(wv, lut);
        hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), lut);
      } else {
        lo = _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(wv, c0f, sel, 0xEA), lut);
        hi = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(wv, 4), sel), lut);
      }
      if (V == kNoStore) {
        sink = _mm512_xor_si512(sink, _mm512_xor_si512(lo, hi));
      } else {
        _mm512_storeu_si512(dst + s * kNT * 512, lo);
        _mm512_storeu_si512(dst + (s + 1) * kNT * 512, hi);
      }
    }
  }
  if (V == kNoPermStepsScaled) scale_block(sc + k0 / 128);
  return sink;
}

template <int V>
__attribute__((noinline)) __m512i int8_block(const uint8_t* w, int64_t stride, const float*,
                                            int64_t k0, int64_t K, uint16_t* abuf) {
  __m512i sink = _mm512_setzero_si512();
  const bool more_k = k0 + kKc < K;
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* q = w + (V == kSameRow ? 0 : r) * stride;
    uint16_t* dst = abuf + (r >> 4) * 512 + (r & 15) * 32;
    if (V != kNoPrefetch && more_k)
      for (int64_t o = 0; o < 256; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + k0 + kKc + o), _MM_HINT_T2);
    for (int s = 0; s < kKc / 32; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 + s * 32));
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
      const __m512i o = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
      if (V == kNoStore)
        sink = _mm512_xor_si512(sink, o);
      else
        _mm512_storeu_si512(dst + s * kNT * 512, o);
    }
  }
  return sink;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles configured and one zeroed, as while amx_linear runs (PGX_AMX=1 in the environment).
__attribute__((target("amx-tile"))) void tiles_on() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::printf("no AMX permission\n");
    std::exit(1);
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  _tile_zero(0);
}
__attribute__((target("amx-tile"))) void tiles_off() { _tile_release(); }

using BlockFn = __m512i (*)(const uint8_t*, int64_t, const float*, int64_t, int64_t, uint16_t*);

void run(const char* name, BlockFn fn, const uint8_t* w, int64_t stride, const float* sc,
         int64_t K, uint16_t* abuf, int64_t cblocks) {
  double best = 1e30;
  __m512i sink = _mm512_setzero_si512();
  for (int rep = 0; rep < 15; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const int its = int(std::max<int64_t>(1, 20 / cblocks));
    for (int it = 0; it < its; ++it)
      for (int64_t cb = 0; cb < cblocks; ++cb)
        for (int64_t k0 = 0, i = 0; k0 < K; k0 += kKc, ++i)
          sink = _mm512_xor_si512(sink, fn(w + cb * kRows * stride, stride,
                                           sc + cb * kRows * (K / 128), k0, K,
                                           abuf + (i & 1) * 8192));
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ns / (double(its) * cblocks * (K / kKc) * kRows));
  }
  alignas(64) int32_t out[16];
  _mm512_store_si512(out, sink);
  std::printf("%-28s %6.2f ns per row-block, %5.2f weights/ns%s\n", name, best, kKc / best,
              out[0] == 12345 ? " " : "");
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t cb = argc > 2 ? std::atoll(argv[2]) : 1;  // channel blocks of 64 rows
  std::vector<uint8_t> w4(cb * kRows * K / 2), w8(cb * kRows * K);
  for (size_t i = 0; i < w4.size(); ++i) w4[i] = uint8_t(i * 2654435761u >> 13);
  for (size_t i = 0; i < w8.size(); ++i) w8[i] = uint8_t(i * 2246822519u >> 11);
  std::vector<float> sc(cb * kRows * (K / 128), 0.01f);
  uint16_t* abuf = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * 8192 * 2));
  std::memset(abuf, 0, 2 * 8192 * 2);
  g_abuf = abuf;
  g_xk = std::getenv("PGX_XBIG") ? K : 0;
  g_xpf = std::getenv("PGX_XPF") != nullptr;
  const size_t xbytes = size_t(std::max<int64_t>(K, kKc)) * 64;  // [K / 32] tiles of 1 KiB
  g_x = static_cast<uint16_t*>(std::aligned_alloc(64, xbytes));
  std::memset(g_x, 0, xbytes);
  const bool amx = std::getenv("PGX_AMX") != nullptr;
  if (amx) tiles_on();
  std::printf("%sK = %lld, %lld rows: int4 %lld KB, int8 %lld KB\n", amx ? "tiles configured; " : "", (long long)K, (long long)(cb * kRows),
              (long long)(w4.size() >> 10), (long long)(w8.size() >> 10));
  run("int4 shipped", int4_block<kShipped>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 before 61 (masked)", int4_block<kOld>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 four nibbles, unmasked", int4_block<kQuad2>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 four nibbles a word", int4_block<kQuad>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 no table rebuild", int4_block<kNoTable>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 no stores", int4_block<kNoStore>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 no prefetch", int4_block<kNoPrefetch>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 one row (L1)", int4_block<kSameRow>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  run("int4 no vpermw", int4_block<kNoPerm>, w4.data(), K / 2, sc.data(), K, abuf, cb);
  if (amx) {
    run("int4 tile steps only", int4_block<kStepsOnly>, w4.data(), K / 2, sc.data(), K, abuf, cb);
    run("int4 with tile steps", int4_block<kSteps>, w4.data(), K / 2, sc.data(), K, abuf, cb);
    run("int4 before 61, with tile steps", int4_block<kOldSteps>, w4.data(), K / 2, sc.data(), K,
        abuf, cb);
    run("int4 four nibbles, unmasked, with steps", int4_block<kQuad2Steps>, w4.data(), K / 2,
        sc.data(), K, abuf, cb);
    run("int4 four nibbles a word, with tile steps", int4_block<kQuadSteps>, w4.data(), K / 2,
        sc.data(), K, abuf, cb);
    run("int4 no vpermw, with tile steps", int4_block<kNoPermSteps>, w4.data(), K / 2, sc.data(), K,
        abuf, cb);
    run("int4 no vpermw, steps, group scales", int4_block<kNoPermStepsScaled>, w4.data(), K / 2,
        sc.data(), K, abuf, cb);
    run("int4 with their loads only", int4_block<kStepsLoads>, w4.data(), K / 2, sc.data(), K,
        abuf, cb);
    run("int4 with their tdpbf16ps only", int4_block<kStepsDp>, w4.data(), K / 2, sc.data(), K,
        abuf, cb);
  }
  run("int8 shipped", int8_block<kShipped>, w8.data(), K, sc.data(), K, abuf, cb);
  run("int8 no stores", int8_block<kNoStore>, w8.data(), K, sc.data(), K, abuf, cb);
  run("int8 no prefetch", int8_block<kNoPrefetch>, w8.data(), K, sc.data(), K, abuf, cb);
  run("int8 one row (L1)", int8_block<kSameRow>, w8.data(), K, sc.data(), K, abuf, cb);
  if (amx) tiles_off();
  std::free(abuf);
  std::free(g_x);
}
