// The AVX2 fp32 micro-kernel (gemm.cpp's kern_avx2<6>, 6 x 16) alone against other shapes
// of register block, one thread, A and B slivers in L1 (kc 384), C in registers: what the
// FMA units allow per form on this core. bench/CPU_NOTES.md 52 (a core that splits each
// 256-bit FMA in two, where broadcasts may share the FMA pipes).
//
//   6x16  12 accumulators, 2 B loads + 6 broadcasts per 12 FMAs (the library's)
//   4x24  12 accumulators, 3 B loads + 4 broadcasts per 12 FMAs
//   8x8    8 accumulators, 1 B load + 8 broadcasts per 8 FMAs (a reference: more broadcasts)
//   dup4   the same blocks with A packed four times over, 128-bit broadcasts (vbroadcastf128)
//   k unrolled 4x: the same blocks with the k loop unrolled four times
//   regs  12 FMA chains on registers only (the FMA peak)
//
// Each form is checked against float64 first.
//   g++ -O3 -std=c++17 bench/probes/cpu_avx2_ukernel_forms.cpp -o ukforms && ./ukforms
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#define AVX2 __attribute__((target("avx2,fma")))
using Clock = std::chrono::steady_clock;

// MR x (8 NV): a packed as kc x MR, b as kc x 8 NV. DUP 4: a packed with each value four
// times (kc x MR x 4) and loaded by vbroadcastf128 instead of vbroadcastss. U: k steps per
// iteration of the k loop (kc a multiple of U).
template <int MR, int NV, int DUP = 1, int U = 1>
AVX2 __attribute__((noinline)) void kern(int64_t kc, const float* a, const float* b, float* c) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += U) {
#pragma GCC unroll 4
   for (int u = 0; u < U; ++u) {
    __m256 bv[NV];
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) bv[j] = _mm256_loadu_ps(b + 8 * j);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = DUP == 4 ? _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a + 4 * i))
                                 : _mm256_broadcast_ss(a + i);
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(ai, bv[j], acc[i][j]);
    }
    a += MR * DUP;
    b += 8 * NV;
   }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(c + i * 8 * NV + 8 * j, acc[i][j]);
}

AVX2 __attribute__((noinline)) float regs(int64_t n) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i));
  const __m256 m = _mm256_set1_ps(0.999f), d = _mm256_set1_ps(0.001f);
  for (int64_t k = 0; k < n; ++k)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, d);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  return t[0];
}

template <int MR, int NV, int DUP = 1, int U = 1>
double gflops(int64_t kc, const std::vector<float>& a0, const std::vector<float>& b, std::vector<float>& c) {
  constexpr int NR = 8 * NV;
  std::vector<float> ad(a0.size() * DUP);
  for (size_t i = 0; i < a0.size(); ++i)
    for (int d = 0; d < DUP; ++d) ad[i * DUP + size_t(d)] = a0[i];
  const std::vector<float>& a = a0;
  // Check once against float64.
  kern<MR, NV, DUP, U>(kc, ad.data(), b.data(), c.data());
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      double r = 0;
      for (int64_t k = 0; k < kc; ++k) r += double(a[size_t(k * MR + i)]) * b[size_t(k * NR + j)];
      if (std::fabs(r - c[size_t(i * NR + j)]) > 1e-3 * (1 + std::fabs(r))) {
        std::printf("%dx%d: wrong result\n", MR, NR);
        std::exit(1);
      }
    }
  const int calls = 20000;
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) kern<MR, NV, DUP, U>(kc, ad.data(), b.data(), c.data());
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 2.0 * MR * NR * kc * calls / best / 1e9;
}

int main() {
  const int64_t kc = 384;
  std::vector<float> a(static_cast<size_t>(kc * 8)), b(static_cast<size_t>(kc * 24)), c(8 * 24);
  uint32_t s = 7;
  for (auto& v : a) v = float(int((s = s * 1664525u + 1013904223u) >> 22) - 512) / 512.f;
  for (auto& v : b) v = float(int((s = s * 1664525u + 1013904223u) >> 22) - 512) / 512.f;
  for (int round = 0; round < 3; ++round) {
    double best = 1e30;
    const int64_t n = 20000000;
    float sink = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = Clock::now();
      sink += regs(n);
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double peak = 2.0 * 8 * 12 * n / best / 1e9;
    const double f616 = gflops<6, 2>(kc, a, b, c), f424 = gflops<4, 3>(kc, a, b, c), f88 = gflops<8, 1>(kc, a, b, c);
    const double d616 = gflops<6, 2, 4>(kc, a, b, c), d424 = gflops<4, 3, 4>(kc, a, b, c);
    const double u616 = gflops<6, 2, 1, 4>(kc, a, b, c), u424 = gflops<4, 3, 1, 4>(kc, a, b, c);
    std::printf("k unrolled 4x: 6x16 %.1f (%.0f%%) | 4x24 %.1f (%.0f%%)\n", u616, 100 * u616 / peak, u424,
                100 * u424 / peak);
    std::printf("GFLOP/s one thread: regs %.1f | 6x16 %.1f (%.0f%%) | 4x24 %.1f (%.0f%%) | 8x8 %.1f (%.0f%%) | "
                "6x16 dup4 %.1f (%.0f%%) | 4x24 dup4 %.1f (%.0f%%)%s\n", peak, f616, 100 * f616 / peak, f424,
                100 * f424 / peak, f88, 100 * f88 / peak, d616, 100 * d616 / peak, d424, 100 * d424 / peak,
                sink == 1.f ? " " : "");
  }
}
