// The int8 M = 1 AVX2 inner loop (small_block_avx2<1, 4, int8>'s form) stand-alone, in
// variants, on ROWS x 4096 int8 weights (default 64 rows: 256 KB, cache-resident), one
// thread. bench/CPU_NOTES.md 52: which pipe holds it on a core that splits 256-bit ops.
//
//   MODE 0  the library's: per 8 weights a widening load (vpmovsxbd m64), a convert
//           (vcvtdq2ps) and an FMA; lo / hi halves in two chains a row, 4 rows
//   MODE 1  the same without the convert (the integers read as floats: timing only)
//   MODE 2  the convert replaced by an integer add and a float subtract:
//           bits(0x4B400000 + q) = 1.5 * 2^23 + q, exact, minus 1.5 * 2^23
//   MODE 3  the widening loads alone, OR'd into the sums (no convert, no FMA): the load side
//   MODE 4  through fp16 (F16C): u = q ^ 0x80 as the low byte of the half 0x6400 | u =
//           1024 + u, exact; vcvtph2ps to fp32; the sums are of (1152 + q) x, and the
//           1152 x part is taken off at the end (as the int4 block's seed does per segment)
//
// Also times a chain of dependent integer adds (one a cycle): the core's clock.
//
//   g++ -O3 -std=c++17 bench/probes/cpu_i8_loop_forms.cpp -o i8forms && ./i8forms [ROWS]
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
using Clock = std::chrono::steady_clock;

template <int MODE>
AVX2 float run(const int8_t* q, int64_t rows, int64_t K, const float* x) {
  float tot = 0;
  const __m256i magic_i = _mm256_set1_epi32(0x4B400000);
  const __m256 magic_f = _mm256_set1_ps(12582912.f);  // 1.5 * 2^23
  for (int64_t n = 0; n < rows; n += 4) {
    const int8_t* qr[4] = {q + n * K, q + (n + 1) * K, q + (n + 2) * K, q + (n + 3) * K};
    __m256 plo[4], phi[4];
    for (int r = 0; r < 4; ++r) plo[r] = phi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m256 xl = _mm256_loadu_ps(x + k), xh = _mm256_loadu_ps(x + k + 8);
      if (MODE == 4) {
        const __m128i flip = _mm_set1_epi8(char(0x80)), hb = _mm_set1_epi8(0x64);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m128i u = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr[r] + k)), flip);
          plo[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_unpacklo_epi8(u, hb)), xl, plo[r]);
          phi[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_unpackhi_epi8(u, hb)), xh, phi[r]);
        }
        continue;
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256i vl = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr[r] + k)));
        const __m256i vh = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr[r] + k + 8)));
        __m256 lo, hi;
        if (MODE == 0) {
          lo = _mm256_cvtepi32_ps(vl);
          hi = _mm256_cvtepi32_ps(vh);
        } else if (MODE == 1 || MODE == 3) {
          lo = _mm256_castsi256_ps(vl);
          hi = _mm256_castsi256_ps(vh);
        } else {
          lo = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(vl, magic_i)), magic_f);
          hi = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(vh, magic_i)), magic_f);
        }
        if (MODE == 3) {
          plo[r] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(plo[r]), _mm256_castps_si256(lo)));
          phi[r] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(phi[r]), _mm256_castps_si256(hi)));
        } else {
          plo[r] = _mm256_fmadd_ps(lo, xl, plo[r]);
          phi[r] = _mm256_fmadd_ps(hi, xh, phi[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      alignas(32) float t8[8];
      _mm256_store_ps(t8, _mm256_add_ps(plo[r], phi[r]));
      for (float v : t8) tot += v;
    }
    if (MODE == 4) {  // the 1152 x part, once per row (the library would seed each segment)
      float sx = 0;
      for (int64_t k = 0; k < K; ++k) sx += x[k];
      tot -= 4 * 1152.f * sx;
    }
  }
  return tot;
}

template <int MODE>
double rate(const std::vector<int8_t>& q, int64_t rows, int64_t K, const std::vector<float>& x, float* sink) {
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    const auto t0 = Clock::now();
    *sink += run<MODE>(q.data(), rows, K, x.data());
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return double(rows) * K / best / 1e9;
}

double clock_ghz() {
  double best = 1e30;
  for (int rep = 0; rep < 10; ++rep) {
    uint64_t v = 1;
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < 200000000; ++i) asm volatile("add $1, %0" : "+r"(v));
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 0.2 / best;
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atol(argv[1]) : 64, K = 4096;
  std::vector<int8_t> q(size_t(rows * K));
  std::vector<float> x(static_cast<size_t>(K));
  uint32_t s = 1;
  for (auto& v : q) v = int8_t((s = s * 1664525u + 1013904223u) >> 24);
  for (auto& v : x) v = float(int((s = s * 1664525u + 1013904223u) >> 20) - 2048) / 2048.f;
  // The exact forms must agree with a double reference.
  double ref = 0;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < K; ++k) ref += double(q[size_t(n * K + k)]) * x[size_t(k)];
  const float r0 = run<0>(q.data(), rows, K, x.data()), r2 = run<2>(q.data(), rows, K, x.data());
  const float r4 = run<4>(q.data(), rows, K, x.data());
  std::printf("check: mode 0 %.6g, mode 2 %.6g, mode 4 %.6g, double %.6g\n", r0, r2, r4, ref);
  if (std::fabs(r0 - ref) > 1e-3 * std::fabs(ref) + 1 || std::fabs(r2 - ref) > 1e-3 * std::fabs(ref) + 1 ||
      std::fabs(r4 - ref) > 1e-3 * std::fabs(ref) + 1) {
    std::puts("mismatch");
    return 1;
  }
  float sink = 0;
  std::printf("clock (dependent adds): %.2f GHz\n", clock_ghz());
  std::printf("rows %ld x K %ld int8 (%.0f KB), one thread, G weights/s (best of 30):\n", long(rows), long(K),
              rows * K / 1024.0);
  for (int round = 0; round < 3; ++round)
    std::printf("  mode 0 %.2f | 1 (no convert) %.2f | 2 (add + sub) %.2f | 3 (widening loads only) %.2f | "
                "4 (via fp16) %.2f\n",
                rate<0>(q, rows, K, x, &sink), rate<1>(q, rows, K, x, &sink), rate<2>(q, rows, K, x, &sink),
                rate<3>(q, rows, K, x, &sink), rate<4>(q, rows, K, x, &sink));
  return sink == 12345.f;
}
