// The int4 M = 1 nibble block's inner loop (small_block_nib<1, 4, true> of
// src/kernels/cpu/mixed_linear.cpp: per 4 weight rows x 128 k, 4 loads, 12 shifts, 16
// vpternlogd, 16 vdpbf16ps) alone, on weights that stay in L1 / L2, one thread, in TSC ticks
// per block; then with one of its parts taken out (shifts, vpternlogd, vdpbf16ps) or one of
// the library's extras added (the prefetch of the next rows, the partial sums' seed, a group
// scale loaded through a dtype switch). bench/CPU_NOTES.md 44 used it:
//
//   g++ -O3 -std=c++17 bench/probes/cpu_nib_block.cpp -o /tmp/nib && /tmp/nib ROWS K [DTYPE]
//
// ROWS x K / 2 bytes of weights (768 2048: 768 KB, in L2); DTYPE of the scales for the switch
// (0 f32, 1 bf16, 2 f16). The outputs are not checked: it times instruction mixes.
#include <immintrin.h>
#include <x86intrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
inline float sload(const void* b, int64_t i, int dt) {
  switch (dt) { case 1: { uint32_t u = uint32_t(((const uint16_t*)b)[i]) << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
    case 2: return (float)((const _Float16*)b)[i];
    default: return ((const float*)b)[i]; }
}
template <int V>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"), noinline))
float run(const uint8_t* w, int64_t rs, int nrows, int64_t K, const uint16_t* xn, const float* scales, const float* seed, const uint16_t* bscales, int dt) {
  constexpr int NB = 4;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i c_lo = _mm512_set1_epi16(0x4308), c_hi = _mm512_set1_epi16(0x4308);
  __m512 tot = _mm512_setzero_ps();
  for (int n = 0; n < nrows; n += NB) {
    __m512 acc[NB];
    for (int r = 0; r < NB; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* q[NB];
    for (int r = 0; r < NB; ++r) q[r] = w + (n + r) * rs;
    for (int64_t k = 0; k < K; k += 128) {
      __m512 part[NB];
      if (V & 16) { const __m512 sd = _mm512_loadu_ps(seed + (k / 128) * 16); for (int r = 0; r < NB; ++r) part[r] = sd; }
      else for (int r = 0; r < NB; ++r) part[r] = _mm512_setzero_ps();
      __m512i raw[NB];
      for (int r = 0; r < NB; ++r) raw[r] = _mm512_loadu_si512(q[r] + k / 2);
      if (V & 8) for (int r = 0; r < NB; ++r) _mm_prefetch((const char*)q[r] + k / 2 + NB * rs, _MM_HINT_T1);
      for (int j = 0; j < 4; ++j) {
        __m512bh wj[NB];
        for (int r = 0; r < NB; ++r) {
          __m512i v;
          if (V == 1) v = raw[r];                       // no shifts
          else v = j == 0 ? raw[r] : _mm512_srli_epi16(raw[r], 4 * j);
          if (V == 2) wj[r] = (__m512bh)v;             // no ternlog
          else wj[r] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, (j & 1) ? c_hi : c_lo, 0x6A);
        }
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xn + k + j * 32);
        for (int r = 0; r < NB; ++r) {
          if (V == 3) part[r] = _mm512_add_ps(part[r], (__m512)wj[r]);  // add instead of dpbf16
          else part[r] = _mm512_dpbf16_ps(part[r], wj[r], xv);
        }
      }
      for (int r = 0; r < NB; ++r)
        acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps((V & 32) ? sload(bscales, (n + r) * (K / 128) + k / 128, dt) : scales[(n + r) * (K / 128) + k / 128]), acc[r]);
    }
    for (int r = 0; r < NB; ++r) tot = _mm512_add_ps(tot, acc[r]);
  }
  return _mm512_reduce_add_ps(tot);
}
int main(int argc, char** argv) {
  const int nrows = atoi(argv[1]); const int64_t K = atol(argv[2]);
  const int64_t rs = K / 2;
  std::vector<uint8_t> w(nrows * rs); for (auto& b : w) b = rand();
  std::vector<uint16_t> x(K); for (auto& v : x) v = 0x3f80 + (rand() & 0x7f);
  std::vector<float> s(nrows * (K / 128), 0.01f);
  std::vector<float> seed(K / 128 * 16, 0.5f); std::vector<uint16_t> bs(nrows * (K / 128), 0x3c23);
  const int dt = argc > 3 ? atoi(argv[3]) : 1;
  float sink = 0;
  auto time = [&](auto f) { double best = 1e30; for (int r = 0; r < 200; ++r) { uint64_t t0 = __rdtsc(); sink += f(); best = std::min(best, double(__rdtsc() - t0)); } return best; };
  const double blocks = double(nrows / 4) * (K / 128);
  for (int rep = 0; rep < 2; ++rep) {
#define T(v) time([&] { return run<v>(w.data(), rs, nrows, K, x.data(), s.data(), seed.data(), bs.data(), dt); }) / blocks
    printf("ticks/block: base %.1f | without shifts %.1f, vpternlogd %.1f, vdpbf16ps (an add instead) %.1f"
           " | with the prefetch %.1f, seed %.1f, scale switch %.1f, all three %.1f (%.0f KB)\n",
           T(0), T(1), T(2), T(3), T(8), T(16), T(32), T(56), nrows * rs / 1024.0);
  }
  return sink == 12345;
}
