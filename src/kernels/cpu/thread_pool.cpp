// The library's own thread pool, used by callers that have no torch parallel_for to
// lend (old torch targets, the DLPack module).
//
// Three situations shape this file:
//  * fork(): a child inherits the pool's memory but not its threads. A pthread_atfork
//    handler drops the child's pointer to the pool, so the child lazily builds a fresh
//    one; the stale pool is never touched (its mutexes may be locked by threads that no
//    longer exist, and its workers cannot be joined).
//  * process exit: the pool is leaked on purpose. Joining workers from a static
//    destructor can deadlock (e.g. exit() called from a worker or while another thread
//    still holds the pool) and destroying a condition variable that sleeping threads
//    wait on is undefined; the OS reclaims the threads at exit anyway.
//  * re-entrancy: a body that calls parallel_for again (from a worker or from the
//    calling thread) runs the inner loop inline, and a second thread that calls while a
//    job is running also runs inline, rather than queueing behind it.
//  * wake-up latency: a worker blocked on a condition variable takes tens of microseconds
//    to run again (longer on a VM, whose idle vCPU has halted), which is the whole budget of
//    a small call. After each job, workers (and the caller waiting for them) spin for a
//    short while (kSpin) before blocking, as OpenMP runtimes do.
//  * size: PORTABLE_GEMM_NUM_THREADS, else what portable_gemm_set_pool_threads asked for
//    (the Python package passes torch.get_num_threads() on torch targets without a stable
//    parallel_for), else the hardware concurrency. A pool's size is fixed, so a new size
//    switches to a pool of that size; the others stay (one per size ever asked for, their
//    workers asleep), since a call may still be running on them.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if !defined(_WIN32)
#include <pthread.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "portable_gemm/kernels.h"

namespace portable_gemm {

namespace {

// True on pool workers and on a caller while it drives a job: nested calls run inline.
thread_local bool t_inside_pool = false;

// How long a worker polls for the next job, and the caller for the workers, before
// blocking.
constexpr std::chrono::microseconds kSpin{200};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls ready() for up to kSpin; true as soon as it holds.
template <class Ready>
bool spin_until(Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return ready();
  }
}

constexpr int kMaxThreads = 1024;

// PORTABLE_GEMM_NUM_THREADS, or 0 when unset or malformed.
int env_threads() {
  if (const char* env = std::getenv("PORTABLE_GEMM_NUM_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && v >= 1) return v > kMaxThreads ? kMaxThreads : static_cast<int>(v);
  }
  return 0;
}

// The size asked for through portable_gemm_set_pool_threads (0: none yet).
std::atomic<int> g_requested{0};

int configured_threads() {
  if (const int env = env_threads()) return env;
  if (const int req = g_requested.load(std::memory_order_relaxed)) return req;
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc > unsigned(kMaxThreads) ? kMaxThreads : hc);
}

class Pool {
 public:
  explicit Pool(int nthreads) : nthreads_(nthreads) {
    for (int i = 1; i < nthreads_; ++i) {
      std::thread t([this] { worker(); });
      t.detach();  // never joined: see the comment at the top of the file
    }
  }

  int num_threads() const { return nthreads_; }

  void run(int64_t begin, int64_t end, int64_t grain, Executor::Body body, void* ctx) {
    if (end <= begin) return;
    if (grain < 1) grain = 1;
    const int64_t n = end - begin;
    int64_t nchunks = (n + grain - 1) / grain;
    if (nchunks > nthreads_) nchunks = nthreads_;
    if (nchunks <= 1 || t_inside_pool) {
      body(ctx, begin, end);
      return;
    }
    std::unique_lock<std::mutex> caller_lock(caller_mu_, std::try_to_lock);
    if (!caller_lock.owns_lock()) {  // another thread is using the pool: do not wait
      body(ctx, begin, end);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      body_ = body;
      ctx_ = ctx;
      begin_ = begin;
      end_ = end;
      nchunks_ = nchunks;
      next_.store(0, std::memory_order_relaxed);
      // Every worker acknowledges every job, so none can still be looking at this job's
      // fields when the next one overwrites them.
      pending_workers_.store(nthreads_ - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);  // publishes the fields above
    }
    work_cv_.notify_all();  // for workers that stopped spinning
    t_inside_pool = true;
    run_chunks();
    t_inside_pool = false;
    auto all_done = [this] { return pending_workers_.load(std::memory_order_acquire) == 0; };
    if (spin_until(all_done)) return;
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, all_done);
  }

