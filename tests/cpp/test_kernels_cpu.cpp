// Standalone test of the torch-free CPU kernels (no torch, no test framework).
//
//   g++ -O2 -std=c++17 -Iinclude tests/cpp/test_kernels_cpu.cpp -Lbuild/lib
//     -lportable_gemm_kernels -Wl,-rpath,build/lib -lpthread -o /tmp/test_kernels_cpu
//   /tmp/test_kernels_cpu      # exit status 0 = pass
//
// References are computed in double from the same (rounded) inputs. Run it with
// PORTABLE_GEMM_ISA=generic / avx2 as well to cover the fallback kernels.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "portable_gemm/kernels.h"

using namespace portable_gemm;

namespace {

int g_failures = 0;
#define CHECK(cond, ...)                                \
  do {                                                  \
    if (!(cond)) {                                      \
      ++g_failures;                                     \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);  \
      std::printf(__VA_ARGS__);                         \
      std::printf("\n");                                \
    }                                                   \
  } while (0)

std::mt19937 rng(1234);
float randn() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs only)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A dense buffer of f32 or bf16 holding a logical rows x cols matrix with given strides,
// every element NaN to begin with. `pad` extra elements follow each row (each column when
// transposed): storage a kernel must not touch (padding_touched() counts the ones it did).
constexpr uint16_t kNanBf16 = 0x7fc0;
struct Buf {
  DType t;
  std::vector<float> f;
  std::vector<uint16_t> h;
  int64_t rows, cols, rs, cs;
  Buf(DType t_, int64_t r, int64_t c, bool transposed, int64_t pad = 0)
      : t(t_), rows(r), cols(c) {
    rs = transposed ? 1 : c + pad;
    cs = transposed ? r + pad : 1;
    const size_t n = size_t(std::max<int64_t>(1, transposed ? (r + pad) * c : r * (c + pad)));
    if (t == DType::f32) f.assign(n, NAN); else h.assign(n, kNanBf16);
  }
  void* ptr() {
    return t == DType::f32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data());
  }
  float get(int64_t r, int64_t c) const {
    const int64_t i = r * rs + c * cs;
    return t == DType::f32 ? f[i] : from_bf16(h[i]);
  }
  void set(int64_t r, int64_t c, float v) {
    const int64_t i = r * rs + c * cs;
    if (t == DType::f32) f[i] = v; else h[i] = to_bf16(v);
  }
  void fill_random() {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) set(r, c, randn());
  }
  ConstMatrix cview() { return ConstMatrix{ptr(), rows, cols, rs, cs, t}; }
  Matrix view() { return Matrix{ptr(), rows, cols, rs, cs, t}; }
  // The storage elements outside the logical matrix (the padding, or the lone element of an
  // empty buffer) that no longer hold the NaN they were filled with, bit for bit.
  int64_t padding_touched() const {
    const size_t n = t == DType::f32 ? f.size() : h.size();
    std::vector<char> logical(n, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) logical[size_t(r * rs + c * cs)] = 1;
    const float nan_f = NAN;
    uint32_t nan_bits;
    std::memcpy(&nan_bits, &nan_f, 4);
    int64_t touched = 0;
    for (size_t i = 0; i < n; ++i) {
      if (logical[i]) continue;
      if (t == DType::f32) {
        uint32_t u;
        std::memcpy(&u, &f[i], 4);
        touched += u != nan_bits;
      } else {
        touched += h[i] != kNanBf16;
      }
    }
    return touched;
  }
};

double act_ref(double x, Activation a) {
  switch (a) {
    case Activation::relu: return x > 0 ? x : 0;
    case Activation::silu: return x / (1 + std::exp(-x));
    case Activation::gelu: return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    default: return x;
  }
}

// What a correct kernel may miss an element by: twice its output rounding (half an ulp of
// t at |ref|), fp32 accumulation over K terms of total size mag (twice K * 2^-24 * mag), with
// rounded_inputs one rounding of each product's operand to t (2^-8 / 2^-11 of mag for
// bf16 / f16), and with an activation its fp32 evaluation (erf, exp: 16 fp32 ulps). A kernel
// accumulating in bf16 or dropping a k step is off by far more.
double error_bound(DType t, double ref, double mag, int64_t K, int rounded_inputs, bool act) {
  const double u = t == DType::f32 ? 0x1p-24 : t == DType::f16 ? 0x1p-11 : 0x1p-8;
  return 2 * u * std::fabs(ref) + 2.0 * double(K) * 0x1p-24 * mag + rounded_inputs * 2 * u * mag +
         (act ? 16 * 0x1p-24 * (std::fabs(ref) + mag) : 0.0) + 1e-30;
}

