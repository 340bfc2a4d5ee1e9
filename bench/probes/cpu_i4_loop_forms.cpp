// The int4 M = 1 AVX2 inner loop (small_block_avx2_i4's form) stand-alone, in variants, on
// weights of ROWS x 4096 int4 (default 128 rows: 256 KB, cache-resident; 32768: from DRAM),
// one thread, x scaled near 2^90 (so that the subnormal forms' products stay normal).
// bench/CPU_NOTES.md 48. Modes 6 and 7 compute wrong values (timing only); 1, 3, 5, 9 and
// 11 compute sum(nibble * x) * 2^-133 without the library's offset (no seed): timing only.
//
//   g++ -O3 -std=c++17 bench/probes/cpu_i4_loop_forms.cpp -o i4forms && ./i4forms [ROWS]
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

// As the library compiles its blocks: a target attribute per function, the rest baseline.
#define AVX2 __attribute__((target("avx2,fma")))
// vpshufb controls: byte b of each dword to byte 2, zeros elsewhere (the library's).
AVX2 static void make_sel(__m256i (&sel)[4]) {
  for (int b = 0; b < 4; ++b) {
    const char z = -128;
    sel[b] = _mm256_setr_epi8(z, z, char(b), z, z, z, char(4 + b), z, z, z, char(8 + b), z, z, z,
                              char(12 + b), z, z, z, char(b), z, z, z, char(4 + b), z, z, z,
                              char(8 + b), z, z, z, char(12 + b), z);
  }
}
// Two weight rows at a time, as the library's block. MODE 0: vpshufb + XOR + FMA with 2
// chains a row (the library's); 1: the same without the XOR (subnormal weights); 2 and 3:
// as 0 and 1 with 4 chains a row.
template <int MODE>
AVX2 float run(const uint8_t* q, int64_t rows, int64_t K, const float* x, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bits = _mm256_set1_epi32(0x3F880000);
  __m256i sel[4];
  make_sel(sel);
  float tot = 0;
  for (int64_t n = 0; n < rows; n += 2) {
    const uint8_t* qr[2] = {q + n * K / 2, q + (n + 1) * K / 2};
    __m256 plo[2][2], phi[2][2];
    for (int r = 0; r < 2; ++r) for (int c = 0; c < 2; ++c) plo[r][c] = phi[r][c] = _mm256_setzero_ps();
    constexpr int C = MODE >= 2 ? 2 : 1;
    for (int64_t k = 0; k < K; k += 64) {
#pragma GCC unroll 2
      for (int r = 0; r < 2; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr[r] + k / 2));
        const __m256i t = _mm256_and_si256(v, low4);
        const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          __m256i st = _mm256_shuffle_epi8(t, sel[b]), su = _mm256_shuffle_epi8(u, sel[b]);
          if (MODE % 2 == 0) { st = _mm256_xor_si256(st, bits); su = _mm256_xor_si256(su, bits); }
          plo[r][b % C] = _mm256_fmadd_ps(_mm256_castsi256_ps(st), _mm256_loadu_ps(x + k + 16 * b), plo[r][b % C]);
          phi[r][b % C] = _mm256_fmadd_ps(_mm256_castsi256_ps(su), _mm256_loadu_ps(x + k + 16 * b + 8), phi[r][b % C]);
        }
      }
    }
    for (int r = 0; r < 2; ++r) {
      alignas(32) float t8[8];
      _mm256_store_ps(t8, _mm256_add_ps(_mm256_add_ps(plo[r][0], phi[r][0]), _mm256_add_ps(plo[r][1], phi[r][1])));
      float s = 0; for (float v : t8) s += v;
      out[n + r] = s; tot += s;
    }
  }
  return tot;
}
// 8 weights as fp32: 1.0625 + q / 128 (XOR), or the nibble as a subnormal (no XOR).
template <int XOR, int SH>
AVX2 inline __m256 weights8(__m256i t, __m256i sel, __m256i bits) {
  const __m256i w = SH ? _mm256_shuffle_epi8(t, sel) : _mm256_add_epi32(t, sel);
  return _mm256_castsi256_ps(XOR ? _mm256_xor_si256(w, bits) : w);
}
// One weight row at a time. CH: 4 or 8 accumulator chains, or 0 for pairs of products
// (a mul, an FMA on it, one add into each of 4 chains). SH = 0: an add in place of each
// vpshufb (wrong values; timing only).
template <int XOR, int CH, int SH = 1>
AVX2 float run_row(const uint8_t* q, int64_t rows, int64_t K, const float* x, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bits = _mm256_set1_epi32(0x3F880000);
  __m256i sel[4];
  make_sel(sel);
  auto weights = [&](__m256i t, int b) { return weights8<XOR, SH>(t, sel[b], bits); };
  float tot = 0;
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* qr = q + n * K / 2;
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + k / 2));
      const __m256i t = _mm256_and_si256(v, low4);
      const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const float* xk = x + k;
      if constexpr (CH == 0) {
#pragma GCC unroll 2
        for (int b = 0; b < 4; b += 2) {
          a[b] = _mm256_add_ps(a[b], _mm256_fmadd_ps(weights(t, b), _mm256_loadu_ps(xk + 16 * b),
                                                     _mm256_mul_ps(weights(t, b + 1), _mm256_loadu_ps(xk + 16 * b + 16))));
          a[b + 1] = _mm256_add_ps(a[b + 1], _mm256_fmadd_ps(weights(u, b), _mm256_loadu_ps(xk + 16 * b + 8),
                                                             _mm256_mul_ps(weights(u, b + 1), _mm256_loadu_ps(xk + 16 * b + 24))));
        }
      } else {
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const int c = CH == 8 ? 2 * b : 2 * (b & 1);
          a[c] = _mm256_fmadd_ps(weights(t, b), _mm256_loadu_ps(xk + 16 * b), a[c]);
          a[c + 1] = _mm256_fmadd_ps(weights(u, b), _mm256_loadu_ps(xk + 16 * b + 8), a[c + 1]);
        }
      }
    }
    alignas(32) float t8[8];
    __m256 s8 = a[0];
    for (int i = 1; i < 8; ++i) s8 = _mm256_add_ps(s8, a[i]);
    _mm256_store_ps(t8, s8);
    float s = 0;
    for (float v : t8) s += v;
    out[n] = s;
    tot += s;
  }
  return tot;
}
const char* kNames[12] = {
    "0 two rows, 2 chains a row, shuffle + XOR (the library's)", "1 two rows, 2 chains a row, no XOR (subnormal weights)",
    "2 two rows, 4 chains a row, shuffle + XOR", "3 two rows, 4 chains a row, no XOR",
    "4 one row, 4 chains, shuffle + XOR", "5 one row, 4 chains, no XOR",
    "6 one row, 4 chains, add instead of shuffle, XOR (timing)", "7 one row, 4 chains, add, no XOR (timing)",
    "8 one row, 8 chains, shuffle + XOR", "9 one row, 8 chains, no XOR",
    "10 one row, mul + FMA + add pairs, XOR", "11 one row, mul + FMA + add pairs, no XOR"};