 private:
  void run_chunks() {
    for (;;) {
      int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= nchunks_) return;
      // Balanced split: chunk sizes differ by at most one item.
      const int64_t n = end_ - begin_;
      const int64_t lo = begin_ + n * i / nchunks_;
      const int64_t hi = begin_ + n * (i + 1) / nchunks_;
      if (hi > lo) body_(ctx_, lo, hi);
    }
  }

  void worker() {
    t_inside_pool = true;
    uint64_t seen = 0;
    for (;;) {
      auto job_posted = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(job_posted)) {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, job_posted);
      }
      seen = generation_.load(std::memory_order_acquire);
      run_chunks();
      if (pending_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // Under mu_: the caller either sees the count at 0 or is already waiting.
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  const int nthreads_;
  std::mutex caller_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped (under mu_) once per job
  std::atomic<int> pending_workers_{0};
  // Job description, written under mu_ before generation_ changes.
  Executor::Body body_ = nullptr;
  void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, nchunks_ = 0;
  std::atomic<int64_t> next_{0};
};

std::atomic<Pool*> g_pool{nullptr};  // the pool in use
std::mutex g_create_mu;
Pool* g_by_size[kMaxThreads + 1] = {};  // every pool built, by size (under g_create_mu)

// The pool of n threads, built on first use. Caller holds g_create_mu.
Pool* pool_of_size(int n) {
  if (g_by_size[n] == nullptr) g_by_size[n] = new Pool(n);  // intentionally leaked
  return g_by_size[n];
}

#if !defined(_WIN32)
// Holding g_create_mu across fork() keeps the child from inheriting it locked by a
// thread that does not exist there.
void atfork_prepare() { g_create_mu.lock(); }
void atfork_parent() { g_create_mu.unlock(); }
void atfork_child() {
  g_pool.store(nullptr, std::memory_order_relaxed);  // leak the parent's pools
  for (Pool*& p : g_by_size) p = nullptr;
  t_inside_pool = false;
  g_create_mu.unlock();
}
#endif

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  std::lock_guard<std::mutex> lk(g_create_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
#if !defined(_WIN32)
    static const bool registered = [] {
      pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
      return true;
    }();
    (void)registered;
#endif
    p = pool_of_size(configured_threads());  // leaked, see top of file
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

void pool_parallel_for(void*, int64_t begin, int64_t end, int64_t grain, Executor::Body body,
                       void* ctx) {
  pool().run(begin, end, grain, body, ctx);
}

int pool_num_threads(void*) { return pool().num_threads(); }

}  // namespace

extern "C" PG_API int portable_gemm_set_pool_threads(int n) {
  std::lock_guard<std::mutex> lk(g_create_mu);
  if (n >= 1) g_requested.store(n > kMaxThreads ? kMaxThreads : n, std::memory_order_relaxed);
  const int size = configured_threads();
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr && p->num_threads() != size) g_pool.store(pool_of_size(size), std::memory_order_release);
  return size;
}

const Executor& builtin_executor() {
  static const Executor exec = [] {
    Executor e;
    e.parallel_for = pool_parallel_for;
    e.num_threads = pool_num_threads;
    e.self = nullptr;
    e.name = "portable_gemm_pool";
    return e;
  }();
  return exec;
}

}  // namespace portable_gemm
