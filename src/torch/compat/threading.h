// CPU threading. >= 2.10: torch's own pool through torch::stable::parallel_for, so
// torch.set_num_threads applies to us too. 2.9 has no stable parallel_for: the kernel
// library's own pool.
#pragma once
#include <portable_gemm/kernels.h>
#include <torch/csrc/stable/ops.h>
#include "compat/version.h"

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
#else
inline const Executor& cpu_executor() { return builtin_executor(); }
#endif

}  // namespace portable_gemm::compat
