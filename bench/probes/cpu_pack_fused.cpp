// The weight-only dense path at M = 256 on AVX512-BF16 (no AMX), one thread: does packing
// the int8 B panel inside the first row block's micro-kernel calls hide the packer's time?
// bench/CPU_NOTES.md 66 measured the packer (pack_quant_pairs_avx512<8, false>) at ~6 % of
// the call on the Zen 4 VM, overlapping nothing, the 12 x 32 vdpbf16ps kernel at its peak.
//
// One B block as run_block has it on that VM (kc 1024 = 512 pairs, 1024 columns, per
// channel int8, unscaled) and 22 row blocks of 12 (264 rows), A as packed pair units:
//   kernel   the 22 x 32 kernel calls alone on a packed panel (the floor)
//   split    the library's order: the transposing packer over the panel, then the calls
//   gather   the same with a packer that gathers each 32-bit word of 16 rows (vpgatherdd)
//            instead of loading 64 bytes a row and transposing
//   fused    the first row block's calls read the weights (gathered), build the units,
//            use them and store them into the panel; the other 21 row blocks as before
//   fused2   the first row block's calls run the transposing packer a 64-k step at a
//            time, each step's 32 pairs then through the kernel while in L1
// Every variant's panel and output are checked bit for bit against split's.
//
//   g++ -O3 -std=c++17 bench/probes/cpu_pack_fused.cpp -o pack_fused && ./pack_fused [reps]
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define NOINLINE __attribute__((noinline))
#define INL __attribute__((always_inline)) inline

constexpr int MR = 12, NR = 32, KP = 512, KC = 2 * KP, NC = 1024, ROWBLOCKS = 22;
constexpr int M = MR * ROWBLOCKS;

// ---- the library's pieces (mixed_linear.cpp, common.h), int8 unscaled only -------------

BF16 inline __m512i byte_to_top(int b) {
  return _mm512_add_epi32(_mm512_set1_epi32(0x00808080 | (b << 24)),
                          _mm512_set4_epi32(12 << 24, 8 << 24, 4 << 24, 0));
}

// common.h transpose16_avx512: v[r][c] -> v[c][r].
BF16 inline void transpose16(__m512 v[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(u[c], u[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(u[c], u[c + 4], 0xDD);
    t[c + 8] = _mm512_shuffle_f32x4(u[c + 8], u[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(u[c + 8], u[c + 12], 0xDD);
  }
  for (int c = 0; c < 8; ++c) {
    v[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
    v[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xDD);
  }
}

// Units of pair j (0 or 1) of a transposed word vector t (lane r: word of row r).
BF16 inline __m512i units_i8(__m512i t, int j, __m512i top_b0, __m512i top_b1, __m512i top_b2) {
  const __m512i lo = _mm512_srai_epi32(_mm512_shuffle_epi8(t, j == 0 ? top_b0 : top_b2), 24);
  const __m512i hi =
      j == 0 ? _mm512_srai_epi32(_mm512_shuffle_epi8(t, top_b1), 24) : _mm512_srai_epi32(t, 24);
  const __m512i lof = _mm512_castps_si512(_mm512_cvtepi32_ps(lo));
  const __m512i hif = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
  return _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(lof, 16), hif);
}

// One 64-k step of the library's fused packer (16 rows, 32 pairs), transposing 64 bytes of
// each row; pack16_transposed runs it over KC, kern12_fused2 a step at a time.
BF16 INL void pack16_step(const int8_t* q, int64_t rs, int kk, uint32_t* dst, __m512i b0,
                             __m512i b1, __m512i b2) {
  __m512 v[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm512_castsi512_ps(_mm512_loadu_si512(q + r * rs + kk));
  for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(q + (16 + r) * rs + kk), _MM_HINT_T1);
  transpose16(v);
  for (int i = 0; i < 16; ++i) {
    const __m512i t = _mm512_castps_si512(v[i]);
    const int p0 = (kk + 4 * i) / 2;
    _mm512_storeu_si512(dst + (p0 + 0) * NR, units_i8(t, 0, b0, b1, b2));
    _mm512_storeu_si512(dst + (p0 + 1) * NR, units_i8(t, 1, b0, b1, b2));
  }
}

// 16 rows x KC of int8 -> KP pair units a row, at dst[p * NR + r].
BF16 NOINLINE void pack16_transposed(const int8_t* q, int64_t rs, uint32_t* dst) {
  const __m512i b0 = byte_to_top(0), b1 = byte_to_top(1), b2 = byte_to_top(2);
  for (int kk = 0; kk < KC; kk += 64) pack16_step(q, rs, kk, dst, b0, b1, b2);
}

// The same, each word of the 16 rows gathered.
BF16 NOINLINE void pack16_gather(const int8_t* q, int64_t rs, uint32_t* dst) {
  const __m512i b0 = byte_to_top(0), b1 = byte_to_top(1), b2 = byte_to_top(2);
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(int(rs)));
  for (int w = 0; w < KC / 4; ++w) {
    const __m512i t = _mm512_i32gather_epi32(idx, q + 4 * w, 1);
    _mm512_storeu_si512(dst + (2 * w + 0) * NR, units_i8(t, 0, b0, b1, b2));
    _mm512_storeu_si512(dst + (2 * w + 1) * NR, units_i8(t, 1, b0, b1, b2));
  }
}

// One pair step of the 12 x 32 block: c0 / c1 += a's 12 pair units x the step's two unit
// vectors; and the block's store (ld NC).
BF16 INL void step12(__m512* c0, __m512* c1, const int32_t* a, __m512bh b0, __m512bh b1) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    const __m512bh ai = (__m512bh)_mm512_set1_epi32(a[i]);
    c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);
    c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);
  }
}