void test_gemm(int64_t M, int64_t N, int64_t K, DType t, bool ta, bool tb, bool tc, bool bias,
               Activation act) {
  Buf a(t, M, K, ta, 3), b(t, K, N, tb, 5), c(t, M, N, tc, 1), bi(t, 1, N, false);
  a.fill_random();
  b.fill_random();
  bi.fill_random();
  GemmArgs g;
  g.a = a.cview();
  g.b = b.cview();
  g.c = c.view();
  g.bias = bias ? bi.ptr() : nullptr;
  g.activation = act;
  const Status s = cpu::gemm(g, builtin_executor());
  CHECK(s.ok(), "gemm %lldx%lldx%lld: %s", (long long)M, (long long)N, (long long)K, s.message);
  double worst = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        acc += double(a.get(i, k)) * b.get(k, j);
        mag += std::fabs(double(a.get(i, k)) * b.get(k, j));
      }
      if (bias) {
        acc += bi.get(0, j);
        mag += std::fabs(double(bi.get(0, j)));
      }
      const double ref = act_ref(acc, act);
      const double got = c.get(i, j);
      // inputs exact in their dtype: the output's rounding plus fp32 accumulation
      const double err = std::isnan(got) ? 1e9 : std::fabs(got - ref) / error_bound(t, ref, mag, K, 0, act != Activation::none);
      worst = std::max(worst, err);
    }
  CHECK(worst <= 1.0, "gemm %lldx%lldx%lld dtype %d ta %d tb %d tc %d bias %d act %d: error %g of its bound",
        (long long)M, (long long)N, (long long)K, int(t), ta, tb, tc, bias, int(act), worst);
  const int64_t touched = c.padding_touched();
  CHECK(touched == 0, "gemm %lldx%lldx%lld dtype %d ta %d tb %d tc %d bias %d act %d: %lld padding "
        "elements of c written", (long long)M, (long long)N, (long long)K, int(t), ta, tb, tc, bias,
        int(act), (long long)touched);
}

void test_mixed(int64_t M, int64_t N, int64_t K, int bits, int64_t gs, DType t) {
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  std::vector<uint8_t> q(size_t(std::max<int64_t>(1, N * (row_bytes + 3))));
  for (auto& v : q) v = uint8_t(rng());
  const int64_t groups = gs ? K / gs : 1;
  std::vector<float> sc(size_t(std::max<int64_t>(1, N * groups)));
  for (auto& v : sc) v = 0.001f + 0.01f * std::fabs(randn());
  Buf x(t, M, K, false, 2), y(t, M, N, false, 3);
  x.fill_random();
  MixedLinearArgs m;
  m.x = x.cview();
  m.w.data = q.data();
  m.w.n = N;
  m.w.k = K;
  m.w.row_stride = row_bytes + 3;
  m.w.bits = bits;
  m.w.group_size = gs;
  m.w.scales = sc.data();
  m.w.scales_row_stride = gs ? groups : 1;
  m.y = y.view();
  const Status s = cpu::mixed_linear(m, builtin_executor());
  CHECK(s.ok(), "mixed_linear: %s", s.message);
  double worst = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        int v;
        const uint8_t* row = q.data() + n * (row_bytes + 3);
        if (bits == 8) {
          v = int8_t(row[k]);
        } else {
          const int nib = (row[k / 2] >> (4 * (k & 1))) & 0xF;
          v = nib >= 8 ? nib - 16 : nib;
        }
        const double w = double(v) * sc[size_t(n * (gs ? groups : 1) + (gs ? k / gs : 0))];
        acc += w * x.get(i, k);
        mag += std::fabs(w * x.get(i, k));
      }
      const double got = y.get(i, n);  // NaN: never written (std::max would drop it)
      // the weights may be rounded to x's dtype once (q times its scale) before the products
      const double err = std::isnan(got) ? 1e9 : std::fabs(got - acc) / error_bound(t, acc, mag, K, 1, false);
      worst = std::max(worst, err);
    }
  CHECK(worst <= 1.0,
        "mixed_linear M %lld N %lld K %lld bits %d gs %lld: error %g of its bound", (long long)M,
        (long long)N, (long long)K, bits, (long long)gs, worst);
  const int64_t touched = y.padding_touched();
  CHECK(touched == 0, "mixed_linear M %lld N %lld K %lld bits %d gs %lld: %lld padding elements of y "
        "written", (long long)M, (long long)N, (long long)K, bits, (long long)gs, (long long)touched);
}

