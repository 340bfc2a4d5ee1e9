// CPU threading. >= 2.10: torch's own pool through torch::stable::parallel_for, so
// torch.set_num_threads applies to us too. 2.9 has no stable parallel_for: torch's OpenMP
// runtime called directly where it is found, else the kernel library's own pool
// (torch_openmp.h says when and why).
#pragma once
#include <portable_gemm/kernels.h>
#include <torch/csrc/stable/ops.h>
#include "compat/version.h"
#if !PG_TARGET_AT_LEAST_2_10
#include "compat/torch_openmp.h"
#endif

namespace portable_gemm::compat {

#if PG_TARGET_AT_LEAST_2_10
inline const Executor& cpu_executor() {
  static const Executor exec = [] {
    Executor e;
    e.parallel_for = [](void*, int64_t begin, int64_t end, int64_t grain, Executor::Body body,
                        void* ctx) {
      torch::stable::parallel_for(begin, end, grain,
                                  [&](int64_t b, int64_t e) { body(ctx, b, e); });
    };
    e.num_threads = [](void*) { return static_cast<int>(torch::stable::get_num_threads()); };
    e.name = "torch::stable::parallel_for";
    return e;
  }();
  return exec;
}
inline const char* cpu_executor_name() { return cpu_executor().name; }
inline const char* cpu_executor_why() { return "the stable parallel_for of torch >= 2.10"; }
#else
inline const Executor& cpu_executor() { return torch_openmp_or_own_pool(); }
// What runs our CPU ops now: in a child forked after the import, the own pool.
inline const char* cpu_executor_name() {
  return torch_openmp_left_by_fork() ? builtin_executor().name : cpu_executor().name;
}
inline const char* cpu_executor_why() {
  return torch_openmp_left_by_fork()
             ? "this process was forked after the import and GNU OpenMP is not fork-safe"
             : torch_openmp().why.c_str();
}
#endif

}  // namespace portable_gemm::compat