BF16 INL void store12(const __m512* c0, const __m512* c1, float* out) {
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(out + i * NC, c0[i]);
    _mm512_storeu_ps(out + i * NC + 16, c1[i]);
  }
}

// The 12 x 32 kernel (gemm.cpp kern_avx512_bf16<12>), C stored to out (ld NC).
BF16 NOINLINE void kern12(const int32_t* a, const uint32_t* b, float* out) {
  __m512 c0[MR], c1[MR];
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int p = 0; p < KP; ++p) {
    step12(c0, c1, a + p * MR, (__m512bh)_mm512_loadu_si512(b), (__m512bh)_mm512_loadu_si512(b + 16));
    b += NR;
  }
  store12(c0, c1, out);
}

// The first row block's call: per word (two pairs) gather the 32 rows' words (two
// gathers), build the four unit vectors, store them into the sliver and use them.
BF16 NOINLINE void kern12_fused(const int32_t* a, const int8_t* q, int64_t rs, uint32_t* b,
                                float* out) {
  const __m512i t0 = byte_to_top(0), t1 = byte_to_top(1), t2 = byte_to_top(2);
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(int(rs)));
  const int8_t* q1 = q + 16 * rs;
  __m512 c0[MR], c1[MR];
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int w = 0; w < KC / 4; ++w) {
    const __m512i g0 = _mm512_i32gather_epi32(idx, q + 4 * w, 1);
    const __m512i g1 = _mm512_i32gather_epi32(idx, q1 + 4 * w, 1);
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const __m512i u0 = units_i8(g0, j, t0, t1, t2), u1 = units_i8(g1, j, t0, t1, t2);
      _mm512_storeu_si512(b, u0);
      _mm512_storeu_si512(b + 16, u1);
      step12(c0, c1, a + (2 * w + j) * MR, (__m512bh)u0, (__m512bh)u1);
      b += NR;
    }
  }
  store12(c0, c1, out);
}

// The first row block's call, the transposing packer interleaved a 64-k step at a time:
// pack the step's 32 pairs of both halves into the sliver (hot in L1), then the kernel's 32
// pairs over them. The accumulators go through memory around each packing step.
BF16 NOINLINE void kern12_fused2(const int32_t* a, const int8_t* q, int64_t rs, uint32_t* b,
                                 float* out) {
  const __m512i t0 = byte_to_top(0), t1 = byte_to_top(1), t2 = byte_to_top(2);
  __m512 c0[MR], c1[MR];
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int kk = 0; kk < KC; kk += 64) {
    pack16_step(q, rs, kk, b, t0, t1, t2);
    pack16_step(q + 16 * rs, rs, kk, b + 16, t0, t1, t2);
    const uint32_t* bs = b + kk / 2 * NR;
    for (int p = kk / 2; p < kk / 2 + 32; ++p) {
      step12(c0, c1, a + p * MR, (__m512bh)_mm512_loadu_si512(bs), (__m512bh)_mm512_loadu_si512(bs + 16));
      bs += NR;
    }
  }
  store12(c0, c1, out);
}

