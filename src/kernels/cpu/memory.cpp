// Memory advice for outputs the doors have just allocated (include/portable_gemm/kernels.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "portable_gemm/kernels.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace portable_gemm::cpu {

bool advise_new_output(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < kHugeOutputMinBytes) return false;
  // Read on every call (a getenv, against an output of megabytes), so that a process can
  // compare both settings.
  const char* env = std::getenv("PORTABLE_GEMM_HUGE_PAGES");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  // Only the huge pages that lie wholly inside the output: the advice never reaches memory
  // that is not ours.
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= begin) return false;
  // Advice only: a refusal (EINVAL on a kernel without THP) leaves small pages, as before.
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

}  // namespace portable_gemm::cpu
