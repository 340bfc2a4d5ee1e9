// The AMX bf16 tile kernel alone (kern_amx<2> of src/kernels/cpu/gemm.cpp: 32 x 32 of C in
// tiles 0-3, per 32 k one A tile of each 16 rows and two B tiles), on one core, against where
// its operands live. A is NA slivers of 32 rows x KC k packed as tiles, B is NB slivers of
// KC k x 32 columns packed as pair rows of 128 bytes (the library's layouts); every call
// multiplies one A sliver by one B sliver. LOOP 0 takes the B slivers innermost (the
// library's order: one A sliver stays in L1, B streams), LOOP 1 the A slivers, LOOP 2 the
// products alone (kern_no_loads: the tile unit's rate). PF > 0 adds prefetcht0 of the B rows
// PF steps of 32 k ahead (32 lines a step); PF -1 prefetches the next A sliver into L2 in NB
// parts, one before each call; PF -2 loads and stores C's partial sums in every call; PF -3
// prefetches the next A sliver spread through the calls' k loops, as kern_amx_next does.
// Prints TFLOP/s of the fastest of 7 repetitions of >= 20000 calls, and ns per tdpbf16ps.
// bench/CPU_NOTES.md 49; 63 aligned the operands to 64 bytes (49's figures for operands from
// L2 had every tile row across two lines) and added LOOP 2 and PF -1 / -2.
//
//   g++ -O2 -std=c++17 bench/probes/cpu_amx_tile_probe.cpp -o amx_tile_probe
//   ./amx_tile_probe KC NA NB [LOOP [PF]]
//   e.g. ./amx_tile_probe 64 1 1        (everything in L1: the kernel's own rate)
//        ./amx_tile_probe 512 1 32      (the library's K > 1024 blocks: B from L2)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

namespace {

template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned64&) const { return true; }
  bool operator!=(const Aligned64&) const { return false; }
};

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// As in the library: ldtilecfg by inline assembly (GCC 12's _tile_loadconfig may drop the
// configuration's stores once inlined).
__attribute__((target("amx-tile"))) bool tiles_on() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return false;
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
  return true;
}