void test_quantize_roundtrip(int bits, int64_t gs) {
  const int64_t N = 9, K = 256;
  std::vector<float> w(size_t(N * K));
  for (auto& v : w) v = randn();
  for (int64_t k = 0; k < K; ++k) w[size_t(k)] = 0.f;  // an all-zero row
  const int64_t groups = gs ? K / gs : 1;
  std::vector<uint8_t> q(size_t(N * K)), q2(size_t(N * K));
  std::vector<float> sc(size_t(N * groups)), sc2(size_t(N * groups));
  QuantizeArgs a;
  a.w = ConstMatrix{w.data(), N, K, K, 1, DType::f32};
  a.bits = bits;
  a.group_size = gs;
  a.qweight = q.data();
  a.scales = sc.data();
  Status s = cpu::quantize(a, builtin_executor());
  CHECK(s.ok(), "quantize: %s", s.message);
  CHECK(sc[0] == 0.f, "zero group must get scale 0");
  // dequantise and quantise again: must reproduce q exactly
  std::vector<float> deq(size_t(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      int v;
      if (bits == 8) {
        v = int8_t(q[size_t(n * K + k)]);
      } else {
        const int nib = (q[size_t(n * (K / 2) + k / 2)] >> (4 * (k & 1))) & 0xF;
        v = nib >= 8 ? nib - 16 : nib;
      }
      deq[size_t(n * K + k)] = float(v) * sc[size_t(n * groups + (gs ? k / gs : 0))];
    }
  a.w.data = deq.data();
  a.qweight = q2.data();
  a.scales = sc2.data();
  s = cpu::quantize(a, builtin_executor());
  CHECK(s.ok() && q == q2, "quantize(dequant(q)) != q (bits %d, group %lld)", bits, (long long)gs);
}

void test_validation() {
  float buf[64] = {};
  GemmArgs g;
  g.a = ConstMatrix{buf, 2, 3, 3, 1, DType::f32};
  g.b = ConstMatrix{buf, 4, 2, 2, 1, DType::f32};
  g.c = Matrix{buf, 2, 2, 2, 1, DType::f32};
  Status s = validate_gemm(g);
  CHECK(!s.ok() && std::strstr(s.message, "K"), "K mismatch not reported");
  g.b.rows = 3;
  CHECK(validate_gemm(g).ok(), "valid gemm rejected");
  g.c.dtype = DType::bf16;
  s = validate_gemm(g);
  CHECK(!s.ok() && std::strstr(s.message, "dtype of c"), "dtype mismatch not reported");
  MixedLinearArgs m;
  m.x = ConstMatrix{buf, 1, 6, 6, 1, DType::f32};
  m.y = Matrix{buf, 1, 2, 2, 1, DType::f32};
  m.w = QuantizedWeight{buf, 2, 6, 6, 8, 4, buf, 1, DType::f32};
  s = validate_mixed_linear(m);
  CHECK(!s.ok() && std::strstr(s.message, "group_size"), "group_size not dividing K accepted");
  m.w.group_size = 0;
  m.w.bits = 3;
  s = validate_mixed_linear(m);
  CHECK(!s.ok() && std::strstr(s.message, "bits"), "bits = 3 accepted");
  // Empty problems are valid and write nothing.
  g = GemmArgs{};
  g.a = ConstMatrix{nullptr, 0, 5, 5, 1, DType::f32};
  g.b = ConstMatrix{nullptr, 5, 0, 0, 1, DType::f32};
  g.c = Matrix{nullptr, 0, 0, 0, 1, DType::f32};
  CHECK(cpu::gemm(g, builtin_executor()).ok(), "empty gemm rejected");
  CHECK(!cuda::gemm(g, nullptr).ok() || has_cuda(), "cuda stub must fail without CUDA");
}

// Arguments of a weight-only linear for the CUDA routing rules below (host-side choices
// that need no GPU): every pointer is one 256-byte aligned buffer, never dereferenced, only
// checked for alignment; contiguous x, weight rows, scales (bf16) and y.
MixedLinearArgs routing_args(int64_t m, int64_t k, int64_t n, int bits, int64_t gs, DType xt) {
  alignas(256) static unsigned char buf[64];
  MixedLinearArgs a;
  a.x = ConstMatrix{buf, m, k, k, 1, xt};
  a.w = QuantizedWeight{buf, n, k, k * bits / 8, bits, gs, buf, gs ? k / gs : 1, DType::bf16};
  a.y = Matrix{buf, m, n, n, 1, xt};
  return a;
}

// Which rows of x the CUDA small-M kernels take (cuda::mixed_linear_small_m, a host-side
// choice that needs no GPU; bench/GPU_NOTES.md runs 47, 57 and 59): every M <= 16; up to
// M = 64 where the tensor-core GEMV applies, at any weight size. Pointers are never
// dereferenced, only their alignment is read.
void test_cuda_small_m_rule() {
  if (!has_cuda()) return;  // the stub library answers false throughout
  struct Case {
    int64_t m, k, n;
    int bits;
    int64_t gs;
    DType xt;
    bool small;
  };
  const Case cases[] = {
      {16, 8192, 8192, 4, 128, DType::bf16, true},   {16, 8192, 8192, 4, 128, DType::f32, true},
      {32, 8192, 28672, 4, 128, DType::bf16, true},  {32, 8192, 8192, 4, 128, DType::f32, false},
      {48, 4096, 4096, 4, 128, DType::bf16, true},   {64, 4096, 4096, 8, 0, DType::f16, true},
      // any weight size up to M = 64 (the sm_90 GEMM's size rule is the binding's, below)
      {64, 4096, 4104, 8, 0, DType::bf16, true},     {64, 4096, 8192, 4, 128, DType::bf16, true},
      {64, 4096, 8200, 4, 128, DType::bf16, true},   {40, 11008, 4096, 4, 128, DType::bf16, true},
      {64, 8192, 28672, 8, 0, DType::bf16, true},
      {33, 2048, 2048, 8, 128, DType::bf16, true},   {65, 2048, 2048, 8, 128, DType::bf16, false},
      {48, 4160, 1024, 4, 0, DType::bf16, false},    // K not a multiple of int4's 128-k chunk
      {48, 4160, 1024, 8, 0, DType::bf16, true},     // int8's chunk is 64 k
  };
  for (const Case& c : cases)
    CHECK(cuda::mixed_linear_small_m(routing_args(c.m, c.k, c.n, c.bits, c.gs, c.xt)) == c.small,
          "mixed_linear_small_m(M %lld, K %lld, N %lld, int%d, g%lld, %s) should be %d", (long long)c.m,
          (long long)c.k, (long long)c.n, c.bits, (long long)c.gs, c.xt == DType::f32 ? "f32" : "16-bit",
          c.small);
}

void test_sm90_size_rule() {
  // Where the sm_90 GEMM outruns the small-M GEMV (kernels.h; runs 55, 57 and 79 on the
  // H200): M = 17..32 from 48 MiB of quantised weight (int4 with groups of a multiple of 128
  // never), M = 33..64 above 16 MiB, never at M <= 16 or M > 64 (the GEMV does not take
  // those rows, or takes them alone).
  constexpr int64_t MiB = int64_t(1) << 20;
  struct Case {
    int64_t rows, bytes;
    int32_t bits;
    int64_t group;
    bool gemm;
  };
  const Case cases[] = {
      {16, 1024 * MiB, 8, 0, false},       {17, 48 * MiB - 1, 8, 0, false},  {17, 48 * MiB, 8, 0, true},
      {32, 48 * MiB, 8, 128, true},        {32, 47 * MiB, 8, 0, false},      {33, 16 * MiB, 8, 0, false},
      {33, 16 * MiB + 1, 8, 0, true},      {64, 16 * MiB, 4, 128, false},    {64, 16 * MiB + 1, 4, 128, true},
      {65, 1024 * MiB, 8, 0, false},       {48, INT64_MAX, 4, 128, true},    {24, 0, 8, 0, false},
      // int4 at M = 17..32: per channel and groups of 64 by size, groups of 128k never
      {24, 48 * MiB, 4, 0, true},          {24, 48 * MiB, 4, 64, true},      {24, 47 * MiB, 4, 64, false},
      {17, 1024 * MiB, 4, 128, false},     {32, 1024 * MiB, 4, 256, false},  {32, 1024 * MiB, 4, 192, true},
      {33, 1024 * MiB, 4, 128, true},
  };
  for (const Case& c : cases)
    CHECK(cuda::sm90_gemm_outruns_gemv(c.rows, c.bytes, c.bits, c.group) == c.gemm,
          "sm90_gemm_outruns_gemv(%lld, %lld, int%d, g%lld) should be %d", (long long)c.rows, (long long)c.bytes,
          c.bits, (long long)c.group, c.gemm);
}

// The path a caller that lends scratch memory takes (cuda::mixed_linear_path: the torch
// binding's, and the DLPack door's through mixed_linear_pooled): the small-M kernels where
// they take the rows, else the sm_90 GEMM where it applies on the current device (a GPU
// with it, when this runs on one), else dequantise + dense GEMM up to a 512 MiB copy, else
// the library's own GEMM. Host-side; pointers are only checked for alignment.
void test_cuda_path_rule() {
  if (!has_cuda()) return;  // the stub library answers "kernels" throughout
  using P = cuda::MixedLinearPath;
  // Does the current device take the sm_90 GEMM (an sm_90 GPU, built with it, not disabled)?
  const bool sm90_here = cuda::mixed_linear_sm90_workspace(routing_args(100, 8192, 8192, 4, 128, DType::bf16)) >= 0;
  struct Case {
    int64_t m, k, n;
    int bits;
    int64_t gs;
    DType xt;
    P off_sm90, on_sm90;
  };
  const P K_ = P::kernels, S = P::sm90, D = P::dequantize_gemm;
  const Case cases[] = {
      {16, 8192, 8192, 4, 128, DType::bf16, K_, K_},  // the small-M kernels
      {48, 4096, 4096, 4, 128, DType::bf16, K_, K_},  // the GEMV (8 MiB: the sm_90 size rule says no)
      {48, 11008, 4096, 4, 128, DType::bf16, K_, S},  // 21.5 MiB: the size rule says yes
      {24, 28672, 8192, 4, 128, DType::bf16, K_, K_},  // 112 MiB, int4 g128 at M = 17..32: the GEMV
      {24, 28672, 8192, 4, 0, DType::bf16, K_, S},    // the same per channel: the sm_90 GEMM
      {100, 8192, 8192, 4, 128, DType::f32, K_, K_},  // f32 x: the exact SIMT GEMM
      {100, 0, 8192, 8, 0, DType::bf16, K_, K_},      // K = 0
      {100, 8192, 8192, 4, 128, DType::bf16, D, S},
      {65, 4096, 4096, 8, 0, DType::f16, D, S},
      {100, 4096, 12288, 4, 32, DType::bf16, D, D},   // g32: the sm_90 GEMM refuses it
      {100, 4096, 12300, 8, 0, DType::bf16, D, D},    // N % 8 != 0: refused too
      {100, 8192, 32768, 4, 128, DType::bf16, D, S},  // a 512 MiB copy exactly
      {100, 8192, 32776, 4, 128, DType::bf16, K_, S},  // 8 rows more: the library's own GEMM off sm_90
      {100, 8192, 32776, 4, 32, DType::bf16, K_, K_},
  };
  for (const Case& c : cases) {
    const MixedLinearArgs a = routing_args(c.m, c.k, c.n, c.bits, c.gs, c.xt);
    int64_t bytes = -1;
    const P path = cuda::mixed_linear_path(a, &bytes);
    const P want = sm90_here ? c.on_sm90 : c.off_sm90;
    const int64_t want_bytes =
        want == S ? cuda::mixed_linear_sm90_workspace(a) : want == D ? c.n * c.k * 2 : 0;
    CHECK(path == want && bytes == want_bytes,
          "mixed_linear_path(M %lld, K %lld, N %lld, int%d, g%lld) = %d with %lld bytes, want %d with %lld "
          "(sm_90 GEMM here: %d)",
          (long long)c.m, (long long)c.k, (long long)c.n, c.bits, (long long)c.gs, (int)path, (long long)bytes,
          (int)want, (long long)want_bytes, sm90_here);
  }
}

std::atomic<int64_t> g_sum{0};
void add_range(void* nested, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) g_sum += i;
  if (nested) {  // a nested call must run inline and complete
    const Executor& ex = builtin_executor();
    ex.parallel_for(ex.self, 0, 10, 1, add_range, nullptr);
  }
}

