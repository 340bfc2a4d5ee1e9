// A/B of two or more builds of the kernel library's CPU mixed_linear in ONE process (no
// torch): each library is dlopen'ed with its own symbols (RTLD_DEEPBIND) and its own
// thread pool, and the builds take turns, a block of calls each, for several rounds. Each
// round also times a plain read of a buffer larger than the caches on the same number of
// threads (the bench's read probe), so a kernel's weight rate can be put against it.
// bf16 x and scales, random int4 / int8 weights rotated over 192 MiB of copies (PGX_ROT_MB).
//
// Separate processes cannot resolve a few per cent on the shared VMs this project is
// measured on: their speed moves by 20-40 % from one minute to the next
// (bench/CPU_NOTES.md 46, 47). Here every round puts the builds side by side in time.
//
// Build each library as in kernel_mixed_linear.cpp (one .so per tree), then:
//
//   g++ -O2 -std=c++17 -Iinclude -Ibench/probes bench/probes/kernel_mixed_linear_ab.cpp
//       -ldl -lpthread -o $AB/ab
//   $AB/ab M N K GROUP BITS THREADS ROUNDS CALLS LIB_A LIB_B [LIB_C ...]
//
// PGX_TIMING_ONLY=1 times builds whose outputs differ (variants that skip work on purpose).
// Prints per round each build's median call and GB/s of weight, the read probe, and at the
// end the median over rounds of each build's time relative to the first, the rounds it won,
// and its fastest round against the first build's.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bf16_bits.h"
#include "mixed_args.h"
#include "portable_gemm/kernels.h"

using namespace portable_gemm;
using Clock = std::chrono::steady_clock;

