// Dense GEMM on the CPU: c = act(a @ b + bias).
//
// Goto/BLIS structure. Per task (a block of rows x columns of C):
//   jc: columns in blocks of nc          B panel (kc x nc, packed fp32) stays in L2
//    mo: rows in chunks of mch           bounds the fp32 accumulation workspace
//     pc: K in blocks of kc              packing converts f16/bf16 to fp32 once
//      ir: rows in slivers of MR         A sliver (kc x MR) stays in L1
//       jr: columns in slivers of NR     B slivers stream from L2 into the micro-kernel
// The micro-kernel keeps an MR x NR block of C in registers for a whole kc block. When
// K needs several kc blocks, partial sums live in a per-thread fp32 workspace; the last
// block's micro-kernel writes to a stack tile and the epilogue (bias, activation,
// rounding to the output dtype, arbitrary output strides) runs on it while it is hot.
// Rows beyond M and columns beyond N are zero-padded in the packed panels, so a
// micro-kernel only needs to know how many rows (1..MR) it computes. AVX-512's fp32 kernels
// take the column blocks inside the kc blocks instead (mo, pc, jc, ir, jr: run_block_a_once),
// so that A is packed once per row chunk rather than once per column block; AMX GEMMs of many
// rows and K up to 2048 take K as one block (run_block_kin), and above it all the task's rows
// pass each K block of 2048 (big_k_blocks).
//
// Micro-kernels (chosen once at run time, see active_isa()): AVX-512 12 x 32, AVX2+FMA
// 6 x 16, portable 4 x 8 (4 x 16 on aarch64) written for auto-vectorisation. bf16 x bf16
// on CPUs with AVX512-BF16 packs bf16 pairs instead of fp32 and uses vdpbf16ps (twice
// the FLOPs per instruction); with AMX-BF16 too, and K a multiple of 32, the same B pair
// panels feed the tile unit (kern_amx, a 32 x 32 block of C in four tiles) and A is packed
// as the tiles it loads (pack_a_tiles_bf16). With M <= 8 none of this pays off (each B
// element feeds a handful of FMAs): B is then streamed row by row instead of packed
// (stream_gemm).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/common.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#endif
#if PG_X86
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace portable_gemm {
namespace cpu {

// ---- ISA choice -------------------------------------------------------------------

namespace {

// PORTABLE_GEMM_ISA, read once: the units it leaves on, from the lowest. Unset, empty
// (`PORTABLE_GEMM_ISA= cmd`) or not one of the names: no request, the CPU's best. Before,
// each reader compared the string itself, and an empty or unknown value left the ISA as
// it was but switched AMX off.
enum class IsaRequest { none, generic, avx2, avx512, avx512_bf16, amx };
IsaRequest isa_request() {
  static const IsaRequest req = [] {
    const char* env = std::getenv("PORTABLE_GEMM_ISA");
    if (env == nullptr) return IsaRequest::none;
    static const struct { const char* name; IsaRequest req; } names[] = {
        {"generic", IsaRequest::generic}, {"avx2", IsaRequest::avx2},
        {"avx512", IsaRequest::avx512},   {"avx512_bf16", IsaRequest::avx512_bf16},
        {"amx", IsaRequest::amx}};
    for (const auto& n : names)
      if (std::strcmp(env, n.name) == 0) return n.req;
    return IsaRequest::none;
  }();
  return req;
}
// The request rules out units above it (none and amx rule out nothing).
bool isa_request_below(IsaRequest unit) {
  const IsaRequest req = isa_request();
  return req != IsaRequest::none && static_cast<int>(req) < static_cast<int>(unit);
}

Isa detect_isa() {
  Isa best = Isa::generic;
#if PG_X86
  __builtin_cpu_init();
  // F16C is not queried: every AVX2 and AVX-512 CPU has it (and GCC 12 cannot ask).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::avx2;
  if (best == Isa::avx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = Isa::avx512;
#endif
  if (isa_request_below(IsaRequest::avx2)) best = Isa::generic;
  else if (isa_request_below(IsaRequest::avx512) && best == Isa::avx512) best = Isa::avx2;
  return best;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

bool amx_supported() {
#if PG_X86
  static const bool ok = [] {
    if (active_isa() != Isa::avx512) return false;
    if (isa_request_below(IsaRequest::amx)) return false;  // a forced lower path
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // amx-bf16, amx-tile
    unsigned a1, b1, c1, d1;
    if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !((a1 >> 5) & 1))
      return false;  // avx512-bf16 (vcvtne2ps2bf16)
    // Linux: ask for the XTILEDATA state (ARCH_REQ_XCOMP_PERM, feature 18) once.
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return false;
    return true;
  }();
  return ok;
#else
  return false;
#endif
}

#if PG_X86
namespace {
struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// Not _tile_loadconfig: GCC 12's tells the compiler that ldtilecfg reads 8 bytes, so once
// inlined the stores of the rest of the configuration may be dropped (seen: SIGILL at the
// first tile load, on tiles left unconfigured).
PG_TARGET_AMX void load_tile_config(const TileConfig* cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(*cfg));
}
PG_TARGET_AMX void release_tiles() { _tile_release(); }
}  // namespace

void amx_begin() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(&cfg);
}
void amx_end() { release_tiles(); }
#else
void amx_begin() {}
void amx_end() {}
#endif

const char* isa() {
  switch (active_isa()) {
    case Isa::avx512:
      if (amx_supported()) return "avx512+bf16+amx";
      return has_bf16_pair_kernels() ? "avx512+bf16" : "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

// ---- scratch ------------------------------------------------------------------------
//
// Each thread's buffers live in a ThreadScratch, listed in a process-wide registry so that
// portable_gemm_release_cpu_scratch can free those of threads outside any call. A thread
// marks itself busy for the scope of a ScratchUse (an entry point on the calling thread, a
// task on a worker: run_tasks); the releaser takes an idle thread's buffers by moving its
// state from idle to freeing, so the two never touch the same buffers at once, and it never
// waits for a busy thread: it skips it. A thread that finds its buffers being freed as it
// enters a call waits the few frees that takes.

namespace {
struct AlignedFree {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
struct ScratchSlot {
  std::unique_ptr<float[], AlignedFree> ptr;
  size_t size = 0;  // floats usable (the allocation has 16 more)
};
constexpr int kScratchSlots = 8;  // 6, 7: mixed_linear (AMX buffers, bf16 weight rows)
enum : int { kIdle = 0, kBusy = 1, kFreeing = 2 };

struct ThreadScratch;
thread_local ThreadScratch* t_listed = nullptr;  // &t_scratch once it is listed
struct ScratchRegistry {
  std::mutex mu;
  std::vector<ThreadScratch*> threads;
};

#if !defined(_WIN32)
ScratchRegistry* g_registry = nullptr;
void registry_child();
// A fork() from another thread while the registry is locked would leave it locked in the
// child for good.
void registry_prepare() { g_registry->mu.lock(); }
void registry_unlock() { g_registry->mu.unlock(); }
#endif

// Leaked: threads may exit (and unregister) after static destructors have run.
ScratchRegistry& registry() {
  static ScratchRegistry* r = [] {
    auto* reg = new ScratchRegistry;
#if !defined(_WIN32)
    g_registry = reg;
    pthread_atfork(registry_prepare, registry_unlock, registry_child);
#endif
    return reg;
  }();
  return *r;
}

struct ThreadScratch {
  ScratchSlot slot[kScratchSlots];
  std::atomic<int> state{kIdle};
  std::atomic<size_t> bytes{0};  // the slots' allocations together
  int depth = 0;                 // nested ScratchUse scopes (owner only)
  // Not in the registry (it could not grow), or scratch() met outside a ScratchUse (a
  // bug the tests would see as bytes left after a release): busy for good, never freed.
  bool pinned = false;
  bool listed = false;
  ThreadScratch() noexcept {
    try {
      ScratchRegistry& r = registry();
      std::lock_guard<std::mutex> lk(r.mu);
      r.threads.push_back(this);
      listed = true;
      t_listed = this;
    } catch (...) {
      pinned = true;
    }
  }
  ~ThreadScratch() {
    t_listed = nullptr;
    if (listed) {  // off the list first: a release may be freeing the slots right now
      ScratchRegistry& r = registry();
      std::lock_guard<std::mutex> lk(r.mu);
      r.threads.erase(std::remove(r.threads.begin(), r.threads.end(), this), r.threads.end());
    }
    // A kernel call from a thread-local destructor that runs after this one finds the slots
    // empty and the thread pinned, rather than sizes without buffers.
    pinned = true;
    free_slots();
  }
  // Frees every slot; returns the bytes they held.
  size_t free_slots() noexcept {
    for (ScratchSlot& s : slot) {
      s.ptr.reset();
      s.size = 0;
    }
    return bytes.exchange(0, std::memory_order_relaxed);
  }
  void enter() noexcept {  // idle -> busy, waiting out a release that is freeing
    int expected = kIdle;
    while (!state.compare_exchange_weak(expected, kBusy, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      expected = kIdle;
      std::this_thread::yield();
    }
  }
};

thread_local ThreadScratch t_scratch;

// The registry, and with it the fork handlers, from the library's load on: glibc reads its
// list of handlers when a fork() starts, so handlers registered by a first call that races
// with a fork in another thread would miss that fork, and its child would list the
// parent's dead threads.
[[maybe_unused]] const bool kRegistryAtLoad = (registry(), true);

#if !defined(_WIN32)
// In a forked child only the forking thread lives on. The others' ThreadScratch objects
// never run their destructors, and glibc frees their thread-local blocks when it reuses
// their stacks for new threads (ASan caught the registry reading one). So the child frees
// their buffers (nothing can use them any more) and lists only its own thread.
void registry_child() {
  std::vector<ThreadScratch*>& threads = g_registry->threads;
  for (ThreadScratch* t : threads)
    if (t != t_listed) t->free_slots();
  threads.clear();
  if (t_listed != nullptr) threads.push_back(t_listed);  // the capacity is there: no throw
  g_registry->mu.unlock();
}
#endif

void run_task(void* ctx, int64_t begin, int64_t end) {
  const auto& call = *static_cast<const std::pair<Executor::Body, void*>*>(ctx);
  const ScratchUse use;
  call.first(call.second, begin, end);
}
}  // namespace

ScratchUse::ScratchUse() noexcept {
  ThreadScratch& t = t_scratch;
  if (t.depth++ == 0 && !t.pinned) t.enter();
}

ScratchUse::~ScratchUse() {
  ThreadScratch& t = t_scratch;
  if (--t.depth == 0 && !t.pinned) t.state.store(kIdle, std::memory_order_release);
}

void run_tasks(const Executor& exec, int64_t begin, int64_t end, int64_t grain,
               Executor::Body body, void* ctx) {
  std::pair<Executor::Body, void*> call{body, ctx};
  exec.parallel_for(exec.self, begin, end, grain, run_task, &call);
}

float* scratch(int slot, size_t floats) {
  ThreadScratch& t = t_scratch;
  if (t.depth == 0 && !t.pinned) {
    t.enter();
    t.pinned = true;
  }
  ScratchSlot& s = t.slot[slot];
  if (s.size < floats) {
    // Grow geometrically so that a sweep of slowly growing shapes does not reallocate on
    // every call; the extra 16 floats let vector code over-read a row end safely. The old
    // buffer goes first, so the two are never held together.
    const size_t want = std::max(floats, s.size + s.size / 2) + 16;
    const size_t old = s.ptr ? (s.size + 16) * sizeof(float) : 0;
    s.ptr.reset();
    s.size = 0;
    t.bytes.store(t.bytes.load(std::memory_order_relaxed) - old, std::memory_order_relaxed);
    s.ptr.reset(static_cast<float*>(::operator new[](want * sizeof(float), std::align_val_t(64))));
    s.size = want - 16;
    t.bytes.store(t.bytes.load(std::memory_order_relaxed) + want * sizeof(float),
                  std::memory_order_relaxed);
  }
  return s.ptr.get();
}

namespace {
// The sum of f(thread) over the listed threads, under the registry's lock.
template <class F>
size_t sum_over_threads(F&& f) noexcept {
  size_t total = 0;
  try {
    ScratchRegistry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    for (ThreadScratch* t : r.threads) total += f(*t);
  } catch (...) {  // the lock could not be taken
  }
  return total;
}
}  // namespace

}  // namespace cpu
}  // namespace portable_gemm

using portable_gemm::cpu::kFreeing;
using portable_gemm::cpu::kIdle;
using portable_gemm::cpu::ThreadScratch;
using portable_gemm::cpu::sum_over_threads;

extern "C" PG_API size_t portable_gemm_cpu_scratch_bytes(void) {
  return sum_over_threads([](const ThreadScratch& t) { return t.bytes.load(std::memory_order_relaxed); });
}

extern "C" PG_API size_t portable_gemm_release_cpu_scratch(void) {
  const size_t freed = sum_over_threads([](ThreadScratch& t) -> size_t {
    int expected = kIdle;
    if (!t.state.compare_exchange_strong(expected, kFreeing, std::memory_order_acquire,
                                         std::memory_order_relaxed))
      return 0;  // inside a call (or pinned): keeps its buffers
    const size_t bytes = t.free_slots();
    t.state.store(kIdle, std::memory_order_release);
    return bytes;
  });
#if defined(__GLIBC__)
  // Freed blocks below glibc's mmap threshold (which rises to 32 MiB as large blocks are
  // freed) stay in the heap: hand its free pages back, as a caller of a release expects.
  if (freed > 0) malloc_trim(0);
#endif
  return freed;
}

namespace portable_gemm {
namespace cpu {

// ---- conversion ------------------------------------------------------------------------

namespace {

#if PG_X86
// 8 consecutive elements as fp32.
PG_TARGET_AVX2 inline __m256 load8_avx2(const void* p, DType t) {
  switch (t) {
    case DType::f16:
      return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    case DType::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))), 16));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(p));
  }
}

PG_TARGET_AVX2 void convert_f16_contig_avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, load8_avx2(s + i, DType::f16));
  for (; i < n; ++i) d[i] = f16_to_f32(s[i]);
}

