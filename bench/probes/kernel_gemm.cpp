// Times the kernel library's CPU fp32 gemm alone (no torch): random a [M, K], b [K, N],
// c [M, N] row-major, the library's own pool at PORTABLE_GEMM_NUM_THREADS threads. Checks a
// sample of outputs against float64 first, then prints the median and fastest call.
// bench/CPU_NOTES.md 37 used it to A/B cache-block sizes. Built like kernel_mixed_linear.cpp
// (see there), once per build of the library:
//
//   g++ -O2 -std=c++17 -Iinclude bench/probes/kernel_gemm.cpp -L$AB -lpgk_a
//       -Wl,-rpath,$AB -o $AB/gemm_a
//   PORTABLE_GEMM_NUM_THREADS=2 $AB/gemm_a M N K REPS
//
// On a shared VM alternate the builds for several rounds (single runs moved 28-43 ms at
// 1024^3 within minutes there).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "portable_gemm/kernels.h"

using namespace portable_gemm;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s M N K REPS\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atol(argv[1]), N = std::atol(argv[2]), K = std::atol(argv[3]);
  const int reps = std::atoi(argv[4]);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a(size_t(M * K)), b(size_t(K * N)), c(size_t(M * N));
  for (auto& v : a) v = u(rng);
  for (auto& v : b) v = u(rng);
  GemmArgs g;
  g.a = {a.data(), M, K, K, 1, DType::f32};
  g.b = {b.data(), K, N, N, 1, DType::f32};
  g.c = {c.data(), M, N, N, 1, DType::f32};
  auto call = [&] {
    const Status st = cpu::gemm(g, builtin_executor());
    if (!st.ok()) {
      std::fprintf(stderr, "gemm: %s\n", st.message);
      std::exit(1);
    }
  };
  call();
  double err = 0;
  for (int s = 0; s < 64; ++s) {
    const int64_t i = (s * 7919) % M, j = (s * 104729) % N;
    double ref = 0, mag = 0;
    for (int64_t k = 0; k < K; ++k) {
      ref += double(a[size_t(i * K + k)]) * b[size_t(k * N + j)];
      mag += std::fabs(double(a[size_t(i * K + k)]) * b[size_t(k * N + j)]);
    }
    err = std::max(err, std::fabs(c[size_t(i * N + j)] - ref) / mag);
  }
  if (err > 1e-5) {
    std::fprintf(stderr, "wrong: relative error %.3g\n", err);
    return 1;
  }
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const double med = t[t.size() / 2];
  std::printf("M=%ld N=%ld K=%ld: error %.1e, median %.2f ms (%.1f GFLOP/s), fastest %.2f ms\n", long(M),
              long(N), long(K), err, med * 1e3, 2.0 * M * N * K / med / 1e9, t[0] * 1e3);
}
