// An Executor over OpenMP shaped like at::parallel_for's OpenMP backend (what the >= 2.10
// bindings reach through torch::stable::parallel_for on torch's Linux wheels): one
// `omp parallel` region per call, thread t takes the t-th contiguous chunk of
// ceil(n / threads) items, at most ceil(n / grain) threads. For probes that compare the
// library's own pool (builtin_executor, target 2.9) with torch's pool in one process.
// Build with -fopenmp.
#pragma once
#include <omp.h>

#include <algorithm>

#include "portable_gemm/kernels.h"

inline const portable_gemm::Executor& omp_executor() {
  static const portable_gemm::Executor e = [] {
    portable_gemm::Executor x;
    x.parallel_for = [](void*, int64_t begin, int64_t end, int64_t grain,
                        portable_gemm::Executor::Body body, void* ctx) {
      if (end <= begin) return;
      const int64_t n = end - begin;
      if (grain < 1) grain = 1;
      if (n <= grain || omp_get_max_threads() == 1 || omp_in_parallel()) {
        body(ctx, begin, end);
        return;
      }
#pragma omp parallel
      {
        int64_t nt = omp_get_num_threads();
        nt = std::min<int64_t>(nt, (n + grain - 1) / grain);
        const int64_t tid = omp_get_thread_num(), chunk = (n + nt - 1) / nt;
        const int64_t b = begin + tid * chunk;
        if (tid < nt && b < end) body(ctx, b, std::min(end, b + chunk));
      }
    };
    x.num_threads = [](void*) { return omp_get_max_threads(); };
    x.name = "omp (at::parallel_for shape)";
    return x;
  }();
  return e;
}