// pack_rows_transposed on AVX2, 8 rows at a time: 8 k of each row loaded, an 8 x 8
// transpose in registers, each k's `lanes` values stored 8 wide (see `overlap`) or masked.
// The generic form copies a row into a buffer (memmove) and stores each element on its
// own; with this and copy_slivers, packing went from ~13 % to ~6 % of the samples of an
// fp32 1024^3 gemm loop on 2 threads of an AVX2 EPYC (bench/CPU_NOTES.md, 46). The k past
// the last whole 8 go one at a time. Rows of the panel are stored in increasing k, which
// the spilling stores rely on.
PG_TARGET_AVX2 void pack_rows_transposed_avx2(const void* const* rows, int nrows, DType t,
                                              int64_t kc, float* dst, int64_t ld, int lanes) {
  const int64_t es = int64_t(dtype_size(t));
  const int64_t kv = kc / 8 * 8;
  // One half that fills its rows (ld == lanes < 8, A's slivers): each k is stored 8 wide,
  // its spill overwritten by the next k's store (masked stores are slow on AMD).
  const bool overlap = lanes < 8 && ld == lanes;
  for (int h = 0; h < lanes; h += 8) {
    const int w = std::min(8, lanes - h);  // lanes of this half
    const int n = std::max(0, std::min(w, nrows - h));  // rows of it with data
    const __m256i store_mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const char* src[8];
    for (int r = 0; r < 8; ++r) src[r] = r < n ? static_cast<const char*>(rows[h + r]) : nullptr;
    float* d0 = dst + h;
    for (int64_t k0 = 0; k0 < kv; k0 += 8) {
      __m256 v[8];
      PG_UNROLL for (int r = 0; r < 8; ++r)
        v[r] = src[r] ? load8_avx2(src[r] + k0 * es, t) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 o[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                           _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                           _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                           _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      float* d = d0 + k0 * ld;
      PG_UNROLL for (int i = 0; i < 8; ++i) {
        if (w == 8 || (overlap && k0 + i + 1 < kc)) {
          _mm256_storeu_ps(d + i * ld, o[i]);
        } else if (overlap) {  // the last k: nothing after it to write over the spill
          alignas(32) float last[8];
          _mm256_store_ps(last, o[i]);
          std::memcpy(d + i * ld, last, size_t(w) * sizeof(float));
        } else {
          _mm256_maskstore_ps(d + i * ld, store_mask, o[i]);
        }
      }
    }
    for (int64_t k = kv; k < kc; ++k)
      for (int r = 0; r < w; ++r) {
        float v = 0.f;
        if (r < n) convert_to_f32(src[r] + k * es, 1, t, 1, &v);
        d0[k * ld + r] = v;
      }
  }
}

// 16 consecutive elements (lanes outside m read as 0, without touching memory).
PG_TARGET_AVX512 inline __m512 load16_avx512(const void* p, DType t, __mmask16 m) {
  switch (t) {
    case DType::f16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case DType::bf16:
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    default:
      return _mm512_maskz_loadu_ps(m, p);
  }
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

PG_TARGET_AVX512 void convert_contig_avx512(const void* src, DType t, int64_t n, float* dst) {
  const char* s = static_cast<const char*>(src);
  const int64_t es = int64_t(dtype_size(t));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16_avx512(s + i * es, t, 0xFFFF));
  if (i < n) {
    const __mmask16 m = first_lanes(n - i);
    _mm512_mask_storeu_ps(dst + i, m, load16_avx512(s + i * es, t, m));
  }
}

PG_TARGET_AVX512 void pack_rows_transposed_avx512(const void* const* rows, int nrows, DType t,
                                                  int64_t kc, float* dst, int64_t ld, int lanes) {
  const int64_t es = int64_t(dtype_size(t));
  const __mmask16 store_mask = first_lanes(lanes);
  for (int64_t k0 = 0; k0 < kc; k0 += 16) {
    const int64_t kk = std::min<int64_t>(16, kc - k0);
    const __mmask16 m = first_lanes(kk);
    __m512 v[16];
    PG_UNROLL for (int r = 0; r < 16; ++r) {
      v[r] = r < nrows ? load16_avx512(static_cast<const char*>(rows[r]) + k0 * es, t, m)
                       : _mm512_setzero_ps();
    }
    transpose16_avx512(v);
    float* d = dst + k0 * ld;
    PG_UNROLL for (int i = 0; i < 16; ++i) {
      if (i < kk) _mm512_mask_storeu_ps(d + i * ld, store_mask, v[i]);
    }
  }
}
#endif

}  // namespace

void convert_to_f32(const void* src, int64_t stride, DType t, int64_t n, float* dst) {
  switch (t) {
    case DType::f32: {
      const float* s = static_cast<const float*>(src);
      if (stride == 1) {
        if (n > 0) std::memcpy(dst, s, size_t(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = s[i * stride];
      }
      break;
    }
    case DType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      if (stride == 1) {
#if PG_X86
        if (active_isa() == Isa::avx512) {
          convert_contig_avx512(s, t, n, dst);
          break;
        }
#endif
        for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_f32(uint32_t(s[i]) << 16);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i * stride]);
      }
      break;
    }
    case DType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
#if PG_X86
      if (stride == 1 && active_isa() == Isa::avx512) {
        convert_contig_avx512(s, t, n, dst);
        break;
      }
      if (stride == 1 && active_isa() == Isa::avx2) {
        convert_f16_contig_avx2(s, n, dst);
        break;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i * stride]);
      break;
    }
    default:
      break;
  }
}

// ---- epilogue ---------------------------------------------------------------------------

namespace {

#if PG_X86
// exp with Cody-Waite range reduction and the Cephes degree-6 polynomial (about 1 ulp);
// vscalefps applies 2^n and saturates to 0 / inf without special cases.
PG_TARGET_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// gelu(x) = 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2). erfc(z), z >= 0, is the
// Chebyshev fit of Numerical Recipes (erfcc: relative error < 1.2e-7 for every z), so
// the far negative tail stays relatively accurate too; 1 + erf(z) = 2 - erfc(z) on the
// positive side.
PG_TARGET_AVX512 inline __m512 gelu_avx512(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f),
                                 _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.f)));
  static const float c[] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                            -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
  __m512 poly = _mm512_set1_ps(c[0]);
  PG_UNROLL for (int i = 1; i < 10; ++i) poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(c[i]));
  const __m512 erfc_z = _mm512_mul_ps(t, exp_avx512(_mm512_fnmadd_ps(z, z, poly)));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 one_plus_erf =
      _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.f), erfc_z), erfc_z);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), one_plus_erf);
}

PG_TARGET_AVX512 inline __m512 activate_avx512(__m512 v, Activation act) {
  switch (act) {
    case Activation::relu:
      return _mm512_max_ps(_mm512_setzero_ps(), v);  // maxps returns its 2nd operand for NaN: keeps NaN
    case Activation::silu:
      return _mm512_div_ps(
          v, _mm512_add_ps(_mm512_set1_ps(1.f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    case Activation::gelu:
      return gelu_avx512(v);
    default:
      return v;
  }
}

// Round to nearest even bf16, NaN kept quiet, as f32_to_bf16.
PG_TARGET_AVX512 inline __m256i to_bf16_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounding = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, rounding), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_mov_epi32(r, nan, quiet_nan);
  return _mm512_cvtepi32_epi16(r);
}

// One output row with unit column stride: act(v * scale + bias) rounded to t.
PG_TARGET_AVX512 void store_row_avx512(const float* v, const float* scale, const float* bias,
                                       Activation act, void* dst, DType t, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    __m512 x = _mm512_maskz_loadu_ps(m, v + j);
    if (scale) x = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(m, scale + j));
    if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + j));
    x = activate_avx512(x, act);
    switch (t) {
      case DType::f16:
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + j, m,
                                 _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
      case DType::bf16:
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + j, m, to_bf16_avx512(x));
        break;
      default:
        _mm512_mask_storeu_ps(static_cast<float*>(dst) + j, m, x);
        break;
    }
  }
}

// act(x * scale + bias) for 16 columns (scale, bias: null or their 16 values).
PG_TARGET_AVX512 PG_ALWAYS_INLINE __m512 finish_avx512(__m512 x, const float* scale, const float* bias,
                                                       Activation act) {
  if (scale) x = _mm512_mul_ps(x, _mm512_loadu_ps(scale));
  if (bias) x = _mm512_add_ps(x, _mm512_loadu_ps(bias));
  return activate_avx512(x, act);
}

