// Times the kernel library's CPU mixed_linear alone (no torch): bf16 x and scales, random
// int4 / int8 weights rotated over 192 MB of copies (past the caches) unless COPIES is
// given, the pool at PORTABLE_GEMM_NUM_THREADS threads. Checks the output against a float64
// reference first, then prints the median and fastest call and the weight read rate.
// bench/CPU_NOTES.md 31 and 32 used it to A/B two builds of the library. From the repository
// root, with AB a scratch folder, once per build (a, b, ...):
//
//   g++ -O3 -std=c++17 -fPIC -shared -Iinclude -Isrc/kernels -DPG_VERSION='"ab"'
//       -DPG_CXX_COMPILER='"g++"' src/kernels/common/*.cpp src/kernels/cpu/*.cpp
//       src/kernels/cuda/unavailable.cpp -lpthread -o $AB/libpgk_a.so
//   g++ -O2 -std=c++17 -Iinclude bench/probes/kernel_mixed_linear.cpp -L$AB -lpgk_a
//       -Wl,-rpath,$AB -o $AB/run_a
//   PORTABLE_GEMM_NUM_THREADS=2 $AB/run_a M N K GROUP REPS [BITS [COPIES]]
//
// Alternate the builds' runs for several rounds: single runs on a shared VM move by 20 %.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "bf16_bits.h"
#include "mixed_args.h"
#include "portable_gemm/kernels.h"

using namespace portable_gemm;


int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N K GROUP REPS [BITS=4 [COPIES]]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atol(argv[1]), N = std::atol(argv[2]), K = std::atol(argv[3]);
  const int64_t gs = std::atol(argv[4]);
  const int reps = std::atoi(argv[5]);
  const int bits = argc > 6 ? std::atoi(argv[6]) : 4;
  const int64_t row = bits == 4 ? K / 2 : K, wbytes = N * row;
  const int copies = argc > 7 ? std::atoi(argv[7]) : int(std::max<int64_t>(1, (192ll << 20) / wbytes));
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::vector<uint8_t>> w(copies, std::vector<uint8_t>(size_t(wbytes)));
  for (auto& c : w)
    for (auto& b : c) b = uint8_t(byte(rng));
  const int64_t ng = gs ? K / gs : 1;
  std::vector<uint16_t> s(size_t(N * ng)), x(size_t(M * K)), y(size_t(M * N));
  for (auto& v : s) v = to_bf16((byte(rng) + 1) / 2e4f);
  for (auto& v : x) v = to_bf16((byte(rng) - 127.5f) / 64.f);
  auto call = [&](int c) {
    const MixedLinearArgs a = mixed_args(x.data(), M, K, w[c].data(), N, row, bits, gs, s.data(), y.data());
    const Status st = cpu::mixed_linear(a, builtin_executor());
    if (!st.ok()) {
      std::fprintf(stderr, "mixed_linear: %s\n", st.message);
      std::exit(1);
    }
  };
  call(0);
  double err = 0, big = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) {
        int q;
        if (bits == 4) {
          const uint8_t b = w[0][size_t(n * row + k / 2)];
          const int nib = (k & 1) ? b >> 4 : b & 15;
          q = nib >= 8 ? nib - 16 : nib;
        } else {
          q = int8_t(w[0][size_t(n * row + k)]);
        }
        ref += double(q) * from_bf16(s[size_t(n * ng + (gs ? k / gs : 0))]) * from_bf16(x[size_t(m * K + k)]);
      }
      err = std::max(err, std::fabs(from_bf16(y[size_t(m * N + n)]) - ref));
      big = std::max(big, std::fabs(ref));
    }
  if (err > 1.0 / 128 * big) {  // one bf16 rounding of the largest output is 1/256 of it
    std::fprintf(stderr, "wrong: max error %.3g against max |y| %.3g\n", err, big);
    return 1;
  }
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call((i + 1) % copies);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const double med = t[t.size() / 2];
  std::printf("M=%ld N=%ld K=%ld group=%ld bits=%d copies=%d: max error %.2g of %.3g, median %.3f ms, "
              "fastest %.3f ms, %.1f GB/s of weight\n",
              long(M), long(N), long(K), long(gs), bits, copies, err, big, med * 1e3, t[0] * 1e3,
              wbytes / med / 1e9);
}
