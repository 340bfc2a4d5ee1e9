// The library's own thread pool, used by callers that have no torch parallel_for to
// lend: the DLPack module, and target 2.9 where torch's OpenMP runtime is not at hand
// (src/torch/compat/torch_openmp.h says when).
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
//    last (the Python package passes torch.get_num_threads() on torch targets without a
//    stable parallel_for), else the hardware concurrency. One pool per process: a larger
//    size adds workers (never more than the largest size asked for), a smaller one leaves
//    the extra workers asleep, and each job takes the first `active` threads. Workers
//    outside that set block without spinning on a condition variable jobs do not signal.
//    If a thread cannot be created, the pool keeps the threads it has.
#include <algorithm>
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
  const long v = env_pool_threads(std::getenv("PORTABLE_GEMM_NUM_THREADS"));
  return v > kMaxThreads ? kMaxThreads : static_cast<int>(v);
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
  explicit Pool(int nthreads) { resize(nthreads); }

  // Threads (the caller's included) of each job from now on: n, or as many as could be
  // created. New workers cannot be part of a job already posted (its participants are
  // counted below the capacity it saw), so no job has to finish first.
  int resize(int n) {
    int cap = capacity_.load(std::memory_order_relaxed);
    const uint64_t gen = word_.load(std::memory_order_acquire) >> kActBits;
    while (cap < n) {
      try {
        std::thread t([this, idx = cap, gen] { worker(idx, gen); });
        t.detach();  // never joined: see the comment at the top of the file
      } catch (...) {  // std::system_error: no more threads; keep those there are
        break;
      }
      ++cap;
    }
    int act;
    {
      std::lock_guard<std::mutex> lk(mu_);
      capacity_.store(cap, std::memory_order_relaxed);
      act = n < cap ? n : cap;
      active_.store(act, std::memory_order_relaxed);
    }
    idle_cv_.notify_all();  // workers that are now among the active ones
    return act;
  }

  int num_threads() const { return active_.load(std::memory_order_relaxed); }

  void run(int64_t begin, int64_t end, int64_t grain, Executor::Body body, void* ctx) {
    if (end <= begin) return;
    if (grain < 1) grain = 1;
    const int64_t n = end - begin;
    int64_t nchunks = (n + grain - 1) / grain;
    if (nchunks > num_threads()) nchunks = num_threads();
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
      std::unique_lock<std::mutex> lk(mu_);
      // The participants: the caller and workers 1 .. job_act - 1. Read under mu_, like
      // resize() writes it: a worker outside the active set sleeps on idle_cv_, which
      // only resize() signals, so a job must never count one that resize() did not wake.
      const int job_act = active_.load(std::memory_order_relaxed);
      if (nchunks > job_act) nchunks = job_act;
      if (nchunks <= 1) {  // shrunk meanwhile
        lk.unlock();
        caller_lock.unlock();
        body(ctx, begin, end);
        return;
      }
      body_ = body;
      ctx_ = ctx;
      begin_ = begin;
      end_ = end;
      nchunks_ = nchunks;
      next_.store(0, std::memory_order_relaxed);
      // Every participant acknowledges the job, so none can still be looking at its fields
      // when the next one overwrites them.
      pending_workers_.store(job_act - 1, std::memory_order_relaxed);
      const uint64_t gen = (word_.load(std::memory_order_relaxed) >> kActBits) + 1;
      word_.store(gen << kActBits | uint64_t(job_act), std::memory_order_release);  // publishes
    }
    work_cv_.notify_all();  // for active workers that stopped spinning
    t_inside_pool = true;
    run_chunks();
    t_inside_pool = false;
    auto all_done = [this] { return pending_workers_.load(std::memory_order_acquire) == 0; };
    if (spin_until(all_done)) return;
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, all_done);
  }

 private:
  // The job word: generation << kActBits | its participants (the caller included).
  static constexpr int kActBits = 11;
  static_assert(kMaxThreads < (1 << kActBits), "participants fit the job word");

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

  // Worker idx (1 ..), which has seen every job up to generation `seen`.
  void worker(int idx, uint64_t seen) {
    t_inside_pool = true;
    for (;;) {
      // A job of a later generation that counts this worker among its participants.
      auto mine = [&] {
        const uint64_t w = word_.load(std::memory_order_acquire);
        return (w >> kActBits) != seen && idx < int(w & ((1u << kActBits) - 1));
      };
      auto active = [&] { return idx < active_.load(std::memory_order_relaxed); };
      if (!mine()) {
        if (active()) {
          if (!spin_until([&] { return mine() || !active(); })) {
            std::unique_lock<std::mutex> lk(mu_);
            work_cv_.wait(lk, [&] { return mine() || !active(); });
          }
        } else {  // outside the active set: sleep until it grows (resize) or a job counts it
          std::unique_lock<std::mutex> lk(mu_);
          idle_cv_.wait(lk, [&] { return mine() || active(); });
        }
        if (!mine()) continue;
      }
      seen = word_.load(std::memory_order_acquire) >> kActBits;
      run_chunks();
      if (pending_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // Under mu_: the caller either sees the count at 0 or is already waiting.
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  std::atomic<int> capacity_{1};  // the caller plus the workers created
  std::atomic<int> active_{1};    // threads of each job from now on (<= capacity_)
  std::mutex caller_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_, idle_cv_;
  std::atomic<uint64_t> word_{0};  // the job word, bumped (under mu_) once per job
  std::atomic<int> pending_workers_{0};
  // Job description, written under mu_ before word_ changes.
  Executor::Body body_ = nullptr;
  void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, nchunks_ = 0;
  std::atomic<int64_t> next_{0};
};

std::atomic<Pool*> g_pool{nullptr};
std::mutex g_create_mu;

#if !defined(_WIN32)
// Holding g_create_mu across fork() keeps the child from inheriting it locked by a
// thread that does not exist there.
void atfork_prepare() { g_create_mu.lock(); }
void atfork_parent() { g_create_mu.unlock(); }
void atfork_child() {
  g_pool.store(nullptr, std::memory_order_relaxed);  // leak the parent's pool
  t_inside_pool = false;
  g_create_mu.unlock();
}
#endif

// The fork handlers, installed before anything here first takes g_create_mu (else a fork
// from another thread while it is held would leave it locked in the child).
void install_fork_handlers() {
#if !defined(_WIN32)
  static const bool registered = [] {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    return true;
  }();
  (void)registered;
#endif
}

// Installed at the library's load as well: glibc reads its list of handlers when a fork()
// starts, so a first pool use racing with a fork in another thread would install them too
// late for that fork, and its child would keep the parent's pool (whose workers it lacks).
[[maybe_unused]] const bool kForkHandlersAtLoad = (install_fork_handlers(), true);

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  install_fork_handlers();
  std::lock_guard<std::mutex> lk(g_create_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    p = new Pool(configured_threads());  // intentionally leaked, see top of file
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
  install_fork_handlers();
  try {
    std::lock_guard<std::mutex> lk(g_create_mu);
    if (n >= 1) g_requested.store(n > kMaxThreads ? kMaxThreads : n, std::memory_order_relaxed);
    const int size = configured_threads();
    Pool* p = g_pool.load(std::memory_order_acquire);
    return p != nullptr ? p->resize(size) : size;
  } catch (...) {  // nothing may cross the C boundary
    return 0;
  }
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