// bf16 bits of v (to_bf16_avx512) in the low halves of its 32-bit lanes.
PG_TARGET_AVX512 PG_ALWAYS_INLINE __m512i bf16_lanes_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

// Rows [0, m) of a tile (row i at v + i * ldt) with unit column stride into dst (row i at
// dst + i * ld bytes): act(v * scale + bias) rounded to t. 32 columns at a time: one
// 64-byte store of bf16 / f16 (the two halves joined in registers), where 16 at a time
// took a masked narrowing store (vpmovdw to memory) per 16 values, and a call per row; those
// were 9 % of a bf16 2048^3 GEMM's samples on the 2-core Xeon VM (bench/CPU_NOTES.md 62).
PG_TARGET_AVX512 void store_rows_avx512(const float* v, int64_t ldt, int64_t m, const float* scale,
                                        const float* bias, Activation act, char* dst, int64_t ld,
                                        DType t, int64_t n) {
  const __m512i qorder = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);  // after vpackusdw
  for (int64_t i = 0; i < m; ++i, v += ldt, dst += ld) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512 x0 = finish_avx512(_mm512_loadu_ps(v + j), scale ? scale + j : nullptr,
                                      bias ? bias + j : nullptr, act);
      const __m512 x1 = finish_avx512(_mm512_loadu_ps(v + j + 16), scale ? scale + j + 16 : nullptr,
                                      bias ? bias + j + 16 : nullptr, act);
      switch (t) {
        case DType::f16: {
          constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
          const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(x0, kRound)),
                                               _mm512_cvtps_ph(x1, kRound), 1);
          _mm512_storeu_si512(dst + j * 2, h);
          break;
        }
        case DType::bf16: {  // the lanes hold at most 0xffff: the unsigned saturation keeps them
          const __m512i b = _mm512_packus_epi32(bf16_lanes_avx512(x0), bf16_lanes_avx512(x1));
          _mm512_storeu_si512(dst + j * 2, _mm512_permutexvar_epi64(qorder, b));
          break;
        }
        default:
          _mm512_storeu_ps(reinterpret_cast<float*>(dst) + j, x0);
          _mm512_storeu_ps(reinterpret_cast<float*>(dst) + j + 16, x1);
          break;
      }
    }
    if (j < n)
      store_row_avx512(v + j, scale ? scale + j : nullptr, bias ? bias + j : nullptr, act,
                       dst + j * int64_t(dtype_size(t)), t, n - j);
  }
}
#endif

}  // namespace

void Epilogue::store(const float* tile, int64_t ldt, int64_t i0, int64_t m, int64_t j0,
                     int64_t n) const {
#if PG_X86
  if (c.col_stride == 1 && active_isa() == Isa::avx512) {
    const int64_t es = int64_t(dtype_size(c.dtype));
    store_rows_avx512(tile, ldt, m, col_scale ? col_scale + j0 : nullptr, bias ? bias + j0 : nullptr,
                      act, static_cast<char*>(c.data) + (i0 * c.row_stride + j0) * es,
                      c.row_stride * es, c.dtype, n);
    return;
  }
#endif
  constexpr int64_t kChunk = 64;
  alignas(64) float tmp[kChunk];
  const int64_t cs = c.col_stride;
  for (int64_t i = 0; i < m; ++i) {
    const float* src = tile + i * ldt;
    char* row = static_cast<char*>(c.data) + (i0 + i) * c.row_stride * int64_t(dtype_size(c.dtype));
    for (int64_t j = 0; j < n; j += kChunk) {
      const int64_t cnt = std::min(kChunk, n - j);
      const float* v = src + j;
      if (col_scale != nullptr || bias != nullptr || act != Activation::none) {
        std::memcpy(tmp, v, size_t(cnt) * sizeof(float));
        if (col_scale != nullptr) {
          const float* sj = col_scale + j0 + j;
          for (int64_t x = 0; x < cnt; ++x) tmp[x] *= sj[x];
        }
        if (bias != nullptr) {
          const float* bj = bias + j0 + j;
          for (int64_t x = 0; x < cnt; ++x) tmp[x] += bj[x];
        }
        switch (act) {
          case Activation::relu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = tmp[x] < 0.f ? 0.f : tmp[x];  // NaN stays NaN
            break;
          case Activation::silu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = activate(tmp[x], Activation::silu);
            break;
          case Activation::gelu:
            for (int64_t x = 0; x < cnt; ++x) tmp[x] = activate(tmp[x], Activation::gelu);
            break;
          default:
            break;
        }
        v = tmp;
      }
      const int64_t col = j0 + j;
      switch (c.dtype) {
        case DType::f32: {
          float* d = reinterpret_cast<float*>(row) + col * cs;
          if (cs == 1) {
            std::memcpy(d, v, size_t(cnt) * sizeof(float));
          } else {
            for (int64_t x = 0; x < cnt; ++x) d[x * cs] = v[x];
          }
          break;
        }
        case DType::bf16: {
          uint16_t* d = reinterpret_cast<uint16_t*>(row) + col * cs;
          for (int64_t x = 0; x < cnt; ++x) d[x * cs] = f32_to_bf16(v[x]);
          break;
        }
        case DType::f16: {
          uint16_t* d = reinterpret_cast<uint16_t*>(row) + col * cs;
          for (int64_t x = 0; x < cnt; ++x) d[x * cs] = f32_to_f16(v[x]);
          break;
        }
        default:
          break;
      }
    }
  }
}

// ---- micro-kernels -----------------------------------------------------------------------

namespace {

// Computes an M x NR block (M <= MR): out = (in ? in : 0) + A_sliver @ B_sliver, where
// the A sliver is kc x MR (row k at a + k * MR) and the B sliver kc x NR (row k at
// b + k * ldb: ldb = NR when packed, B's row stride when read in place).
using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, int64_t ldb,
                             const float* in, int64_t ldin, float* out, int64_t ldout);
// The same for the bf16 pair kernels with A read in place: row i of the M x 2 kp block at
// a + i * lda (bf16 elements, unit column stride), its k pairs already adjacent.
using RowsKernel = void (*)(int64_t kp, const uint16_t* a, int64_t lda, const float* b, int64_t ldb,
                            const float* in, int64_t ldin, float* out, int64_t ldout);

using NextKernel = void (*)(int64_t kp, const float* a, const float* b, int64_t ldb, const float* in,
                           int64_t ldin, float* out, int64_t ldout, const char* next, int lines);

struct KernelSet {
  int mr, nr;
  int64_t kc, nc, mch;  // cache blocking (see the top of the file)
  MicroKernel kern[33];  // kern[m] for m = 1..mr
  RowsKernel kern_rows[33];  // pair kernels with A in place, or null (see a_in_place)
  // bf16 pair kernels: panels hold bf16 pairs (k, k + 1) in 32-bit units instead of fp32,
  // and a micro-kernel's kc counts pairs. Sliver offsets in 32-bit units are unchanged.
  bool bf16_pairs = false;
  // AMX kernels (bf16_pairs too): A is packed as tiles (pack_a_tiles_bf16), kc blocks are
  // multiples of 32 k, and each task loads the tile configuration.
  bool amx = false;
  // K up to this runs as one block even where it exceeds kc (0: never).
  int64_t kc_whole = 0;
  // AMX: kern[m] with `lines` lines of `next` prefetched into L2 a step of 32 k
  // (kern_amx_next), or null.
  NextKernel kern_next[33] = {};
  // Tasks spanning several column blocks pack each kc block of A once per row chunk and
  // walk the column blocks inside it (run_block_a_once), instead of packing A again for
  // every column block.
  bool a_once = false;
};

#if defined(__aarch64__)
constexpr int kGenericNR = 16;  // 32 vector registers: 4 x 16 accumulators fit
#else
constexpr int kGenericNR = 8;   // baseline x86-64 has 16 xmm registers
#endif
constexpr int kGenericMR = 4;

template <int M>
void kern_generic(int64_t kc, const float* a, const float* b, int64_t ldb, const float* in,
                  int64_t ldin, float* out, int64_t ldout) {
  constexpr int MR = kGenericMR, NR = kGenericNR;
  float acc[M][NR];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = in ? in[i * ldin + j] : 0.f;
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = b + k * ldb;
    const float* ak = a + k * MR;
    for (int i = 0; i < M; ++i) {
      const float ai = ak[i];
      for (int j = 0; j < NR; ++j) acc[i][j] += ai * bk[j];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldout + j] = acc[i][j];
}

#if PG_X86
// 6 x 16: 12 ymm accumulators + 2 for B + 1 broadcast of the 16 registers.
constexpr int kAvx2MR = 6, kAvx2NR = 16;

template <int M>
PG_TARGET_AVX2 void kern_avx2(int64_t kc, const float* a, const float* b, int64_t ldb,
                              const float* in, int64_t ldin, float* out, int64_t ldout) {
  __m256 c0[M], c1[M];
  PG_UNROLL for (int i = 0; i < M; ++i) {
    if (in) {
      c0[i] = _mm256_loadu_ps(in + i * ldin);
      c1[i] = _mm256_loadu_ps(in + i * ldin + 8);
    } else {
      c0[i] = _mm256_setzero_ps();
      c1[i] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    PG_UNROLL for (int i = 0; i < M; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + i);
      c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
    }
    a += kAvx2MR;
    b += ldb;
  }
  PG_UNROLL for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * ldout, c0[i]);
    _mm256_storeu_ps(out + i * ldout + 8, c1[i]);
  }
}

// 12 x 32: 24 zmm accumulators; B rows are two full vectors, A values are broadcast
// straight from memory (the FMA's embedded broadcast), so 26 of 32 registers are live.
constexpr int kAvx512MR = 12, kAvx512NR = 32;

template <int M>
PG_TARGET_AVX512 void kern_avx512(int64_t kc, const float* a, const float* b, int64_t ldb,
                                  const float* in, int64_t ldin, float* out, int64_t ldout) {
  __m512 c0[M], c1[M];
  PG_UNROLL for (int i = 0; i < M; ++i) {
    if (in) {
      c0[i] = _mm512_loadu_ps(in + i * ldin);
      c1[i] = _mm512_loadu_ps(in + i * ldin + 16);
    } else {
      c0[i] = _mm512_setzero_ps();
      c1[i] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    PG_UNROLL for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
    }
    a += kAvx512MR;
    b += ldb;
  }
  PG_UNROLL for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(out + i * ldout, c0[i]);
    _mm512_storeu_ps(out + i * ldout + 16, c1[i]);
  }
}

