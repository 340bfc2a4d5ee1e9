// Memory advice for outputs the doors have just allocated (include/portable_gemm/kernels.h).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "portable_gemm/kernels.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace portable_gemm::cpu {

#if defined(__linux__) && defined(MADV_HUGEPAGE)
namespace {
// The transparent huge page's size: 2 MiB on x86-64 and on aarch64 with 4 KiB pages, 512 MiB
// on aarch64 kernels with 64 KiB pages. Read once; 2 MiB where the file cannot be read.
uintptr_t huge_page_bytes() {
  static const uintptr_t bytes = [] {
    unsigned long long v = 0;
    if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
      if (std::fscanf(f, "%llu", &v) != 1) v = 0;
      std::fclose(f);
    }
    const bool power_of_two = v >= 4096 && (v & (v - 1)) == 0;
    return power_of_two ? uintptr_t(v) : uintptr_t(2) << 20;
  }();
  return bytes;
}
}  // namespace
#endif

bool advise_new_output(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < kHugeOutputMinBytes) return false;
  // Read on every call (a getenv, against an output of megabytes), so that a process can
  // compare both settings.
  const char* env = std::getenv("PORTABLE_GEMM_HUGE_PAGES");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  // Only the huge pages that lie wholly inside the output, of at least kHugeOutputMinBytes (a
  // mapping of its own under glibc, gone when freed): the advice never reaches memory that
  // is not ours, nor stays on memory the output gave back.
  const uintptr_t kHuge = huge_page_bytes();
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
