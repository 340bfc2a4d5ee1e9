// Times the kernel library's CPU gemm alone (no torch): random a [M, K], b [K, N], c [M, N],
// fp32 or bf16 (DTYPE), b row-major or, with LAYOUT "t", the transposed view of a row-major
// [N, K] weight (what F.linear and the weight-only M = 256 path multiply). The library's
// own pool at PORTABLE_GEMM_NUM_THREADS threads. Checks a sample of outputs against float64
// first, then prints the median and fastest call.
// bench/CPU_NOTES.md 37 used it to A/B cache-block sizes. Built like kernel_mixed_linear.cpp
// (see there), once per build of the library:
//
//   g++ -O2 -std=c++17 -Iinclude bench/probes/kernel_gemm.cpp -L$AB -lpgk_a
//       -Wl,-rpath,$AB -o $AB/gemm_a
//   PORTABLE_GEMM_NUM_THREADS=2 $AB/gemm_a M N K REPS [DTYPE f32|bf16 [LAYOUT n|t]]
//
// On a shared VM alternate the builds for several rounds (single runs moved 28-43 ms at
// 1024^3 within minutes there).
//
// Built with -DPG_PROBE_PAIRS it is an A/B of two settings inside one library instead, call
// by call: REPS pairs of calls, one under setting 0 and one under setting B (PGX_PAIR_B,
// default 1; the first of a pair alternates), and the median and quartiles of the per-pair
// time ratios. Two calls a few ms apart see the same VM, whose speed drifts over seconds
// (separate processes of the same code moved 0.6-1.7x, bench/CPU_NOTES.md 40), so the
// spread is the code's; CPU_NOTES 42 measured A read in place with it. It links against a
// scratch build of the library that exports the switch under test,
//   extern "C" void pgx_set_a_mode(int mode);   // read by the code under test per call
// (the shipped library has none):
//   g++ -O2 -std=c++17 -fopenmp -DPG_PROBE_PAIRS -Iinclude -Ibench/probes
//       bench/probes/kernel_gemm.cpp -L$AB -lpgk_a -Wl,-rpath,$AB -o $AB/gemm_pairs
// (-fopenmp for omp_executor.h, the PGX_PAIR_EXEC=omp pairing)
//   PORTABLE_GEMM_NUM_THREADS=2 [PGX_PAIR_B=2] $AB/gemm_pairs M N K REPS [f32|bf16 [n|t]]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "bf16_bits.h"
#include "portable_gemm/kernels.h"

using namespace portable_gemm;
#ifdef PG_PROBE_PAIRS
// Weak: a pairing of executors (PGX_PAIR_EXEC=omp) needs no switch in the library.
extern "C" void pgx_set_a_mode(int mode) __attribute__((weak));
#include "omp_executor.h"
#endif


int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s M N K REPS [f32|bf16 [n|t]]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atol(argv[1]), N = std::atol(argv[2]), K = std::atol(argv[3]);
  const int reps = std::atoi(argv[4]);
  const bool bf16 = argc > 5 && std::strcmp(argv[5], "bf16") == 0;
  const bool trans = argc > 6 && std::strcmp(argv[6], "t") == 0;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  // Values rounded to bf16 when the inputs are bf16, so the float64 reference sees them.
  std::vector<float> a(size_t(M * K)), b(size_t(K * N)), c(size_t(M * N));
  for (auto& v : a) v = bf16 ? from_bf16(to_bf16(u(rng))) : u(rng);
  for (auto& v : b) v = bf16 ? from_bf16(to_bf16(u(rng))) : u(rng);  // b[k][n], or w[n][k]
  std::vector<uint16_t> ah, bh, ch;
  if (bf16) {
    for (float v : a) ah.push_back(to_bf16(v));
    for (float v : b) bh.push_back(to_bf16(v));
    ch.resize(c.size());
  }
  const DType dt = bf16 ? DType::bf16 : DType::f32;
  const void* ap = bf16 ? static_cast<const void*>(ah.data()) : a.data();
  const void* bp = bf16 ? static_cast<const void*>(bh.data()) : b.data();
  void* cp = bf16 ? static_cast<void*>(ch.data()) : c.data();
  GemmArgs g;
  g.a = {ap, M, K, K, 1, dt};
  g.b = trans ? ConstMatrix{bp, K, N, 1, K, dt} : ConstMatrix{bp, K, N, N, 1, dt};
  g.c = {cp, M, N, N, 1, dt};
  auto bval = [&](int64_t k, int64_t j) { return double(trans ? b[size_t(j * K + k)] : b[size_t(k * N + j)]); };
  auto cval = [&](int64_t i, int64_t j) { return bf16 ? double(from_bf16(ch[size_t(i * N + j)])) : double(c[size_t(i * N + j)]); };
  const Executor* exec = &builtin_executor();
  auto call = [&] {
    const Status st = cpu::gemm(g, *exec);
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
      ref += double(a[size_t(i * K + k)]) * bval(k, j);
      mag += std::fabs(double(a[size_t(i * K + k)]) * bval(k, j));
    }
    err = std::max(err, std::fabs(cval(i, j) - ref) / mag);
  }
  if (err > (bf16 ? 1e-2 : 1e-5)) {
    std::fprintf(stderr, "wrong: relative error %.3g\n", err);
    return 1;
  }
#ifdef PG_PROBE_PAIRS
  const int other = std::getenv("PGX_PAIR_B") ? std::atoi(std::getenv("PGX_PAIR_B")) : 1;
  // PGX_PAIR_EXEC=omp: setting 0 is the library's pool, setting 1 omp_executor() (no switch).
  const bool pair_exec = std::getenv("PGX_PAIR_EXEC") && std::strcmp(std::getenv("PGX_PAIR_EXEC"), "omp") == 0;
  if (!pair_exec && !pgx_set_a_mode) {
    std::fprintf(stderr, "the library exports no pgx_set_a_mode; set PGX_PAIR_EXEC=omp or link a scratch build\n");
    return 2;
  }
  std::vector<double> r, t0s, t1s;
  for (int i = 0; i < reps; ++i) {
    double tm[2];
    for (int h = 0; h < 2; ++h) {
      const int mode = (i + h) % 2;  // swap which goes first every pair
      if (pair_exec)
        exec = mode == 0 ? &builtin_executor() : &omp_executor();
      else
        pgx_set_a_mode(mode == 0 ? 0 : other);
      const auto s0 = std::chrono::steady_clock::now();
      call();
      tm[mode] = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    }
    r.push_back(tm[1] / tm[0]);
    t0s.push_back(tm[0]);
    t1s.push_back(tm[1]);
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::vector<double> rs = r;
  std::sort(rs.begin(), rs.end());
  std::printf("M=%ld N=%ld K=%ld: error %.1e, %d pairs: setting %d / setting 0 median %.3f (quartiles "
              "%.3f-%.3f), median ms setting 0 %.3f, setting %d %.3f\n", long(M), long(N), long(K), err, reps,
              other, med(r),
              rs[rs.size() / 4], rs[3 * rs.size() / 4], med(t0s) * 1e3, other, med(t1s) * 1e3);
#else
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
#endif
}