// bf16 x bf16 with AVX512-BF16: vdpbf16ps multiplies a pair of k per lane and adds both
// products into fp32, twice the work of an fp32 FMA per instruction. A sliver holds
// pairs (a[i][2p], a[i][2p+1]) as one 32-bit unit per row (broadcast to all lanes), a B
// sliver pairs (b[2p][j], b[2p+1][j]) per column. Like every vdpbf16ps user (oneDNN
// included) this flushes bf16 denormals to zero.
// APair(i, p) is the 32-bit pair unit p of row i: from the packed sliver or from A itself.
template <int M, typename APair>
PG_TARGET_AVX512_BF16 inline void kern_avx512_bf16_body(int64_t kp, APair a_pair, const float* b,
                                                        int64_t ldb, const float* in, int64_t ldin,
                                                        float* out, int64_t ldout) {
  __m512 c0[M], c1[M];
  PG_UNROLL for (int i = 0; i < M; ++i) {
    if (in) {
      c0[i] = _mm512_loadu_ps(in + i * ldin);
      c1[i] = _mm512_loadu_ps(in + i * ldin + 16);
    } else {
      c0[i] = _mm512_setzero_ps();
      c1[i] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 16);
    PG_UNROLL for (int i = 0; i < M; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(a_pair(i, p));
      c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);
    }
    b += ldb;
  }
  PG_UNROLL for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(out + i * ldout, c0[i]);
    _mm512_storeu_ps(out + i * ldout + 16, c1[i]);
  }
}

template <int M>
PG_TARGET_AVX512_BF16 void kern_avx512_bf16(int64_t kp, const float* a, const float* b,
                                            int64_t ldb, const float* in, int64_t ldin,
                                            float* out, int64_t ldout) {
  const int32_t* ap = reinterpret_cast<const int32_t*>(a);
  kern_avx512_bf16_body<M>(kp, [ap](int i, int64_t p) { return ap[p * kAvx512MR + i]; }, b, ldb, in,
                           ldin, out, ldout);
}

template <int M>
PG_TARGET_AVX512_BF16 void kern_avx512_bf16_rows(int64_t kp, const uint16_t* a, int64_t lda,
                                                 const float* b, int64_t ldb, const float* in,
                                                 int64_t ldin, float* out, int64_t ldout) {
  const char* row[M];
  PG_UNROLL for (int i = 0; i < M; ++i) row[i] = reinterpret_cast<const char*>(a + i * lda);
  kern_avx512_bf16_body<M>(
      kp,
      [&row](int i, int64_t p) {
        int32_t v;  // rows are only 2-byte aligned in general
        std::memcpy(&v, row[i] + 4 * p, 4);
        return v;
      },
      b, ldb, in, ldin, out, ldout);
}