using Form = float (*)(const uint8_t*, int64_t, int64_t, const float*, float*);
const Form forms[12] = {run<0>, run<1>, run<2>, run<3>, run_row<1, 4>, run_row<0, 4>, run_row<1, 4, 0>,
                        run_row<0, 4, 0>, run_row<1, 8>, run_row<0, 8>, run_row<1, 0>, run_row<0, 0>};
int main(int argc, char** argv) {
  const int64_t K = 4096, rows = argc > 1 ? atoi(argv[1]) : 128;  // 128 rows x 2 KB = 256 KB
  std::vector<uint8_t> q(rows * K / 2);
  for (auto& b : q) b = rand() & 255;
  std::vector<float> x(K), out(rows);
  for (auto& v : x) v = ldexpf((rand() / (float)RAND_MAX - 0.5f), 90);
  for (int rep = 0; rep < 3; ++rep) {
    for (int mode = 0; mode < 12; ++mode) {
      const int iters = 2000;
      auto t0 = std::chrono::steady_clock::now();
      float s = 0;
      for (int i = 0; i < iters; ++i) s += forms[mode](q.data(), rows, K, x.data(), out.data());
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%-58s %6.2f G weights/s (checksum %g)\n", kNames[mode], rows * K * (double)iters / dt / 1e9, s);
    }
  }
}