// One call: C from zero, or (c_in) loaded from partial sums; stored to out (ldc floats a row).
// pf > 0: prefetcht0 of the B rows pf steps of 32 k ahead; lines > 0: `lines` prefetcht1 a
// step of `next` (PF -3).
__attribute__((target("amx-tile,amx-bf16,sse"))) void kern(int64_t kp, const char* a, const char* b,
                                                           float* out, int64_t ldc, bool c_in, int pf,
                                                           const char* next, int lines) {
  constexpr int64_t kRow = 128;  // bytes of a B pair row (32 columns)
  if (c_in) {
    _tile_loadd(0, out, ldc * 4);
    _tile_loadd(1, out + 16, ldc * 4);
    _tile_loadd(2, out + 16 * ldc, ldc * 4);
    _tile_loadd(3, out + 16 * ldc + 16, ldc * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < kp; p += 16) {
    for (int l = 0; l < lines; ++l) _mm_prefetch(next + (p / 16 * lines + l) * 64, _MM_HINT_T1);
    _tile_loadd(4, a + 128 * p, 64);
    _tile_loadd(6, b + p * kRow, kRow);
    _tile_loadd(7, b + p * kRow + 64, kRow);
    if (pf > 0)
      for (int l = 0; l < 32; ++l) _mm_prefetch(b + (p + 16 * pf) * kRow + 64 * l, _MM_HINT_T0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 128 * p + 1024, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, ldc * 4);
  _tile_stored(1, out + 16, ldc * 4);
  _tile_stored(2, out + 16 * ldc, ldc * 4);
  _tile_stored(3, out + 16 * ldc + 16, ldc * 4);
}

// The unit's own rate: the same four products per 32 k on tiles loaded once, no loads in the
// loop (LOOP 2). On the 2-core Xeon VM: 6.0 ns a tdpbf16ps, against 7.3-7.5 for the kernel
// with its loads from L1 (bench/CPU_NOTES.md 63).
__attribute__((target("amx-tile,amx-bf16"))) void kern_no_loads(int64_t kp, const char* a, const char* b,
                                                                float* out) {
  constexpr int64_t kRow = 128;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 1024, 64);
  _tile_loadd(6, b, kRow);
  _tile_loadd(7, b + 64, kRow);
  for (int64_t p = 0; p < kp; p += 16) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 128);
  _tile_stored(1, out + 16, 128);
  _tile_stored(2, out + 512, 128);
  _tile_stored(3, out + 528, 128);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s KC NA NB [LOOP [PF]]\n", argv[0]);
    return 2;
  }
  const int64_t kc = std::atol(argv[1]), na = std::atol(argv[2]), nb = std::atol(argv[3]);
  const int loop = argc > 4 ? std::atoi(argv[4]) : 0, pf = argc > 5 ? std::atoi(argv[5]) : 0;
  if (kc <= 0 || kc % 32 != 0 || na <= 0 || nb <= 0 || pf < -3) {
    std::fprintf(stderr, "KC must be a positive multiple of 32, NA and NB positive\n");
    return 2;
  }
  if (!tiles_on()) {
    std::fprintf(stderr, "no AMX tile state on this CPU / kernel\n");
    return 1;
  }
  const int64_t sliver = 32 * kc * 2;  // bytes of an A or B sliver
  // Random bf16 in [1, 2): no zeros, no denormals. Padding past the last B sliver for PF.
  // 64-byte aligned, as the library's packed panels are: std::vector's 16-byte alignment put
  // every 64-byte tile row across two lines (1.05 against 1.36 TFLOP/s at KC 2048, NB 8).
  std::vector<uint16_t, Aligned64<uint16_t>> a(size_t(na * sliver / 2)),
      b(size_t(nb * sliver / 2 + 64 * 64 * (std::max(pf, 0) + 1)));
  std::mt19937 rng(1);
  for (auto& v : a) v = uint16_t(0x3f80 | (rng() & 0x7f));
  for (auto& v : b) v = uint16_t(0x3f80 | (rng() & 0x7f));
  alignas(64) static float out[32 * 32];
  std::vector<float, Aligned64<float>> ws(size_t(8 * 32 * (nb * 32 + 16)), 0.f);  // PF -2
  const char* a0 = reinterpret_cast<const char*>(a.data());
  const char* b0 = reinterpret_cast<const char*>(b.data());
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    int64_t calls = 0;
    while (calls < 20000) {
      for (int64_t i = 0; i < (loop ? nb : na); ++i)
        for (int64_t j = 0; j < (loop ? na : nb); ++j, ++calls) {
          const int64_t ia = loop ? j : i, ib = loop ? i : j;
          if (pf == -1 && loop == 0) {  // 1/NB of the next A sliver into L2 before each call
            const char* next = a0 + ((ia + 1) % na) * sliver;
            const int64_t part = sliver / nb;
            for (int64_t o = ib * part; o < (ib + 1) * part; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
          }
          if (pf == -3) {  // the next A sliver, 1/NB of it per call, spread through the call
            const int64_t part = sliver / nb;
            const int lines = int((part / 64 + kc / 32 - 1) / (kc / 32));  // per step of 32 k
            kern(kc / 2, a0 + ia * sliver, b0 + ib * sliver, out, 32, false, 0,
                 a0 + ((ia + 1) % na) * sliver + ib * part, lines);
            continue;
          }
          if (pf == -2) {  // partial sums of 8 A slivers (256 rows) x NB slivers, padded rows
            const int64_t ldc = nb * 32 + 16;
            kern(kc / 2, a0 + ia * sliver, b0 + ib * sliver, ws.data() + (ia % 8) * 32 * ldc + ib * 32, ldc,
                 true, 0, nullptr, 0);
            continue;
          }
          if (loop == 2) kern_no_loads(kc / 2, a0 + ia * sliver, b0 + ib * sliver, out);
          else kern(kc / 2, a0 + ia * sliver, b0 + ib * sliver, out, 32, false, pf < 0 ? 0 : pf, nullptr, 0);
        }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s / double(calls) < best) best = s / double(calls);
  }
  std::printf("KC %ld NA %ld NB %ld LOOP %d PF %d: %.3f TFLOP/s on one core, %.1f ns a tdpbf16ps (out %g)\n",
              long(kc), long(na), long(nb), loop, pf, 2.0 * 32 * 32 * double(kc) / best / 1e12,
              best / double(kc / 32 * 4) * 1e9, double(out[0]));
  return 0;
}