// bf16 x bf16 on the AMX tile unit: a 32 x 32 block of C (MT = 2) or its first 16 rows
// (MT = 1) in tiles 0-3, fp32, for kp pairs of k (a multiple of 16). Per 32 k, tiles 4-5
// take 16 rows of A each (1 KB each, contiguous, from pack_a_tiles_bf16) and tiles
// 6-7 16 pair rows of the B sliver's two 16-column halves (the pair panel is already the
// VNNI layout the unit reads), for 2 MT tdpbf16ps. Like vdpbf16ps, it flushes bf16
// denormals to zero. The tile configuration is the caller's (amx_begin).
// NEXT: `lines` prefetcht1 a step of 32 k from `next` on (the next A sliver's part for this
// call, into L2; kern_amx_next).
template <int MT, bool NEXT>
PG_TARGET_AMX inline void kern_amx_body(int64_t kp, const float* a, const float* b, int64_t ldb,
                                        const float* in, int64_t ldin, float* out, int64_t ldout,
                                        const char* next, int lines) {
  const char* ab = reinterpret_cast<const char*>(a);  // 2 KB per 32 k: rows 0-15, 16-31
  if (in) {
    _tile_loadd(0, in, ldin * 4);
    _tile_loadd(1, in + 16, ldin * 4);
    if (MT == 2) {
      _tile_loadd(2, in + 16 * ldin, ldin * 4);
      _tile_loadd(3, in + 16 * ldin + 16, ldin * 4);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (MT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t p = 0; p < kp; p += 16) {
    if (NEXT) {
      for (int l = 0; l < lines; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T1);
      next += lines * 64;
    }
    _tile_loadd(4, ab + 128 * p, 64);
    _tile_loadd(6, b + p * ldb, ldb * 4);
    _tile_loadd(7, b + p * ldb + 16, ldb * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (MT == 2) {
      _tile_loadd(5, ab + 128 * p + 1024, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, ldout * 4);
  _tile_stored(1, out + 16, ldout * 4);
  if (MT == 2) {
    _tile_stored(2, out + 16 * ldout, ldout * 4);
    _tile_stored(3, out + 16 * ldout + 16, ldout * 4);
  }
}

template <int MT>
PG_TARGET_AMX void kern_amx(int64_t kp, const float* a, const float* b, int64_t ldb,
                            const float* in, int64_t ldin, float* out, int64_t ldout) {
  kern_amx_body<MT, false>(kp, a, b, ldb, in, ldin, out, ldout, nullptr, 0);
}

// kern_amx with the next A sliver brought into L2 a little every step. Where A streams from
// L3 (the shared packed A of pack_a_shared), each new sliver's first call otherwise waits on
// it; cpu_amx_tile_probe.cpp (PF -3) took 2.03-2.05 instead of 1.87-1.94 TFLOP/s a core with
// 64 A slivers (bench/CPU_NOTES.md 63). A burst of prefetches before each call instead was
// slower (1.62-1.65).
template <int MT>
PG_TARGET_AMX void kern_amx_next(int64_t kp, const float* a, const float* b, int64_t ldb, const float* in,
                                 int64_t ldin, float* out, int64_t ldout, const char* next, int lines) {
  kern_amx_body<MT, true>(kp, a, b, ldb, in, ldin, out, ldout, next, lines);
}

// kern[m] and kern_rows[m] of the pair set for m = 1..kAvx512MR.
template <int... I>
void set_pair_kernels(KernelSet& s, std::integer_sequence<int, I...>) {
  ((s.kern[I + 1] = kern_avx512_bf16<I + 1>, s.kern_rows[I + 1] = kern_avx512_bf16_rows<I + 1>), ...);
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}
#endif

// The pair kernels, or null when the CPU (or PORTABLE_GEMM_ISA) rules them out.
const KernelSet* bf16_kernel_set() {
  static const KernelSet* set = []() -> const KernelSet* {
#if PG_X86
    if (active_isa() != Isa::avx512 || !cpu_has_avx512_bf16()) return nullptr;
    if (isa_request_below(IsaRequest::avx512_bf16)) return nullptr;  // the fp32-conversion path
    static KernelSet s{};
    s.mr = kAvx512MR;
    s.nr = kAvx512NR;
    // kc 1024 (512 pairs; an A sliver is 24 KB and stays in L1): K = 1024 is one block
    // instead of two of 512, so no fp32 partial sums and A packed once; 0.78-0.95x ->
    // 0.93-1.00x torch at 1024^3, and no loss at 2048 and 4096 (bench/CPU_NOTES.md, 13).
    s.kc = 1024;
    // B blocks of 512 pairs x 1024 columns (2 MB: slivers stream from L2/L3 at ~5 bytes
    // a cycle) and row blocks of 2040: B is packed once per 2040 rows instead of once per
    // 480, A once per 1024 columns instead of 512. Packing fell from ~11% to ~5% of a
    // 2048^3 GEMM (bench/CPU_NOTES.md, 11). Scratch per task: A block 512 x 2040 units
    // (4 MB), fp32 partial sums 2040 x 1024 (8 MB) when K spans several kc blocks.
    s.nc = 1024;
    s.mch = 2040;
    s.bf16_pairs = true;
    set_pair_kernels(s, std::make_integer_sequence<int, kAvx512MR>{});
    return &s;
#else
    return nullptr;
#endif
  }();
  return set;
}

// The AMX kernels, or null when amx_supported() is false. Blocks: kc 512 (an A sliver of
// 32 rows is 32 KB, a B sliver 32 KB), B blocks of 256 pairs x 1024 columns (1 MB, in L2),
// row blocks of 2048. On the 2-thread AMX host of bench/CPU_NOTES.md 21, kc 256 and 1024
// and nc 512 were no better within that machine's noise at every size. K up to 1024 runs
// as one block: two blocks of 512 put the fp32 partial sums through memory (2 MB a task
// at 1024^3), and with A packed as tiles 1024^3 went from 0.82-0.85x torch to 0.99x
// (bench/CPU_NOTES.md 26).
const KernelSet* amx_kernel_set() {
  static const KernelSet* set = []() -> const KernelSet* {
#if PG_X86
    if (bf16_kernel_set() == nullptr || !amx_supported()) return nullptr;
    static KernelSet s{};
    s.mr = 32;
    s.nr = kAvx512NR;
    s.kc = 512;
    s.kc_whole = 1024;
    s.nc = 1024;
    s.mch = 2048;
    s.bf16_pairs = true;
    s.amx = true;
    for (int m = 1; m <= 16; ++m) s.kern[m] = kern_amx<1>, s.kern_next[m] = kern_amx_next<1>;
    for (int m = 17; m <= 32; ++m) s.kern[m] = kern_amx<2>, s.kern_next[m] = kern_amx_next<2>;
    return &s;
#else
    return nullptr;
#endif
  }();
  return set;
}

const KernelSet& kernel_set() {
  static const KernelSet set = [] {
    KernelSet s{};
#if PG_X86
    if (active_isa() == Isa::avx512) {
      s.mr = kAvx512MR;
      s.nr = kAvx512NR;
      s.kc = 384;
      s.nc = 512;
      // Row chunks of up to 2040 (480 before): each chunk packs the B panels again. On
      // the AVX-512 host of bench/CPU_NOTES.md 29, fp32 4096 went from 0.82-0.83 to
      // 0.92-0.97x torch.matmul, 1024 and 2048 the same within the host's noise.
      s.mch = 2040;
      s.a_once = true;
      s.kern[1] = kern_avx512<1>; s.kern[2] = kern_avx512<2>; s.kern[3] = kern_avx512<3>;
      s.kern[4] = kern_avx512<4>; s.kern[5] = kern_avx512<5>; s.kern[6] = kern_avx512<6>;
      s.kern[7] = kern_avx512<7>; s.kern[8] = kern_avx512<8>; s.kern[9] = kern_avx512<9>;
      s.kern[10] = kern_avx512<10>; s.kern[11] = kern_avx512<11>; s.kern[12] = kern_avx512<12>;
      return s;
    }
    if (active_isa() == Isa::avx2) {
      s.mr = kAvx2MR;
      s.nr = kAvx2NR;
      s.kc = 384;
      s.nc = 512;
      s.mch = 480;
      s.kern[1] = kern_avx2<1>; s.kern[2] = kern_avx2<2>; s.kern[3] = kern_avx2<3>;
      s.kern[4] = kern_avx2<4>; s.kern[5] = kern_avx2<5>; s.kern[6] = kern_avx2<6>;
      return s;
    }
#endif
    s.mr = kGenericMR;
    s.nr = kGenericNR;
    s.kc = 256;
    s.nc = 256;
    s.mch = 256;
    s.kern[1] = kern_generic<1>; s.kern[2] = kern_generic<2>;
    s.kern[3] = kern_generic<3>; s.kern[4] = kern_generic<4>;
    return s;
  }();
  return set;
}

// ---- packing ---------------------------------------------------------------------------

inline int64_t round_up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A(i0 .. i0+mc, k0 .. k0+kc) -> slivers of kc x mr (row k of sliver s at
// dst[(s * kc + k) * mr]), rows past mc zero.
void pack_a(const ConstMatrix& a, int64_t i0, int64_t mc, int64_t k0, int64_t kc, int mr,
            float* dst) {
  const int64_t es = int64_t(dtype_size(a.dtype));
  const char* base = static_cast<const char*>(a.data);
  const bool k_major = a.row_stride == 1 && a.col_stride != 1;  // e.g. a transposed view
  float* tmp = a.col_stride == 1 || k_major ? nullptr : scratch(5, size_t(mr * kc));
  for (int64_t s = 0; s * mr < mc; ++s) {
    float* d = dst + s * kc * mr;
    const int rows = int(std::min<int64_t>(mr, mc - s * mr));
    const int64_t r0 = i0 + s * mr;
    if (k_major) {
      for (int64_t k = 0; k < kc; ++k) {
        convert_to_f32(base + ((k0 + k) * a.col_stride + r0) * es, 1, a.dtype, rows, d + k * mr);
        for (int64_t i = rows; i < mr; ++i) d[k * mr + i] = 0.f;
      }
      continue;
    }
    const void* rp[16];
    DType t = a.dtype;
    for (int i = 0; i < rows; ++i) {
      const char* src = base + ((r0 + i) * a.row_stride + k0 * a.col_stride) * es;
      if (tmp) {  // strided rows: gather into fp32 first
        convert_to_f32(src, a.col_stride, a.dtype, kc, tmp + i * kc);
        rp[i] = tmp + i * kc;
      } else {
        rp[i] = src;
      }
    }
    if (tmp) t = DType::f32;
    pack_rows_transposed(rp, rows, t, kc, d, mr, mr);
  }
}

// One row of B (fp32, contiguous) into the slivers of a panel: NR floats to each, the
// slivers kc * NR apart. A fixed size lets the compiler copy with vector moves; with nr
// known only at run time, each 64-byte piece was a call to memmove (see
// pack_rows_transposed_avx2 for what the two changes bought).
template <int NR>
inline void copy_slivers(const float* src, int64_t full, int64_t kc, float* dst) {
  for (int64_t j = 0; j < full; j += NR) std::memcpy(dst + j * kc, src + j, NR * sizeof(float));
}

// PackB for a dense strided B.
void pack_b_dense(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                  float* dst) {
  const ConstMatrix& b = *static_cast<const ConstMatrix*>(ctx);
  const int64_t es = int64_t(dtype_size(b.dtype));
  const char* base = static_cast<const char*>(b.data);
  const bool k_major = b.row_stride == 1 && b.col_stride != 1;  // e.g. nn.Linear weight^T
  if (!k_major) {
    // Row by row, so that B is read as long contiguous runs (hardware prefetch follows
    // them); the scattered writes land in the packed panel, which is cache-resident.
    const int64_t full = nc / nr * nr;
    for (int64_t k = 0; k < kc; ++k) {
      const char* src = base + ((k0 + k) * b.row_stride + n0 * b.col_stride) * es;
      if (b.dtype == DType::f32 && b.col_stride == 1) {
        const float* sf = reinterpret_cast<const float*>(src);
        float* dk = dst + k * nr;
        if (nr == 16) copy_slivers<16>(sf, full, kc, dk);
        else if (nr == 32) copy_slivers<32>(sf, full, kc, dk);
        else
          for (int64_t j = 0; j < full; j += nr)
            std::memcpy(dk + j * kc, sf + j, size_t(nr) * sizeof(float));
      } else {
        for (int64_t j = 0; j < full; j += nr)
          convert_to_f32(src + j * b.col_stride * es, b.col_stride, b.dtype, nr,
                         dst + (j * kc + k * nr));
      }
      if (full < nc) {
        float* d = dst + full * kc + k * nr;
        convert_to_f32(src + full * b.col_stride * es, b.col_stride, b.dtype, nc - full, d);
        for (int64_t j = nc - full; j < nr; ++j) d[j] = 0.f;
      }
    }
    return;
  }
  for (int64_t s = 0; s * nr < nc; ++s) {
    float* d = dst + s * kc * nr;
    const int64_t cols = std::min<int64_t>(nr, nc - s * nr);
    const int64_t c0 = n0 + s * nr;
    for (int h = 0; h < nr; h += 16) {
      const int lanes = std::min(16, nr - h);
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(lanes, cols - h)));
      const void* rp[16];
      for (int j = 0; j < n; ++j) rp[j] = base + (k0 + (c0 + h + j) * b.col_stride) * es;
      pack_rows_transposed(rp, n, b.dtype, kc, d + h, nr, lanes);
    }
  }
}

// Packing for the pair kernels. Both operands are bf16; a "pair unit" is a uint32 holding
// element k (low half) and k + 1 (high half) of one row of A or one column of B, and a
// panel is laid out exactly like the fp32 one with units in place of floats, kc / 2 rows
// (rounded up; an odd last k is paired with 0).
inline uint32_t pair_unit(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// pack_pairs_transposed (common.h).
void pack_pairs_transposed_impl(const uint16_t* base, int64_t line_stride, int64_t step,
                                int nlines, int64_t kc, uint32_t* dst, int64_t ld, int lanes) {
  const int64_t kp = kc / 2;
  if (step == 1 && nlines > 0) {
    // Adjacent elements already form the units: a 32-bit transpose (bit copies through
    // the fp32 path), leaving the odd tail to the scalar code below.
    const void* rp[16];
    for (int r = 0; r < nlines; ++r) rp[r] = base + r * line_stride;
    pack_rows_transposed(rp, nlines, DType::f32, kp, reinterpret_cast<float*>(dst), ld, lanes);
  } else {
    for (int64_t p = 0; p < kp; ++p)
      for (int r = 0; r < lanes; ++r) {
        const uint16_t* e = base + r * line_stride + 2 * p * step;
        dst[p * ld + r] = r < nlines ? pair_unit(e[0], e[step]) : 0u;
      }
  }
  if (kc & 1)
    for (int r = 0; r < lanes; ++r)
      dst[kp * ld + r] = r < nlines ? pair_unit(base[r * line_stride + (kc - 1) * step], 0) : 0u;
}

void pack_a_pairs(const ConstMatrix& a, int64_t i0, int64_t mc, int64_t k0, int64_t kc, int mr,
                  float* dst_f) {
  uint32_t* dst = reinterpret_cast<uint32_t*>(dst_f);
  const uint16_t* base = static_cast<const uint16_t*>(a.data);
  const int64_t kp = (kc + 1) / 2;
  for (int64_t s = 0; s * mr < mc; ++s) {
    const int rows = int(std::min<int64_t>(mr, mc - s * mr));
    pack_pairs_transposed_impl(base + (i0 + s * mr) * a.row_stride + k0 * a.col_stride, a.row_stride,
                          a.col_stride, rows, kc, dst + s * kp * mr, mr, mr);
  }
}

// A(i0 .. i0+mc, k0 .. k0+kc) for the AMX kernels (kc a multiple of 32): slivers of mr rows
// (sliver s at dst + s * mr * kc bf16), each a run of the tiles kern_amx loads: per 32 k, the
// 64 bytes of each of the mr rows in turn, so that a tile load reads 1 KB in one piece
// instead of 16 rows a whole row of A apart. Rows past mc zero.
void pack_a_tiles_bf16(const ConstMatrix& a, int64_t i0, int64_t mc, int64_t k0, int64_t kc,
                       int mr, float* dst_f) {
  uint16_t* dst = reinterpret_cast<uint16_t*>(dst_f);
  const uint16_t* base = static_cast<const uint16_t*>(a.data);
  const int64_t rows = round_up_to(mc, mr), nb = kc / 32;
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* d = dst + (i / mr) * mr * kc + (i % mr) * 32;
    const uint16_t* src = i < mc ? base + (i0 + i) * a.row_stride + k0 * a.col_stride : nullptr;
    for (int64_t b = 0; b < nb; ++b, d += mr * 32) {
      if (src == nullptr) {
        std::memset(d, 0, 64);
      } else if (a.col_stride == 1) {
        std::memcpy(d, src + b * 32, 64);
      } else {
        for (int64_t k = 0; k < 32; ++k) d[k] = src[(b * 32 + k) * a.col_stride];
      }
    }
  }
}

#if PG_X86
// Row-major B: units interleave rows 2p and 2p + 1, 16 columns per step.
PG_TARGET_AVX512 void pack_b_pairs_rows_avx512(const uint16_t* b, int64_t rs, int64_t kc,
                                               int64_t nc, int nr, uint32_t* dst) {
  const int64_t kp = (kc + 1) / 2;
  for (int64_t p = 0; p < kp; ++p) {
    const uint16_t* r0 = b + 2 * p * rs;
    const bool has_r1 = 2 * p + 1 < kc;
    for (int64_t j = 0; j < round_up_to(nc, nr); j += 16) {
      const __mmask16 m = j < nc ? first_lanes(nc - j) : __mmask16(0);  // zero padding
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + j));
      const __m512i hi = has_r1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + rs + j))
                                : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (j / nr) * kp * nr + p * nr + (j % nr),
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}
#endif

void pack_b_pairs(const ConstMatrix& b, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                  float* dst_f) {
  uint32_t* dst = reinterpret_cast<uint32_t*>(dst_f);
  const uint16_t* base =
      static_cast<const uint16_t*>(b.data) + k0 * b.row_stride + n0 * b.col_stride;
  const int64_t kp = (kc + 1) / 2;
#if PG_X86
  if (b.col_stride == 1 && nr % 16 == 0) {
    pack_b_pairs_rows_avx512(base, b.row_stride, kc, nc, nr, dst);
    return;
  }
#endif
  // Columns are the lines: contiguous pairs when B is k-major (a transposed view).
  for (int64_t s = 0; s * nr < nc; ++s) {
    const int64_t cols = std::min<int64_t>(nr, nc - s * nr);
    for (int h = 0; h < nr; h += 16) {
      const int lanes = std::min(16, nr - h);
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(lanes, cols - h)));
      pack_pairs_transposed_impl(base + (s * nr + h) * b.col_stride, b.col_stride, b.row_stride, n, kc,
                            dst + s * kp * nr + h, nr, lanes);
    }
  }
}

// PackB form of pack_b_pairs for a dense bf16 B (ctx: the ConstMatrix).
void pack_b_pairs_dense(const void* ctx, int64_t k0, int64_t kc, int64_t n0, int64_t nc, int nr,
                        float* dst) {
  pack_b_pairs(*static_cast<const ConstMatrix*>(ctx), k0, kc, n0, nc, nr, dst);
}

}  // namespace

bool has_bf16_pair_kernels() { return bf16_kernel_set() != nullptr; }

void pack_pairs_transposed(const uint16_t* base, int64_t line_stride, int64_t step, int nlines,
                           int64_t kc, uint32_t* dst, int64_t ld, int lanes) {
  pack_pairs_transposed_impl(base, line_stride, step, nlines, kc, dst, ld, lanes);
}

