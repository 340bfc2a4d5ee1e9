// The AVX-512 fp32 micro-kernel's register blocks alone, one thread, against the FMA peak:
// an A sliver of kc x MR in L1 and a B panel of kc x 512 streamed from L2 sliver by sliver
// (as run_block's ir / jr loops do), C in registers. bench/CPU_NOTES.md 63 used it to show
// that gemm.cpp's 12 x 32 block runs at the FMA peak, so the fp32 GEMM's distance to
// torch lies in its blocking (packing, partial sums), not in its kernel.
//
//   12x32  24 accumulators, 2 B loads + 12 broadcasts per 24 FMAs (the library's)
//   14x32  28 accumulators
//   8x48   24 accumulators, 3 B loads + 8 broadcasts
//   6x64   24 accumulators, 4 B loads + 6 broadcasts
//   regs   24 FMA chains on registers only (the FMA peak; its GHz is the FMA clock)
//
//   g++ -O3 -std=c++17 bench/probes/cpu_avx512_ukernel_rate.cpp -o ukrate && ./ukrate
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#define AVX512 __attribute__((target("avx512f,fma")))
using Clock = std::chrono::steady_clock;

template <int MR, int NV>
AVX512 __attribute__((noinline)) void kern(int64_t kc, const float* a, const float* b, float* c) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_ps(b + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(ai, bv[j], acc[i][j]);
    }
    a += MR;
    b += 16 * NV;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + (i * NV + j) * 16, acc[i][j]);
}

AVX512 __attribute__((noinline)) float regs(int64_t n) {
  __m512 acc[24];
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

template <typename F>
double best_seconds(int reps, F f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

template <int MR, int NV>
void run(const char* name, int64_t kc, int64_t cols) {
  const int64_t nr = 16 * NV, slivers = cols / nr;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a(size_t(kc * MR)), b(size_t(kc * slivers * nr)), c(size_t(MR * nr));
  for (auto& v : a) v = u(rng);
  for (auto& v : b) v = u(rng);
  // Check one sliver against float64 first.
  kern<MR, NV>(kc, a.data(), b.data(), c.data());
  double err = 0;
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < nr; ++j) {
      double r = 0;
      for (int64_t k = 0; k < kc; ++k) r += double(a[k * MR + i]) * b[k * nr + j];
      err = std::max(err, std::abs(r - c[i * nr + j]));
    }
  const double t = best_seconds(40, [&] {
    for (int it = 0; it < 20; ++it)
      for (int64_t s = 0; s < slivers; ++s) kern<MR, NV>(kc, a.data(), b.data() + s * kc * nr, c.data());
  });
  std::printf("%-6s kc %4lld, B panel %4.0f KB: %6.1f GFLOP/s (max error %.1e)\n", name, (long long)kc,
              kc * slivers * nr * 4 / 1024.0, 2.0 * MR * nr * kc * slivers * 20 / t * 1e-9, err);
}

int main() {
  const int64_t n = 1000000;
  const double t = best_seconds(5, [&] { volatile float f = regs(n); (void)f; });
  const double peak = 2.0 * 16 * 24 * n / t * 1e-9;
  std::printf("regs   FMA peak %.1f GFLOP/s (%.2f GHz x 64 FLOP a cycle)\n", peak, peak / 64);
  run<12, 2>("12x32", 384, 512);
  run<14, 2>("14x32", 384, 512);
  run<8, 3>("8x48", 384, 480);
  run<6, 4>("6x64", 384, 512);
  run<12, 2>("12x32", 256, 512);
  run<12, 2>("12x32", 512, 512);
}