void test_executor() {
  const Executor& ex = builtin_executor();
  g_sum = 0;
  ex.parallel_for(ex.self, 0, 1000, 7, add_range, nullptr);
  CHECK(g_sum == 999 * 1000 / 2, "parallel_for sum %lld", (long long)g_sum.load());
  g_sum = 0;
  int dummy = 0;
  ex.parallel_for(ex.self, 0, 100, 1, add_range, &dummy);
  CHECK(g_sum > 99 * 100 / 2, "nested parallel_for did not run");
  // Concurrent callers: each GEMM must still be right.
  std::vector<std::thread> th;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    th.emplace_back([&bad] {
      std::vector<float> a(64 * 64, 1.f), b(64 * 64, 2.f), c(64 * 64, 0.f);
      GemmArgs g;
      g.a = ConstMatrix{a.data(), 64, 64, 64, 1, DType::f32};
      g.b = ConstMatrix{b.data(), 64, 64, 64, 1, DType::f32};
      g.c = Matrix{c.data(), 64, 64, 64, 1, DType::f32};
      for (int it = 0; it < 50; ++it) {
        std::fill(c.begin(), c.end(), 0.f);
        cpu::gemm(g, builtin_executor());
        for (float v : c)
          if (v != 128.f) ++bad;
      }
    });
  for (auto& t : th) t.join();
  CHECK(bad == 0, "concurrent gemm produced %d wrong values", bad.load());
  // After fork() the child must get a working pool of its own.
  const pid_t pid = fork();
  if (pid == 0) {
    g_sum = 0;
    builtin_executor().parallel_for(nullptr, 0, 1000, 1, add_range, nullptr);
    _exit(g_sum == 999 * 1000 / 2 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "parallel_for in a forked child failed");
}

// The pool's size follows portable_gemm_set_pool_threads: a job at size n runs on at most n
// threads (the pool keeps the workers of the largest size asked for, the others asleep), on
// more than one where n > 1, and sums right; a forked child gets a pool of that size.
std::mutex g_ids_mu;
std::set<std::thread::id> g_ids;
void record_range(void*, int64_t b, int64_t e) {
  {
    std::lock_guard<std::mutex> lk(g_ids_mu);
    g_ids.insert(std::this_thread::get_id());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // so that every worker gets a chunk
  int64_t s = 0;
  for (int64_t i = b; i < e; ++i) s += i;
  g_sum += s;
}
void test_pool_size() {
  if (std::getenv("PORTABLE_GEMM_NUM_THREADS")) return;  // it fixes the size
  const Executor& ex = builtin_executor();
  for (int n : {3, 1, 4, 2, 3}) {
    CHECK(portable_gemm_set_pool_threads(n) == n, "pool size %d not taken", n);
    CHECK(ex.num_threads(ex.self) == n, "pool reports %d threads, asked for %d", ex.num_threads(ex.self), n);
    size_t most = 0;
    for (int rep = 0; rep < 3; ++rep) {
      g_ids.clear();
      g_sum = 0;
      ex.parallel_for(ex.self, 0, 64, 1, record_range, nullptr);
      CHECK(g_sum == 63 * 64 / 2, "sum %lld at pool size %d", (long long)g_sum.load(), n);
      CHECK(int(g_ids.size()) <= n, "%zu threads ran a job at pool size %d", g_ids.size(), n);
      most = std::max(most, g_ids.size());
    }
    CHECK(n == 1 || most >= 2, "no worker took part at pool size %d", n);
  }
  CHECK(portable_gemm_set_pool_threads(0) == 3, "size 0 changed the pool");
  const pid_t pid = fork();
  if (pid == 0) {
    g_ids.clear();
    g_sum = 0;
    builtin_executor().parallel_for(nullptr, 0, 64, 1, record_range, nullptr);
    _exit(g_sum == 63 * 64 / 2 && g_ids.size() <= 3 && builtin_executor().num_threads(nullptr) == 3 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "pool size in a forked child");
}

// portable_gemm_release_cpu_scratch frees what the threads outside a call hold and never
// what a thread inside one uses. Inputs are small integers with unit scales, so every
// result is exact and must come out bit for bit the same however a call is split.
struct ExactCall {
  std::vector<float> a, b, c, ref;              // gemm f32 256 x 64 @ 64 x 256
  std::vector<uint16_t> x, y, yref;             // mixed_linear, bf16 x
  std::vector<uint8_t> q;
  std::vector<float> scales;
  int64_t m = 0, n = 0, k = 0, group = 0;
  int bits = 8;
  bool is_gemm = true;
  ExactCall(bool gemm_call, int64_t m_, int64_t n_, int64_t k_, int bits_, int64_t group_, unsigned seed)
      : m(m_), n(n_), k(k_), group(group_), bits(bits_), is_gemm(gemm_call) {
    std::mt19937 r(seed);
    auto small = [&r] { return float(int(r() % 7) - 3); };
    if (is_gemm) {
      a.resize(m * k), b.resize(k * n), c.resize(m * n);
      for (float& v : a) v = small();
      for (float& v : b) v = small();
    } else {
      x.resize(m * k), y.resize(m * n);
      for (uint16_t& v : x) v = to_bf16(small());
      q.resize(n * (bits == 8 ? k : k / 2));
      for (uint8_t& v : q) v = uint8_t(r());
      scales.assign(group ? n * (k / group) : n, 1.f);
    }
    run();
    ref = c, yref = y;
  }
  Status run() {
    if (is_gemm) {
      std::fill(c.begin(), c.end(), std::nanf(""));
      GemmArgs g;
      g.a = ConstMatrix{a.data(), m, k, k, 1, DType::f32};
      g.b = ConstMatrix{b.data(), k, n, n, 1, DType::f32};
      g.c = Matrix{c.data(), m, n, n, 1, DType::f32};
      return cpu::gemm(g, builtin_executor());
    }
    std::fill(y.begin(), y.end(), uint16_t(0x7fc0));
    MixedLinearArgs ml;
    ml.x = ConstMatrix{x.data(), m, k, k, 1, DType::bf16};
    ml.w.data = q.data();
    ml.w.n = n, ml.w.k = k, ml.w.row_stride = bits == 8 ? k : k / 2, ml.w.bits = bits;
    ml.w.group_size = group, ml.w.scales = scales.data();
    ml.w.scales_row_stride = group ? k / group : 1, ml.w.scales_dtype = DType::f32;
    ml.y = Matrix{y.data(), m, n, n, 1, DType::bf16};
    return cpu::mixed_linear(ml, builtin_executor());
  }
  bool same() const { return is_gemm ? c == ref : y == yref; }  // NaN sentinels compare unequal
};

// An executor that runs the whole range on the calling thread, then holds it inside the
// call until g_hold is 2 (g_hold 1: inside).
std::atomic<int> g_hold{0};
void hold_parallel_for(void*, int64_t begin, int64_t end, int64_t, Executor::Body body, void* ctx) {
  body(ctx, begin, end);
  g_hold = 1;
  while (g_hold.load() != 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void test_scratch_release() {
  ExactCall first(true, 256, 256, 64, 8, 0, 1);
  ExactCall pairs(false, 64, 256, 512, 8, 0, 2);   // bf16 pair packing (M > 32)
  ExactCall small(false, 1, 512, 512, 4, 128, 3);  // the small-M path
  const size_t held = portable_gemm_cpu_scratch_bytes();
  CHECK(held >= 64 * 256 * sizeof(float), "%zu bytes of scratch after three calls", held);
  const size_t freed = portable_gemm_release_cpu_scratch();
  CHECK(freed == held, "release freed %zu of %zu bytes", freed, held);
  CHECK(portable_gemm_cpu_scratch_bytes() == 0, "%zu bytes left after a release",
        portable_gemm_cpu_scratch_bytes());
  CHECK(portable_gemm_release_cpu_scratch() == 0, "a second release freed something");
  for (ExactCall* call : {&first, &pairs, &small})
    CHECK(call->run().ok() && call->same(), "a call after a release differs from before it");

  // Releases while three threads call: each result as before, and some releases freed memory
  // in between (else this tested nothing).
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, calls{0};
  std::vector<std::thread> th;
  for (int t = 0; t < 3; ++t)
    th.emplace_back([&, t] {
      ExactCall call(t != 1, t == 2 ? 1 : 64, 256, 512, t == 2 ? 4 : 8, t == 2 ? 128 : 0, 10 + t);
      while (!stop.load()) {
        if (!call.run().ok() || !call.same()) ++bad;
        ++calls;
      }
    });
  int released = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
  while (std::chrono::steady_clock::now() < until) {
    if (portable_gemm_release_cpu_scratch() > 0) ++released;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop = true;
  for (auto& t : th) t.join();
  CHECK(bad == 0, "%d of %d calls differed while releases ran", bad.load(), calls.load());
  CHECK(released > 0 && calls > 0, "%d releases freed memory during %d calls", released, calls.load());
  portable_gemm_release_cpu_scratch();
  CHECK(portable_gemm_cpu_scratch_bytes() == 0, "%zu bytes left once every call returned",
        portable_gemm_cpu_scratch_bytes());
  // A forked child lists only its own thread: the parent's workers are gone there, and the
  // child's new workers reuse their stacks, whose thread-local blocks glibc then frees (the
  // registry once read them: ASan, test_concurrency.py's fork tests). The fork happens while
  // another thread is inside a call (held in its executor), so a child that still listed
  // that thread would keep its buffers as busy for good. The child calls, releases and
  // calls again.
  first.run();
  g_hold = 0;
  std::thread holder([] {
    ExactCall call(true, 256, 256, 64, 8, 0, 20);  // its reference run is on the pool
    Executor hold;
    hold.parallel_for = hold_parallel_for;
    hold.num_threads = [](void*) { return 2; };
    GemmArgs g;
    g.a = ConstMatrix{call.a.data(), call.m, call.k, call.k, 1, DType::f32};
    g.b = ConstMatrix{call.b.data(), call.k, call.n, call.n, 1, DType::f32};
    g.c = Matrix{call.c.data(), call.m, call.n, call.n, 1, DType::f32};
    cpu::gemm(g, hold);
  });
  while (g_hold.load() != 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  portable_gemm_release_cpu_scratch();
  CHECK(portable_gemm_cpu_scratch_bytes() > 0, "a release took the buffers of a thread inside a call");
  const pid_t pid = fork();
  if (pid != 0) {
    g_hold = 2;
    holder.join();
  } else {
    portable_gemm_release_cpu_scratch();
    bool ok = portable_gemm_cpu_scratch_bytes() == 0;
    for (int rep = 0; rep < 2 && ok; ++rep) {
      ok = first.run().ok() && first.same() && portable_gemm_cpu_scratch_bytes() > 0;
      ok = ok && portable_gemm_release_cpu_scratch() > 0 && portable_gemm_cpu_scratch_bytes() == 0;
    }
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "release in a forked child");
}

}  // namespace

int main() {
  std::printf("isa: %s, threads: %d, %s\n", cpu::isa(), builtin_executor().num_threads(nullptr),
              build_info());
  // The AVX2 dequantise-once rows (info()'s cpu_avx2_dq): a line on the AVX2 kernels, empty
  // elsewhere (its text against the core: test_kernels_cpu.py).
  CHECK((std::strcmp(cpu::isa(), "avx2") == 0) == (cpu::avx2_dq_path()[0] != '\0'),
        "avx2_dq_path() is set exactly on the AVX2 kernels");
  const Activation acts[] = {Activation::none, Activation::relu, Activation::silu,
                             Activation::gelu};
  for (DType t : {DType::f32, DType::bf16}) {
    const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {33, 65, 17}, {3, 40, 500},
                                 {50, 70, 900}, {5, 3, 0}, {16, 128, 64}};
    // 8 variants per shape: the layouts of a, b and c are the 3 bits of v, and bias and
    // activation are XORs of them chosen so that every pair of the five settings meets in
    // all its combinations (the 8 bias x activation ones included; an orthogonal array).
    for (auto& sh : shapes)
      for (int v = 0; v < 8; ++v) {
        const int b0 = v & 1, b1 = (v >> 1) & 1, b2 = (v >> 2) & 1;
        test_gemm(sh[0], sh[1], sh[2], t, b0, b1, b2, (b0 ^ b1 ^ b2) != 0,
                  acts[((b0 ^ b1) << 1) | (b0 ^ b2)]);
      }
    // Group sizes on both sides of the FMA blocks' k steps (AVX2: 16 k; AVX-512: 16 / 32 k
    // for int8 / int4; others take the row loop), M on every block of rows of x (9 and 49:
    // AVX2's dq path starts at 9 and ends at 48 where it runs, except on Zen 1 cores;
    // PORTABLE_GEMM_AVX2_DQ=1 runs it on the later Zen cores too, test_kernels_cpu.py).
    for (int bits : {8, 4})
      for (int64_t gs : {0, 32, 64, 6, 8, 16, 24, 48})
        for (int64_t M : {1, 2, 3, 5, 7, 9, 16, 40, 49}) test_mixed(M, 23, 192, bits, gs, t);
  }
  // bf16 x with K a multiple of 32: the AMX path where the CPU has it (several k blocks,
  // a partial one, channels not a multiple of 32, rows of x over several tile pairs).
  for (int bits : {8, 4})
    for (int64_t gs : {0, 32, 128})
      for (int64_t M : {1, 16, 17, 40, 70}) test_mixed(M, 100, 640, bits, gs, DType::bf16);
  // bf16 x over several K passes of the vdpbf16ps tile path (1024 k each), a partial last
  // one, and per channel a tail past the last whole block.
  for (int bits : {8, 4})
    for (int64_t gs : {0, 128})
      for (int64_t M : {3, 8, 16, 24}) test_mixed(M, 37, gs ? 2560 : 2600, bits, gs, DType::bf16);
  for (int bits : {8, 4})
    for (int64_t gs : {0, 32, 128}) test_quantize_roundtrip(bits, gs);
  test_validation();
  test_cuda_small_m_rule();
  test_sm90_size_rule();
  test_cuda_path_rule();
  test_executor();
  test_pool_size();
  test_scratch_release();
  std::printf(g_failures ? "%d FAILURES\n" : "all passed\n", g_failures);
  return g_failures ? 1 : 0;
}