void pack_rows_transposed(const void* const* rows, int nrows, DType t, int64_t kc, float* dst,
                          int64_t ld, int lanes) {
#if PG_X86
  if (active_isa() == Isa::avx512) {
    pack_rows_transposed_avx512(rows, nrows, t, kc, dst, ld, lanes);
    return;
  }
  if (active_isa() == Isa::avx2) {
    pack_rows_transposed_avx2(rows, nrows, t, kc, dst, ld, lanes);
    return;
  }
#endif
  constexpr int64_t kChunk = 256;
  alignas(64) float tmp[kChunk];
  for (int64_t k0 = 0; k0 < kc; k0 += kChunk) {
    const int64_t n = std::min(kChunk, kc - k0);
    float* d = dst + k0 * ld;
    for (int r = 0; r < lanes; ++r) {
      if (r < nrows) {
        convert_to_f32(static_cast<const char*>(rows[r]) + k0 * int64_t(dtype_size(t)), 1, t, n,
                       tmp);
        for (int64_t k = 0; k < n; ++k) d[k * ld + r] = tmp[k];
      } else {
        for (int64_t k = 0; k < n; ++k) d[k * ld + r] = 0.f;
      }
    }
  }
}

namespace {

// ---- driver ------------------------------------------------------------------------------

struct DenseJob {
  const DenseProblem* p;
  const KernelSet* ks;
  Epilogue ep;
  int64_t tm, tn;            // task grid
  int64_t m_units, n_units;  // rows / columns in units of mr / nr
  mutable std::atomic<bool> failed{false};
  // AMX: all of A packed as tiles once per call (pack_a_shared), or null (each task packs
  // its own rows per column block).
  const float* a_tiles = nullptr;
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Whether the pair kernels may read A's slivers in place (bf16 pairs are adjacent when A's
// columns are), saving the packing of A: only where the sliver's mr row pieces (kc k each)
// take no more lines of any L1 set than the packed sliver does. The L1 data caches of
// AVX-512 CPUs have 64 sets of 64-byte lines (4 KB a way), and a packed sliver of S bytes
// takes ceil(S / 4 KB) lines of each set. Row pieces a multiple of 4 KB apart pile into the
// same sets and evict each other and B's lines: on Zen 5, reading A in place anyway took
// 1.19-1.21x the time at K = 2048 and 4096; where this allows it, 0.92-0.94x at K = 1024
// and 0.94-0.97x at K = 256 and 512 (call-by-call pairs, bench/CPU_NOTES.md 42). Other
// slivers and kc blocks shift every piece alike, so one sliver's count holds for all when
// those shifts are whole lines; otherwise each piece is taken one line longer. One line a
// set beyond the packed sliver's is allowed: a piece that starts inside a line (A not
// 64-byte aligned) takes one more.
bool a_in_place(const ConstMatrix& a, int64_t K, int64_t kc, int mr) {
  if (a.dtype != DType::bf16 || a.col_stride != 1 || K % 2 != 0) return false;
  constexpr int64_t kLine = 64, kSets = 64;
  const int64_t stride = a.row_stride * 2, piece = kc * 2;
  if (stride < piece) return false;
  const int64_t packed = (mr * piece + kSets * kLine - 1) / (kSets * kLine);
  const bool whole_lines = (mr * stride) % kLine == 0 && piece % kLine == 0;
  const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data) % (kSets * kLine));
  int count[kSets] = {};
  int64_t next = 0;  // first line not yet counted (pieces go up in address)
  for (int i = 0; i < mr; ++i) {
    const int64_t lo = (base + i * stride) / kLine;
    const int64_t hi = (base + i * stride + piece - 1) / kLine + (whole_lines ? 0 : 1);
    for (int64_t l = std::max(lo, next); l <= hi; ++l)
      if (++count[l % kSets] > packed + 1) return false;
    next = hi + 1;
  }
  return true;
}

// AMX GEMMs of many rows (tasks of more than kKinRows) with A packed once for the call
// (pack_a_shared), by K:
//  * K over kc_whole, up to kKinWholeK: one K block, in column blocks narrow enough that B for
//    all of K (kKinWholeB bytes) stays in L2 while every row passes it (run_block_kin); no
//    partial sums through memory. Against blocks of 256 k and 1024 columns on the 2-core Xeon
//    VM (bench/CPU_NOTES.md 62; call-by-call pairs): 2048^3 0.88x the time.
//  * K over kKinWholeK: K in even blocks of at most kKinWholeK and B in blocks of kKinWholeB
//    bytes (256 columns at 2048 k), the task's rows (up to kBigKRows) passing each block before
//    the next, their fp32 partial sums through L3 (run_block's order, big_k_blocks). Against
//    K as one block up to 4096 (B at 1 MB: 128 columns at 4096, so each A sliver from L3 served
//    only 4 calls) and blocks of 256 k above (bench/CPU_NOTES.md 63): 4096^3 0.91x the time,
//    512 / 1024 x 4096 x 4096 0.89 / 0.94x, 2048 x 2048 x 8192 0.90x, K = 3072 0.96-1.00x.
constexpr int64_t kKinRows = 256;
constexpr int64_t kKinWholeK = 2048, kKinWholeB = int64_t(1) << 20;
constexpr int64_t kBigKRows = 8192;

bool kin_order(const DenseJob& job, int64_t rows) {
  const KernelSet& ks = *job.ks;
  const int64_t K = job.p->k;
  return ks.amx && job.a_tiles != nullptr && rows > kKinRows && K > ks.kc_whole && K <= kKinWholeK;
}

bool big_k_blocks(const DenseJob& job, int64_t rows) {
  return job.ks->amx && job.a_tiles != nullptr && rows > kKinRows && job.p->k > kKinWholeK;
}

// B's column block for K (or a K block) of kc: kKinWholeB bytes of pair panels.
int64_t kin_cols(int64_t kc, int nr) { return std::max<int64_t>(4 * nr, kKinWholeB / (2 * kc) / nr * nr); }

// kern_amx_next's prefetch of the next A sliver, at most this many lines a step of 32 k: a
// sliver's 32 over 8 or more calls (K up to 2048, B's 1 MB then 256 columns or more). On the
// 2-core Xeon VM (call-by-call pairs, bench/CPU_NOTES.md 63): 2048^3 0.95-0.98x the time,
// 4096 x 4096 x 1536 0.97x; with 7 or 8 lines a step (K = 3072 and 4096 as one block, before
// those went to big_k_blocks) 0.97-1.07x and 0.99x.
constexpr int kNextLines = 4;

void run_block_kin(const DenseJob& job, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi) {
  const DenseProblem& p = *job.p;
  const KernelSet& ks = *job.ks;
  const int mr = ks.mr, nr = ks.nr;
  const int64_t ku = p.k / 2;  // pairs; K % 32 == 0
  const int64_t sliver = ku * mr;  // floats of one 32-row A sliver
  const int64_t ncb = std::min(kin_cols(p.k, nr), round_up(n_hi - n_lo, nr));
  float* bp = scratch(0, size_t(ku * ncb));
  alignas(64) float tile[16 * 64];
  for (int64_t jc = n_lo; jc < n_hi; jc += ncb) {
    const int64_t nc = std::min(ncb, n_hi - jc);
    p.pack_b_pairs(p.b_ctx, 0, p.k, jc, nc, nr, bp);
    // The next sliver of A (the task's first one after its last, for the next column block)
    // comes into L2 in parts, one per call of this sliver, where that takes at most
    // kNextLines lines a step.
    const int64_t calls = (nc + nr - 1) / nr;
    const int lines = int((mr + calls - 1) / calls);  // a sliver: mr lines per 32 k
    for (int64_t ir = m_lo; ir < m_hi; ir += mr) {
      const int m = int(std::min<int64_t>(mr, m_hi - ir));
      const float* a_sl = job.a_tiles + ir / mr * sliver;
      const float* next = nullptr;
      if (lines <= kNextLines && ir + mr < m_hi) next = a_sl + sliver;
      else if (lines <= kNextLines && jc + ncb < n_hi) next = job.a_tiles + m_lo / mr * sliver;
      for (int64_t jr = 0; jr < nc; jr += nr) {
        const float* b_sl = bp + jr * ku;
        if (next != nullptr) {
          const char* part = reinterpret_cast<const char*>(next) + jr / nr * lines * 64 * (ku / 16);
          ks.kern_next[m](ku, a_sl, b_sl, nr, nullptr, 0, tile, nr, part, lines);
        } else {
          ks.kern[m](ku, a_sl, b_sl, nr, nullptr, 0, tile, nr);
        }
        job.ep.store(tile, nr, ir, m, jc + jr, std::min<int64_t>(nr, nc - jr));
      }
    }
  }
}

// AMX, a task of at most kKinRows rows (the weight-only GEMMs of M = 97..256, one row
// chunk): K in blocks of up to kFewRowsKc and B in blocks of kFewRowsNc columns instead of
// 512 and 1024. The B panel stays 1 MB, the partial sums shrink from 1 MB to 272 KB, and
// they pass through memory a quarter as often; with 512 x 1024 both (2.3 MB with A's
// sliver) did not fit the 2 MB L2 together. On the 2-core Xeon VM (bench/CPU_NOTES.md 62;
// one process, 4 rounds), the weight-only dense path's time: M = 256 int8 per channel
// 0.88-0.90x (K = 4096, 11008), int4 g128 0.86-0.87x (8192 x 28672); M = 128 0.83x.
// kc 1024 or nc 512 gained about half as much; a B panel of 2 MB (kc 2048 x nc 512, kc 4096
// x nc 256) took 1.3-1.4x the time.
constexpr int64_t kFewRowsKc = 2048, kFewRowsNc = 256;

bool few_rows_blocks(const KernelSet& ks, int64_t rows) { return ks.amx && rows <= kKinRows; }

// KernelSet::a_once: a row chunk's kc block of A is packed once and every column block of
// the task passes over it (B packed per column block, as before), so each element of A is
// packed once per row chunk instead of once per column block of nc columns. The partial sums
// then span the task's columns (in L3, as the mch x nc ones of 2040-row chunks were), and the
// row chunks are as large as kAOnceWs bytes of them allow, evenly sized, so that B is packed
// once per chunk of up to ~4000 rows (2040 before). On the 2-core Xeon VM (fp32, 2 threads,
// call-by-call pairs, bench/CPU_NOTES.md 63): 2048^3 0.95x the time, 3072^3 0.94x, 4096^3
// 0.94x, M = 256..1024 at N = K = 4096 0.94-0.99x; also where the old order kept A packed for
// every column block (256 x 14336 x 4096 0.94x: one kc block of A stays in L2 across them).
// Where the task's columns are so many that the chunks would be short, B packed once per chunk
// costs more than A packed once per column block: the order is taken only where it packs no
// more elements of A and B together than the old one.
constexpr int64_t kAOnceWs = int64_t(32) << 20;
// At most this many rows a chunk (A's kc block 6 MB at kc 384), for narrow tasks.
constexpr int64_t kAOnceMaxRows = 4096;

// Rows per chunk in the a_once order: as many as kAOnceWs bytes of partial sums allow, up to
// kAOnceMaxRows, the chunks evenly sized.
int64_t a_once_chunk(int64_t rows, int64_t cols, int mr, int nr) {
  const int64_t ldw = round_up(cols, nr) + 16;
  const int64_t max_rows = std::max<int64_t>(
      mr, std::min(kAOnceMaxRows, kAOnceWs / (ldw * int64_t(sizeof(float)))) / mr * mr);
  const int64_t n = (rows + max_rows - 1) / max_rows;
  return round_up((rows + n - 1) / n, mr);
}