namespace {

using MixedFn = Status (*)(const MixedLinearArgs&, const Executor&);
using ExecFn = const Executor& (*)();

struct Build {
  std::string path;
  MixedFn mixed_linear = nullptr;
  const Executor* exec = nullptr;
};

Build open_build(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (!h) {
    std::fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
    std::exit(2);
  }
  Build b;
  b.path = path;
  b.mixed_linear = reinterpret_cast<MixedFn>(
      dlsym(h, "_ZN13portable_gemm3cpu12mixed_linearERKNS_15MixedLinearArgsERKNS_8ExecutorE"));
  auto exec = reinterpret_cast<ExecFn>(dlsym(h, "_ZN13portable_gemm16builtin_executorEv"));
  if (!b.mixed_linear || !exec) {
    std::fprintf(stderr, "%s: the CPU mixed_linear or builtin_executor symbol is missing\n", path);
    std::exit(2);
  }
  b.exec = &exec();
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// GB/s of a sum over `buf` (larger than the caches) on `threads` threads, best of 3 passes.
double read_probe(const std::vector<float>& buf, int threads) {
  double best = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    std::vector<double> part(size_t(threads), 0.0);
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    const size_t n = buf.size(), chunk = n / size_t(threads);
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const float* p = buf.data() + size_t(t) * chunk;
        float s[16] = {};
        for (size_t i = 0; i + 16 <= chunk; i += 16)
          for (int j = 0; j < 16; ++j) s[j] += p[i + size_t(j)];
        double tot = 0;
        for (float v : s) tot += v;
        part[size_t(t)] = tot;
      });
    for (auto& t : ts) t.join();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (part[0] == 12345.678) std::puts("");  // keep the sums alive
  }
  return double(buf.size()) * 4 / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 11) {
    std::fprintf(stderr,
                 "usage: %s M N K GROUP BITS THREADS ROUNDS CALLS LIB_A LIB_B [LIB ...]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atol(argv[1]), N = std::atol(argv[2]), K = std::atol(argv[3]);
  const int64_t gs = std::atol(argv[4]);
  const int bits = std::atoi(argv[5]), threads = std::atoi(argv[6]);
  const int rounds = std::atoi(argv[7]), calls = std::atoi(argv[8]);
  setenv("PORTABLE_GEMM_NUM_THREADS", std::to_string(threads).c_str(), 1);
  std::vector<Build> builds;
  for (int i = 9; i < argc; ++i) builds.push_back(open_build(argv[i]));

  const int64_t row = bits == 4 ? K / 2 : K, wbytes = N * row;
  // PGX_ROT_MB: the rotation in MiB (192 unless set; twice the last-level cache on hosts
  // whose L3 is larger than 96 MiB).
  const char* rot_env = std::getenv("PGX_ROT_MB");
  const int64_t rot_mb = rot_env ? std::atol(rot_env) : 192;
  const int copies = int(std::max<int64_t>(1, (rot_mb << 20) / wbytes));
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  // Each copy starts PGX_WOFF bytes (0 unless set) past a 64-byte boundary, as torch's
  // allocations do at 0; std::vector alone gave 16 past one (bench/CPU_NOTES.md 60).
  const char* woff_env = std::getenv("PGX_WOFF");
  const size_t woff = woff_env ? size_t(std::atol(woff_env)) % 64 : 0;
  std::vector<std::vector<uint8_t>> wstore(static_cast<size_t>(copies),
                                           std::vector<uint8_t>(static_cast<size_t>(wbytes) + 128));
  std::vector<uint8_t*> w;
  for (auto& c : wstore) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(c.data());
    w.push_back(reinterpret_cast<uint8_t*>((p + 63) / 64 * 64 + woff));
    for (int64_t i = 0; i < wbytes; ++i) w.back()[i] = uint8_t(byte(rng));
  }
  const int64_t ng = gs ? K / gs : 1;
  std::vector<uint16_t> s(size_t(N * ng)), x(size_t(M * K));
  for (auto& v : s) v = to_bf16((byte(rng) + 1) / 2e4f);
  for (auto& v : x) v = to_bf16((byte(rng) - 127.5f) / 64.f);
  std::vector<std::vector<uint16_t>> y(builds.size(), std::vector<uint16_t>(size_t(M * N)));
  std::vector<float> probe_buf(size_t(256) << 20, 1.0f);  // 1 GiB

  auto call = [&](size_t b, int c) {
    const MixedLinearArgs a = mixed_args(x.data(), M, K, w[size_t(c)], N, row, bits, gs, s.data(),
                                         y[b].data());
    const Status st = builds[b].mixed_linear(a, *builds[b].exec);
    if (!st.ok()) {
      std::fprintf(stderr, "%s: mixed_linear: %s\n", builds[b].path.c_str(), st.message);
      std::exit(1);
    }
  };
  // The builds must agree (they may sum in another order: within a bf16 rounding or two).
  for (size_t b = 0; b < builds.size(); ++b) call(b, 0);
  for (size_t b = 1; b < builds.size(); ++b) {
    double err = 0, big = 0;
    for (size_t i = 0; i < y[0].size(); ++i) {
      err = std::max(err, double(std::fabs(from_bf16(y[b][i]) - from_bf16(y[0][i]))));
      big = std::max(big, double(std::fabs(from_bf16(y[0][i]))));
    }
    std::printf("build %zu against build 0: max difference %.3g of max |y| %.3g\n", b, err, big);
    // PGX_TIMING_ONLY=1: a build that skips work on purpose (timing only) is timed anyway.
    if (err > big / 64 && !std::getenv("PGX_TIMING_ONLY")) {
      std::fprintf(stderr, "the builds disagree (PGX_TIMING_ONLY=1 times them anyway)\n");
      return 1;
    }
  }
  std::printf("M=%ld N=%ld K=%ld group=%ld bits=%d threads=%d, weights %.1f MB rotated over %d copies\n",
              long(M), long(N), long(K), long(gs), bits, threads, wbytes / 1e6, copies);
  std::vector<std::vector<double>> rel(builds.size());
  std::vector<std::vector<double>> med_ms(builds.size());
  std::vector<int> won(builds.size(), 0);
  std::vector<double> probes;
  int c = 0;
  for (int r = 0; r < rounds; ++r) {
    const double bw = read_probe(probe_buf, threads);
    probes.push_back(bw);
    std::vector<double> med(builds.size());
    // Alternate the order per round so neither build always follows the read probe.
    for (size_t i = 0; i < builds.size(); ++i) {
      const size_t b = (r % 2 == 0) ? i : builds.size() - 1 - i;
      call(b, c++ % copies);  // wakes this build's pool
      std::vector<double> t;
      for (int j = 0; j < calls; ++j) {
        const auto t0 = Clock::now();
        call(b, c++ % copies);
        t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      med[b] = median(t);
    }
    std::printf("round %2d: read %5.1f GB/s |", r, bw);
    for (size_t b = 0; b < builds.size(); ++b) {
      med_ms[b].push_back(med[b] * 1e3);
      rel[b].push_back(med[b] / med[0]);
      std::printf(" %c %.3f ms %5.1f GB/s (%3.0f%%)", char('A' + b), med[b] * 1e3, wbytes / med[b] / 1e9,
                  100 * wbytes / med[b] / 1e9 / bw);
    }
    const size_t best = size_t(std::min_element(med.begin(), med.end()) - med.begin());
    ++won[best];
    std::printf("\n");
  }
  std::printf("read probe: median %.1f GB/s (%.1f-%.1f)\n", median(probes),
              *std::min_element(probes.begin(), probes.end()), *std::max_element(probes.begin(), probes.end()));
  // The VM's slow phases can take half the rounds (2x the time for every build): the
  // fastest round of each build is printed too, and its ratio to A's fastest.
  const double best_a = *std::min_element(med_ms[0].begin(), med_ms[0].end());
  for (size_t b = 0; b < builds.size(); ++b) {
    const double best = *std::min_element(med_ms[b].begin(), med_ms[b].end());
    std::printf("%c %s: median %.3f ms, %.1f GB/s; time / A's: median %.3f (%.3f-%.3f), fastest in %d of %d rounds; "
                "fastest round %.3f ms (%.3f of A's)\n",
                char('A' + b), builds[b].path.c_str(), median(med_ms[b]), wbytes / median(med_ms[b]) / 1e6,
                median(rel[b]), *std::min_element(rel[b].begin(), rel[b].end()),
                *std::max_element(rel[b].begin(), rel[b].end()), won[b], rounds, best, best / best_a);
  }
}
