// Build facts of the kernel library. The PG_* macros are set by src/kernels/CMakeLists.txt
// so that a bug report can quote exactly which compiler and CUDA archs produced this
// binary, independently of which torch binding loaded it.
#include <cstdlib>
#include <cstring>

#include "portable_gemm/kernels.h"

#ifndef PG_VERSION
#define PG_VERSION "unknown"
#endif
#ifndef PG_CXX_COMPILER
#define PG_CXX_COMPILER "unknown"
#endif

namespace portable_gemm {

const char* build_info() {
  // One string literal assembled at compile time: callers may keep the pointer forever.
  return "portable_gemm " PG_VERSION "; cxx: " PG_CXX_COMPILER
#if defined(PG_WITH_CUDA)
#ifndef PG_CUDA_COMPILER
#define PG_CUDA_COMPILER "unknown"
#endif
#ifndef PG_CUDA_ARCHS
#define PG_CUDA_ARCHS "unknown"
#endif
         "; cuda: " PG_CUDA_COMPILER "; cuda archs: " PG_CUDA_ARCHS
#if defined(PG_SM90_GEMM)
         "; sm_90 gemm: " PG_SM90_GEMM
#else
         "; sm_90 gemm: portable kernel (no CUTLASS)"
#endif
#else
         "; cuda: none"
#endif
      ;
}

bool has_cuda() {
#if defined(PG_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

bool fill_new_outputs() {
  static const bool on = [] {
    const char* e = std::getenv("PORTABLE_GEMM_FILL_OUTPUTS");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}

}  // namespace portable_gemm