// keep_a: the old order would pack A only once (run_block's keep_a).
bool a_once_order(const DenseJob& job, int64_t rows, int64_t cols, int64_t ncb, int64_t mchb,
                  bool keep_a) {
  const KernelSet& ks = *job.ks;
  if (!ks.a_once || ks.bf16_pairs || job.a_tiles != nullptr || cols <= ncb) return false;
  const auto chunks = [rows](int64_t c) { return double((rows + c - 1) / c); };
  // Elements packed per element of K: A's rows once per column block (or once), B's columns
  // once per row chunk.
  const double before =
      double(rows) * (keep_a ? 1.0 : double((cols + ncb - 1) / ncb)) + double(cols) * chunks(mchb);
  const double after = double(rows) + double(cols) * chunks(a_once_chunk(rows, cols, ks.mr, ks.nr));
  return after <= before;
}

void run_block_a_once(const DenseJob& job, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi,
                      int64_t kcb, int64_t ncb) {
  const DenseProblem& p = *job.p;
  const KernelSet& ks = *job.ks;
  const int mr = ks.mr, nr = ks.nr;
  const int64_t K = p.k;
  const int64_t ldw = round_up(n_hi - n_lo, nr) + 16;  // padded, as in run_block
  const int64_t mchb = a_once_chunk(m_hi - m_lo, n_hi - n_lo, mr, nr);
  float* bp = scratch(0, size_t(kcb * ncb));
  float* ap = scratch(1, size_t(kcb * round_up(mchb, mr)));
  float* ws = K > kcb ? scratch(2, size_t(mchb * ldw)) : nullptr;
  alignas(64) float tile[16 * 64];
  for (int64_t mo = m_lo; mo < m_hi; mo += mchb) {
    const int64_t mch = std::min(mchb, m_hi - mo);
    for (int64_t pc = 0; pc < K; pc += kcb) {
      const int64_t kc = std::min(kcb, K - pc);
      const bool first = pc == 0, last = pc + kc == K;
      pack_a(p.a, mo, mch, pc, kc, mr, ap);
      for (int64_t jc = n_lo; jc < n_hi; jc += ncb) {
        const int64_t nc = std::min(ncb, n_hi - jc);
        p.pack_b(p.b_ctx, pc, kc, jc, nc, nr, bp);
        for (int64_t ir = 0; ir < mch; ir += mr) {
          const int m = int(std::min<int64_t>(mr, mch - ir));
          const float* a_sl = ap + ir * kc;
          for (int64_t jr = 0; jr < nc; jr += nr) {
            float* w = ws ? ws + ir * ldw + (jc - n_lo) + jr : nullptr;
            if (last) {
              ks.kern[m](kc, a_sl, bp + jr * kc, nr, first ? nullptr : w, ldw, tile, nr);
              job.ep.store(tile, nr, mo + ir, m, jc + jr, std::min<int64_t>(nr, nc - jr));
            } else {
              ks.kern[m](kc, a_sl, bp + jr * kc, nr, first ? nullptr : w, ldw, w, ldw);
            }
          }
        }
      }
    }
  }
}

void run_block(const DenseJob& job, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi) {
  const DenseProblem& p = *job.p;
  const KernelSet& ks = *job.ks;
  const int mr = ks.mr, nr = ks.nr;
  const int64_t K = p.k;
  if (kin_order(job, m_hi - m_lo)) return run_block_kin(job, m_lo, m_hi, n_lo, n_hi);
  // Even kc blocks: a K of 400 becomes 2 x 200, not 384 + 16.
  const bool few = few_rows_blocks(ks, m_hi - m_lo), big_k = big_k_blocks(job, m_hi - m_lo);
  const int64_t kc_max = few ? kFewRowsKc : big_k ? kKinWholeK : ks.kc;
  const int64_t npc = K <= ks.kc_whole ? 1 : (K + kc_max - 1) / kc_max;
  const int64_t kcb = round_up((K + npc - 1) / npc, ks.amx ? 32 : 4);  // AMX: K % 32 == 0
  const int64_t ncb =
      std::min(few ? kFewRowsNc : big_k ? kin_cols(kcb, nr) : ks.nc, round_up(n_hi - n_lo, nr));
  // Row chunks of even size: 2048 rows become 2 x 1032, not 2040 + 8 (each chunk packs
  // the B panels again).
  const int64_t mch_max = big_k ? kBigKRows : ks.mch;
  const int64_t nmch = (m_hi - m_lo + mch_max - 1) / mch_max;
  const int64_t mchb = std::min(mch_max, round_up((m_hi - m_lo + nmch - 1) / nmch, mr));
  // Panel rows: k for fp32 panels, pairs of k for bf16 pair panels (32-bit units).
  const bool pairs = ks.bf16_pairs;
  const int64_t kub = pairs ? (kcb + 1) / 2 : kcb;
  // With one chunk of rows and several column blocks, A's panels for every kc block are
  // kept and packed only for the first column block (else each column block packs them
  // again), as long as they fit kKeepA bytes: 2 % of the time of an M = 256 weight-only
  // GEMM went into packing A again (bench/CPU_NOTES.md, 20).
  constexpr int64_t kKeepA = int64_t(16) << 20;
  const bool rows = pairs && ks.kern_rows[1] != nullptr && a_in_place(p.a, K, kcb, mr);
  const uint16_t* a16 = static_cast<const uint16_t*>(p.a.data);
  const bool keep_a = !rows && job.a_tiles == nullptr && m_hi - m_lo <= mchb && n_hi - n_lo > ncb &&
                      npc * kub * mchb * int64_t(sizeof(float)) <= kKeepA;
  if (a_once_order(job, m_hi - m_lo, n_hi - n_lo, ncb, mchb, keep_a))
    return run_block_a_once(job, m_lo, m_hi, n_lo, n_hi, kcb, ncb);
  float* bp = scratch(0, size_t(kub * ncb));
  float* ap_all = rows || job.a_tiles ? nullptr : scratch(1, size_t(kub * mchb * (keep_a ? npc : 1)));
  // The partial sums' rows padded by 16 floats: with ncb = 1024 the 16 rows of a tile load or
  // store lay 4 KB apart, in one L1 set (0.96-0.98x the time at 2048^3 to 4096^3, 0.985x at
  // M = 256: bench/CPU_NOTES.md 60).
  const int64_t ldw = ncb + 16;
  float* ws = npc > 1 ? scratch(2, size_t(mchb * ldw)) : nullptr;
  alignas(64) float tile[16 * 64];

  for (int64_t jc = n_lo; jc < n_hi; jc += ncb) {
    const int64_t nc = std::min(ncb, n_hi - jc);
    const int64_t calls = (nc + nr - 1) / nr;
    const int lines = int((mr + calls - 1) / calls);  // an A sliver: mr lines per 32 k (AMX)
    for (int64_t mo = m_lo; mo < m_hi; mo += mchb) {
      const int64_t mch = std::min(mchb, m_hi - mo);
      for (int64_t pc = 0; pc < K; pc += kcb) {
        const int64_t kc = std::min(kcb, K - pc);
        const bool first = pc == 0, last = pc + kc == K;
        const int64_t ku = pairs ? (kc + 1) / 2 : kc;
        float* ap = keep_a ? ap_all + pc / kcb * kub * mchb : ap_all;
        const bool pack_a_now = ap_all != nullptr && (!keep_a || jc == n_lo);
        if (pairs) {
          p.pack_b_pairs(p.b_ctx, pc, kc, jc, nc, nr, bp);
          if (pack_a_now && ks.amx) pack_a_tiles_bf16(p.a, mo, mch, pc, kc, mr, ap);
          else if (pack_a_now) pack_a_pairs(p.a, mo, mch, pc, kc, mr, ap);
        } else {
          p.pack_b(p.b_ctx, pc, kc, jc, nc, nr, bp);
          if (pack_a_now) pack_a(p.a, mo, mch, pc, kc, mr, ap);
        }
        for (int64_t ir = 0; ir < mch; ir += mr) {
          const int m = int(std::min<int64_t>(mr, mch - ir));
          // job.a_tiles: the sliver of rows mo + ir in K order, block pc at 16 * pc (mr 32).
          const float* a_sl = rows         ? nullptr
                              : job.a_tiles ? job.a_tiles + (mo + ir) / mr * (K / 2) * mr + pc / 2 * mr
                                            : ap + ir * ku;
          const uint16_t* a_rows = rows ? a16 + (mo + ir) * p.a.row_stride + pc : nullptr;
          // big_k: the same kc block of the next sliver (or the chunk's first sliver's next
          // block) into L2 during this sliver's calls, as in run_block_kin.
          const float* next = nullptr;
          if (big_k && lines <= kNextLines && ir + mr < mch) next = a_sl + (K / 2) * mr;
          else if (big_k && lines <= kNextLines && !last) next = job.a_tiles + mo / mr * (K / 2) * mr + (pc + kc) / 2 * mr;
          const auto kern = [&](int64_t jr, const float* in, float* out, int64_t ldout) {
            const float* b_sl = bp + jr * ku;
            if (rows) {
              ks.kern_rows[m](ku, a_rows, p.a.row_stride, b_sl, nr, in, ldw, out, ldout);
            } else if (next != nullptr) {
              const char* part = reinterpret_cast<const char*>(next) + jr / nr * lines * 64 * (ku / 16);
              ks.kern_next[m](ku, a_sl, b_sl, nr, in, ldw, out, ldout, part, lines);
            } else {
              ks.kern[m](ku, a_sl, b_sl, nr, in, ldw, out, ldout);
            }
          };
          for (int64_t jr = 0; jr < nc; jr += nr) {
            float* w = ws ? ws + ir * ldw + jr : nullptr;
            if (last) {
              kern(jr, first ? nullptr : w, tile, nr);
              job.ep.store(tile, nr, mo + ir, m, jc + jr, std::min<int64_t>(nr, nc - jr));
            } else {
              kern(jr, first ? nullptr : w, w, ldw);
            }
          }
        }
      }
    }
  }
}

// ---- few rows: stream B ----------------------------------------------------------------

// With M <= kStreamMaxM every element of B is used by at most a few FMAs, so the GEMM is
// a pass over B and packing it would double the memory traffic. Instead each task walks
// its columns of B row after row (long contiguous runs that hardware prefetch follows)
// and accumulates into an M x width fp32 buffer that stays in L1/L2.
constexpr int64_t kStreamMaxM = 8;

struct StreamJob {
  const DenseProblem* p;
  const float* a;  // M x K fp32, contiguous
  Epilogue ep;
  int64_t tasks;
  mutable std::atomic<bool> failed{false};
};

