// Target 2.9's CPU threading: torch's own OpenMP runtime, borrowed. 2.9 has no stable
// parallel_for, but torch's Linux and macOS wheels run at::parallel_for on OpenMP, and
// the runtime libtorch_cpu links (libgomp; LLVM's libomp exports the same GOMP entry
// points) is already loaded. Calling its GOMP_parallel the way at::parallel_for does puts
// our work on torch's threads, at torch's thread count, so our ops and torch's share one
// pool. The own pool beside it loses to OpenMP's spin-waiting workers: after any torch op
// they spin for milliseconds, and a 1024^3 fp32 gemm right after a torch op took 2.2x as
// long on the own pool (bench/CPU_NOTES.md 43). Included by threading.h for 2.9 only.
//
// The library's own pool instead, with the reason in info()["features"]["threading_why"]:
//  * PORTABLE_GEMM_POOL=own, or PORTABLE_GEMM_NUM_THREADS set (it sizes the own pool);
//  * no GOMP_parallel / omp_* entry points reachable from libtorch_cpu (Windows, a torch
//    built without OpenMP);
//  * in a child forked after this was set up (at import: info() builds it): GNU OpenMP is
//    not fork-safe (torch's own ops hang there too once the parent has used OpenMP), the own
//    pool is; info() asked in the child says so (threading.h, cpu_executor_name / _why).
//    A child forked before the import cannot be told apart; there our ops fare as torch's
//    own do (they hang where the parent ran an OpenMP team and the child asks for more than
//    one thread).
// OpenMP's count of threads is per thread: torch sets it on each thread at that thread's
// first parallel op (at::parallel_for's lazy init). The Python wrappers call
// torch.get_num_threads() once on each thread for the same effect (ops.py).
// OpenMP's ABI (GOMP_parallel, GCC >= 4.9) is the runtime's, not torch's: nothing here
// touches torch's unstable ABI.
#pragma once
#include <portable_gemm/kernels.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#define PG_TORCH_OPENMP_LOOKUP 1
#else
#define PG_TORCH_OPENMP_LOOKUP 0
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace portable_gemm::compat {

struct TorchOpenMp {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
  int (*num_threads)() = nullptr;  // omp_get_num_threads: the team's size, inside a region
  int (*thread_num)() = nullptr;
  int (*max_threads)() = nullptr;  // torch.get_num_threads() under OpenMP
  int (*in_parallel)() = nullptr;
  std::string why;  // info()'s "threading_why": which runtime, or why not
};

// Set in a child process after fork() (see the top of the file).
inline std::atomic<bool>& forked_child() {
  static std::atomic<bool> flag{false};
  return flag;
}

// The reason goes into info()'s JSON string as it is: printable ASCII only, no quotes or
// backslashes (an environment value or a file name may hold anything).
inline std::string json_safe(std::string s) {
  for (char& c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\' || u < 0x20 || u >= 0x7f) c = '?';
  }
  return s;
}

inline TorchOpenMp find_torch_openmp() {
  TorchOpenMp rt;
  const char* pool = std::getenv("PORTABLE_GEMM_POOL");
  if (pool != nullptr && std::strcmp(pool, "own") == 0) {
    rt.why = "PORTABLE_GEMM_POOL=own";
    return rt;
  }
  if (pool != nullptr && *pool != '\0' && std::strcmp(pool, "openmp") != 0) {
    rt.why = json_safe("PORTABLE_GEMM_POOL=" + std::string(pool) + " is neither 'own' nor 'openmp'");
    return rt;
  }
  if (env_pool_threads(std::getenv("PORTABLE_GEMM_NUM_THREADS")) != 0) {
    rt.why = "PORTABLE_GEMM_NUM_THREADS sizes the library's own pool";
    return rt;
  }
#if PG_TORCH_OPENMP_LOOKUP
  // The runtime torch's own calls bind to, searched in the dynamic linker's order: the
  // global scope first (the program, LD_PRELOAD, libraries loaded RTLD_GLOBAL: where e.g. a
  // preloaded libiomp5 takes over), then libtorch_cpu and the libraries it needs (reached
  // through its handle, found from one of its functions). All five entry points are then
  // taken from that one library.
  void* h = nullptr;
  Dl_info lib{};
  if (void* global = dlsym(RTLD_DEFAULT, "GOMP_parallel");
      global != nullptr && dladdr(global, &lib) != 0 && lib.dli_fname != nullptr && *lib.dli_fname)
    h = dlopen(lib.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) {
    Dl_info self{};
    void* anchor = reinterpret_cast<void*>(&aoti_torch_empty_strided);
    if (dladdr(anchor, &self) == 0 || self.dli_fname == nullptr) {
      rt.why = "libtorch_cpu not found among the loaded libraries";
      return rt;
    }
    h = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  }
  if (h == nullptr) {
    rt.why = "libtorch_cpu could not be reopened";
    return rt;
  }
  TorchOpenMp found = rt;
  found.parallel = reinterpret_cast<decltype(found.parallel)>(dlsym(h, "GOMP_parallel"));
  found.num_threads = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_num_threads"));
  found.thread_num = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_thread_num"));
  found.max_threads = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_max_threads"));
  found.in_parallel = reinterpret_cast<int (*)()>(dlsym(h, "omp_in_parallel"));
  dlclose(h);  // drops the reference RTLD_NOLOAD took; torch keeps it loaded
  if (!found.parallel || !found.num_threads || !found.thread_num || !found.max_threads ||
      !found.in_parallel) {
    rt.why = "torch's libraries export no GOMP_parallel (torch built without OpenMP)";
    return rt;
  }
  Dl_info where{};
  const char* file = dladdr(reinterpret_cast<void*>(found.parallel), &where) && where.dli_fname
                         ? where.dli_fname
                         : "?";
  const char* base = std::strrchr(file, '/');
  found.why = json_safe(std::string("GOMP_parallel of ") + (base ? base + 1 : file) +
                        ", the OpenMP runtime torch's own calls use");
  return found;
#else
  rt.why = "no OpenMP lookup on this platform";
  return rt;
#endif
}

inline const TorchOpenMp& torch_openmp() {
  static const TorchOpenMp rt = [] {
    TorchOpenMp r = find_torch_openmp();
#if PG_TORCH_OPENMP_LOOKUP
    if (r.parallel != nullptr)
      pthread_atfork(nullptr, nullptr, [] { forked_child().store(true, std::memory_order_relaxed); });
#endif
    return r;
  }();
  return rt;
}

// One parallel region of the OpenMP runtime, split like at::parallel_for: at most
// ceil(n / grain) threads, thread t the t-th contiguous chunk.
struct OmpRegion {
  const TorchOpenMp* rt;
  int64_t begin, end, grain;
  Executor::Body body;
  void* ctx;
  static void run(void* p) {
    const OmpRegion& r = *static_cast<const OmpRegion*>(p);
    const int64_t n = r.end - r.begin;
    const int64_t nt = std::min<int64_t>(r.rt->num_threads(), (n + r.grain - 1) / r.grain);
    const int64_t tid = r.rt->thread_num(), chunk = (n + nt - 1) / nt;
    const int64_t b = r.begin + tid * chunk;
    if (tid < nt && b < r.end) r.body(r.ctx, b, std::min(r.end, b + chunk));
  }
};

// In a forked child: the own pool, at the count torch's runtime reports (omp_get_max_threads
// reads a setting and starts nothing).
inline const Executor& child_pool(const TorchOpenMp& rt) {
  static std::atomic<int> sized{0};
  const int want = rt.max_threads();
  if (want != sized.load(std::memory_order_relaxed) && portable_gemm_set_pool_threads(want) > 0)
    sized.store(want, std::memory_order_relaxed);
  return builtin_executor();
}

inline void torch_openmp_parallel_for(void*, int64_t begin, int64_t end, int64_t grain,
                                      Executor::Body body, void* ctx) {
  const TorchOpenMp& rt = torch_openmp();
  if (forked_child().load(std::memory_order_relaxed)) {
    const Executor& pool = child_pool(rt);
    pool.parallel_for(pool.self, begin, end, grain, body, ctx);
    return;
  }
  if (end <= begin) return;
  if (grain < 1) grain = 1;
  if (end - begin <= grain || rt.in_parallel() || rt.max_threads() <= 1) {
    body(ctx, begin, end);
    return;
  }
  OmpRegion region{&rt, begin, end, grain, body, ctx};
  rt.parallel(&OmpRegion::run, &region, 0, 0);  // 0: the thread count torch set
}

inline int torch_openmp_num_threads(void*) {
  const TorchOpenMp& rt = torch_openmp();
  if (forked_child().load(std::memory_order_relaxed)) {
    const Executor& pool = child_pool(rt);
    return pool.num_threads(pool.self);
  }
  return rt.max_threads();
}

// True in a child forked after the executor was set up on torch's OpenMP: there our ops run
// on the own pool (torch_openmp_parallel_for), and info() says so.
inline bool torch_openmp_left_by_fork() {
  return torch_openmp().parallel != nullptr && forked_child().load(std::memory_order_relaxed);
}

// The executor of target 2.9, and the reason for it.
inline const Executor& torch_openmp_or_own_pool() {
  static const Executor exec = [] {
    const TorchOpenMp& rt = torch_openmp();
    if (rt.parallel == nullptr) return builtin_executor();
    Executor e;
    e.parallel_for = torch_openmp_parallel_for;
    e.num_threads = torch_openmp_num_threads;
    e.name = "torch_openmp";
    return e;
  }();
  return exec;
}

}  // namespace portable_gemm::compat