// ---- the block ---------------------------------------------------------------------------

struct Data {
  std::vector<int8_t> q;         // NC rows of K = KC bytes (row stride rs)
  int64_t rs;
  std::vector<int32_t> a;        // ROWBLOCKS slivers of KP x MR pair units
  uint32_t* panel;               // KP x NC units, sliver s at s * KP * NR
  std::vector<float> c;          // M x NC
};

void run_kernels(Data& d, int first_block) {
  for (int ib = first_block; ib < ROWBLOCKS; ++ib)
    for (int s = 0; s < NC / NR; ++s)
      kern12(d.a.data() + ib * KP * MR, d.panel + s * KP * NR, d.c.data() + ib * MR * NC + s * NR);
}

void split(Data& d, bool gather) {
  for (int s = 0; s < NC / NR; ++s)
    for (int h = 0; h < 2; ++h) {
      const int8_t* q = d.q.data() + (s * NR + 16 * h) * d.rs;
      uint32_t* dst = d.panel + s * KP * NR + 16 * h;
      gather ? pack16_gather(q, d.rs, dst) : pack16_transposed(q, d.rs, dst);
    }
  run_kernels(d, 0);
}

void fused(Data& d, bool gather) {
  for (int s = 0; s < NC / NR; ++s)
    (gather ? kern12_fused : kern12_fused2)(d.a.data(), d.q.data() + s * NR * d.rs, d.rs, d.panel + s * KP * NR, d.c.data() + s * NR);
  run_kernels(d, 1);
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 41;
  Data d;
  d.rs = 4096;  // K = 4096: the block is k 0..1023 of each row
  d.q.resize(size_t(NC) * d.rs);
  std::mt19937 rng(7);
  for (auto& v : d.q) v = int8_t(int(rng() % 255) - 127);
  d.a.resize(size_t(ROWBLOCKS) * KP * MR);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& v : d.a) {
    float f1 = u(rng), f2 = u(rng);
    uint32_t b1, b2;
    std::memcpy(&b1, &f1, 4);
    std::memcpy(&b2, &f2, 4);
    v = int32_t((b1 >> 16) | (b2 & 0xFFFF0000u));
  }
  d.panel = static_cast<uint32_t*>(std::aligned_alloc(64, size_t(KP) * NC * 4));
  d.c.assign(size_t(M) * NC, 0.f);

  // reference: split with the transposing packer
  split(d, false);
  const std::vector<uint32_t> ref_panel(d.panel, d.panel + size_t(KP) * NC);
  const std::vector<float> ref_c = d.c;
  const char* names[] = {"kernel", "split", "gather", "fused", "fused2"};
  constexpr int NV = 5;
  auto run = [&](int v) {
    if (v == 0) run_kernels(d, 0);
    else if (v == 1) split(d, false);
    else if (v == 2) split(d, true);
    else fused(d, v == 3);
  };
  for (int v = 1; v < NV; ++v) {
    std::memset(d.panel, 0xA5, size_t(KP) * NC * 4);
    std::fill(d.c.begin(), d.c.end(), -7.f);
    run(v);
    const bool ok = std::memcmp(d.panel, ref_panel.data(), ref_panel.size() * 4) == 0 &&
                    std::memcmp(d.c.data(), ref_c.data(), ref_c.size() * 4) == 0;
    std::printf("%-7s panel and output %s\n", names[v], ok ? "bit-equal to split's" : "DIFFER");
    if (!ok) return 1;
  }
  std::vector<double> t[NV];
  for (int r = 0; r < reps; ++r)
    for (int v0 = 0; v0 < NV; ++v0) {
      const int v = (v0 + r) % NV;  // rotate the order every round
      const uint64_t t0 = __rdtsc();
      run(v);
      t[v].push_back(double(__rdtsc() - t0));
    }
  std::printf("%d rounds; TSC Mticks per block (median, min); time against split (median)\n", reps);
  std::sort(t[1].begin(), t[1].end());
  const double ref = t[1][t[1].size() / 2];
  for (int v = 0; v < NV; ++v) {
    std::sort(t[v].begin(), t[v].end());
    const double med = t[v][t[v].size() / 2];
    std::printf("%-7s %7.3f %7.3f  %.3f\n", names[v], med / 1e6, t[v][0] / 1e6, med / ref);
  }
  return 0;
}