#if PG_X86
// U rows of B per pass over the accumulators: fewer loads and stores of acc per FMA,
// as long as the M x U broadcast values stay in registers. Rows k0 .. k1 (k1 - k0 a
// multiple of U).
template <int M, int U>
PG_TARGET_AVX512 void stream_rows_avx512(const float* a, int64_t K, int64_t k0, int64_t k1,
                                         const char* b, int64_t ldb, DType t, int64_t w,
                                         float* acc) {
  const int64_t es = int64_t(dtype_size(t));
  for (int64_t k = k0; k < k1; k += U) {
    __m512 av[M][U];
    PG_UNROLL for (int m = 0; m < M; ++m)
      PG_UNROLL for (int u = 0; u < U; ++u) av[m][u] = _mm512_set1_ps(a[m * K + k + u]);
    const char* bk = b + k * ldb;
    for (int64_t j = 0; j < w; j += 16) {
      const __mmask16 mask = first_lanes(w - j);
      __m512 bv[U];
      PG_UNROLL for (int u = 0; u < U; ++u) bv[u] = load16_avx512(bk + u * ldb + j * es, t, mask);
      PG_UNROLL for (int m = 0; m < M; ++m) {
        __m512 c = _mm512_maskz_loadu_ps(mask, acc + m * w + j);
        PG_UNROLL for (int u = 0; u < U; ++u) c = _mm512_fmadd_ps(av[m][u], bv[u], c);
        _mm512_mask_storeu_ps(acc + m * w + j, mask, c);
      }
    }
  }
}

template <int M>
void stream_rows_avx512(const float* a, int64_t K, const char* b, int64_t ldb, DType t,
                        int64_t w, float* acc) {
  constexpr int U = M <= 4 ? 4 : 2;
  const int64_t kmain = K / U * U;
  stream_rows_avx512<M, U>(a, K, 0, kmain, b, ldb, t, w, acc);
  // Leftover rows one at a time: padding them with zero weights would turn an inf in
  // B into NaN.
  stream_rows_avx512<M, 1>(a, K, kmain, K, b, ldb, t, w, acc);
}
#endif

void stream_rows_generic(const float* a, int64_t M, int64_t K, const char* b, int64_t ldb,
                         DType t, int64_t w, float* acc) {
  float* row = scratch(5, size_t(w));
  for (int64_t k = 0; k < K; ++k) {
    convert_to_f32(b + k * ldb, 1, t, w, row);
    for (int64_t m = 0; m < M; ++m) {
      const float am = a[m * K + k];
      float* c = acc + m * w;
      for (int64_t j = 0; j < w; ++j) c[j] += am * row[j];
    }
  }
}

void stream_task_impl(const StreamJob& job, int64_t begin, int64_t end) {
  const DenseProblem& p = *job.p;
  const ConstMatrix& b = *p.b_matrix;
  const int64_t es = int64_t(dtype_size(b.dtype));
  const int64_t units = (p.n + 15) / 16;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t lo = std::min(p.n, units * t / job.tasks * 16);
    const int64_t hi = std::min(p.n, units * (t + 1) / job.tasks * 16);
    if (hi <= lo) continue;
    const int64_t w = hi - lo;
    float* acc = scratch(0, size_t(p.m * w));
    std::memset(acc, 0, size_t(p.m * w) * sizeof(float));
    const char* bb = static_cast<const char*>(b.data) + lo * es;
    const int64_t ldb = b.row_stride * es;
#if PG_X86
    if (active_isa() == Isa::avx512) {
      switch (p.m) {
        case 1: stream_rows_avx512<1>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 2: stream_rows_avx512<2>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 3: stream_rows_avx512<3>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 4: stream_rows_avx512<4>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 5: stream_rows_avx512<5>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 6: stream_rows_avx512<6>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        case 7: stream_rows_avx512<7>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
        default: stream_rows_avx512<8>(job.a, p.k, bb, ldb, b.dtype, w, acc); break;
      }
    } else
#endif
    {
      stream_rows_generic(job.a, p.m, p.k, bb, ldb, b.dtype, w, acc);
    }
    job.ep.store(acc, w, 0, p.m, lo, w);
  }
}

void stream_task(void* ctx, int64_t begin, int64_t end) {
  const StreamJob& job = *static_cast<const StreamJob*>(ctx);
  guarded(job.failed, [&] { stream_task_impl(job, begin, end); });
}

bool stream_gemm(const DenseProblem& p, const Epilogue& ep, const Executor& exec) {
  StreamJob job{&p, nullptr, ep, 1};
  float* a = scratch(4, size_t(p.m * p.k));
  const int64_t es = int64_t(dtype_size(p.a.dtype));
  for (int64_t m = 0; m < p.m; ++m)
    convert_to_f32(static_cast<const char*>(p.a.data) + m * p.a.row_stride * es, p.a.col_stride,
                   p.a.dtype, p.k, a + m * p.k);
  job.a = a;
  const int64_t threads = executor_threads(exec);
  job.tasks = std::max<int64_t>(1, std::min(threads, (p.n + 255) / 256));
  if (p.n * p.k < (1 << 18)) job.tasks = 1;  // under ~50 us: not worth a pool wake-up
  if (job.tasks > 1 && exec.parallel_for != nullptr)
    run_tasks(exec, 0, job.tasks, 1, stream_task, &job);
  else
    stream_task(&job, 0, job.tasks);
  return !job.failed.load();
}

void dense_task_impl(const DenseJob& job, int64_t begin, int64_t end) {
  const DenseProblem& p = *job.p;
  const int mr = job.ks->mr, nr = job.ks->nr;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t ti = t / job.tn, tj = t % job.tn;
    const int64_t m_lo = std::min(p.m, job.m_units * ti / job.tm * mr);
    const int64_t m_hi = std::min(p.m, job.m_units * (ti + 1) / job.tm * mr);
    const int64_t n_lo = std::min(p.n, job.n_units * tj / job.tn * nr);
    const int64_t n_hi = std::min(p.n, job.n_units * (tj + 1) / job.tn * nr);
    if (m_hi > m_lo && n_hi > n_lo) run_block(job, m_lo, m_hi, n_lo, n_hi);
  }
}

void dense_task(void* ctx, int64_t begin, int64_t end) {
  const DenseJob& job = *static_cast<const DenseJob*>(ctx);
  guarded(job.failed, [&] {
    const AmxScope amx(job.ks->amx);
    dense_task_impl(job, begin, end);
  });
}

// AMX, A packed once for the whole call: tasks take slivers of 32 rows [s0, s1) over all of
// K (pack_a_tiles_bf16's layout of K as one block is that of its kc blocks laid end to end,
// so every task can take any of its kc blocks from it).
struct APackJob {
  const ConstMatrix* a;
  int64_t m, k;
  float* dst;
  mutable std::atomic<bool> failed{false};
};

void a_pack_task(void* ctx, int64_t s0, int64_t s1) {
  const APackJob& job = *static_cast<const APackJob*>(ctx);
  guarded(job.failed, [&] {
    const int64_t r0 = s0 * 32, r1 = std::min(job.m, s1 * 32);
    pack_a_tiles_bf16(*job.a, r0, r1 - r0, 0, job.k, 32, job.dst + s0 * 16 * job.k);
  });
}

// Where tasks split N (or a task walks several column blocks), each packs all of its rows
// of A once per column block: twice per task at 4096^3 on 2 threads, 9-12 % of the call on
// the 2-core Xeon VM of bench/CPU_NOTES.md 49. Packed once here instead, the threads taking
// slivers of rows, when it takes at most kSharedAMax bytes (the caller's scratch slot 4, read
// by every task while the caller waits in parallel_for; no dense task uses that slot).
constexpr int64_t kSharedAMax = int64_t(64) << 20;

const float* pack_a_shared(const DenseProblem& p, const DenseJob& job, const Executor& exec,
                           int64_t threads) {
  const KernelSet& ks = *job.ks;
  const bool packs_again = job.tn > 1 || p.n > job.tn * ks.nc;
  if (!ks.amx || !packs_again || p.m * p.k * 2 > kSharedAMax) return nullptr;
  APackJob pj{&p.a, p.m, p.k, scratch(4, size_t(job.m_units * 16 * p.k))};
  if (threads > 1 && exec.parallel_for != nullptr)
    run_tasks(exec, 0, job.m_units, 1, a_pack_task, &pj);
  else
    a_pack_task(&pj, 0, job.m_units);
  return pj.failed.load() ? nullptr : pj.dst;
}

// c = act(bias) (or act(0)): the K == 0 case.
void fill_epilogue(const Epilogue& ep, int64_t m, int64_t n) {
  alignas(64) float zeros[256] = {};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; j += 256)
      ep.store(zeros, 0, i, 1, j, std::min<int64_t>(256, n - j));
}

}  // namespace

bool dense_gemm(const DenseProblem& p, const Executor& exec) {
  Epilogue ep;
  ep.act = p.act;
  ep.c = p.c;
  ep.col_scale = p.col_scale;
  if (p.bias != nullptr) {
    // The caller's scratch: workers only read it while the caller waits in parallel_for.
    float* b = scratch(3, size_t(p.n));
    convert_to_f32(p.bias, p.bias_stride, p.c.dtype, p.n, b);
    ep.bias = b;
  }
  if (p.k == 0) {
    fill_epilogue(ep, p.m, p.n);
    return true;
  }
  if (p.b_matrix != nullptr && p.b_matrix->col_stride == 1 && p.m <= kStreamMaxM)
    return stream_gemm(p, ep, exec);
  const KernelSet* pair_set = bf16_kernel_set();
  const bool use_pairs = pair_set != nullptr && p.pack_b_pairs != nullptr && p.a.dtype == DType::bf16;
  const KernelSet* amx_set = use_pairs && p.k % 32 == 0 ? amx_kernel_set() : nullptr;
  const KernelSet& ks = amx_set ? *amx_set : use_pairs ? *pair_set : kernel_set();
  DenseJob job{&p, &ks, ep, 1, 1, (p.m + ks.mr - 1) / ks.mr, (p.n + ks.nr - 1) / ks.nr};
  int64_t threads = executor_threads(exec);
  // Waking a pool costs ~10 us: below ~128^3 (measured break-even, 40 us of work) one
  // thread is as fast.
  if (double(p.m) * double(p.n) * double(p.k) < 128.0 * 128.0 * 128.0) threads = 1;
  if (threads > 1 && exec.parallel_for != nullptr) {
    // Split N first (each task then packs A on its own, which is cheap next to its
    // share of the FLOPs); split M only when N alone cannot feed every thread.
    job.tn = std::min(threads, job.n_units);
    job.tm = std::min(std::max<int64_t>(1, threads / job.tn), job.m_units);
    job.a_tiles = pack_a_shared(p, job, exec, threads);
    run_tasks(exec, 0, job.tm * job.tn, 1, dense_task, &job);
  } else {
    job.a_tiles = pack_a_shared(p, job, exec, 1);
    dense_task(&job, 0, 1);
  }
  return !job.failed.load();
}

Status gemm(const GemmArgs& args, const Executor& exec) {
  const ScratchUse use;
  Status st = validate_gemm(args);
  if (!st.ok()) return st;
  DenseProblem p;
  p.m = args.a.rows;
  p.n = args.b.cols;
  p.k = args.a.cols;
  if (p.m == 0 || p.n == 0) return st;
  p.a = args.a;
  p.pack_b = pack_b_dense;
  p.b_ctx = &args.b;
  p.b_matrix = &args.b;
  if (args.b.dtype == DType::bf16) p.pack_b_pairs = pack_b_pairs_dense;
  p.bias = args.bias;
  p.bias_stride = args.bias_stride;
  p.c = args.c;
  p.act = args.activation;
  bool ok = false;
  try {
    ok = dense_gemm(p, exec);
  } catch (...) {  // bad_alloc on the calling thread
  }
  return ok ? st : Status{2, "gemm: out of memory (scratch buffers)"};
}

}  // namespace cpu
}  // namespace portable_gemm
