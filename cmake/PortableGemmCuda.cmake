# pg_enable_cuda(<out_var>)
#
# Enables CUDA when PORTABLE_GEMM_CUDA is ON, or AUTO and a CUDA compiler is found.
# Sets <out_var> to TRUE/FALSE, PG_CUDA_GENCODE (the -gencode flags) and
# PG_CUDA_ARCH_LIST. A macro, not a function: enable_language() must run in file scope.
# PORTABLE_GEMM_CUDA_ARCHS lists SASS targets; PTX of the last plain arch is embedded too
# so that newer GPUs JIT-compile it.
set(PORTABLE_GEMM_CUDA_ARCHS "80;86;89;90a" CACHE STRING
    "CUDA SASS targets (90a = Hopper with wgmma); PTX for the newest plain arch is added")

macro(pg_enable_cuda out_var)
  set(${out_var} FALSE)
  if(PORTABLE_GEMM_CUDA STREQUAL "OFF")
    message(STATUS "portable_gemm: Not building CUDA kernels: PORTABLE_GEMM_CUDA=OFF")
  else()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_ARCHITECTURES OFF)  # explicit -gencode flags below
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(PG_CUDA_GENCODE "")
      foreach(_pg_arch IN LISTS PORTABLE_GEMM_CUDA_ARCHS)
        list(APPEND PG_CUDA_GENCODE "-gencode=arch=compute_${_pg_arch},code=sm_${_pg_arch}")
        string(REGEX REPLACE "[a-z]$" "" _pg_ptx ${_pg_arch})
      endforeach()
      list(APPEND PG_CUDA_GENCODE "-gencode=arch=compute_${_pg_ptx},code=compute_${_pg_ptx}")
      set(PG_CUDA_ARCH_LIST "${PORTABLE_GEMM_CUDA_ARCHS};compute_${_pg_ptx}")
      message(STATUS "portable_gemm: Building CUDA kernels with nvcc "
                     "${CMAKE_CUDA_COMPILER_VERSION} for SASS sm_${PORTABLE_GEMM_CUDA_ARCHS} "
                     "+ PTX compute_${_pg_ptx}; static cudart")
      set(${out_var} TRUE)
    elseif(PORTABLE_GEMM_CUDA STREQUAL "ON")
      message(FATAL_ERROR "portable_gemm: PORTABLE_GEMM_CUDA=ON but no CUDA compiler was "
                          "found; put nvcc on PATH or set CMAKE_CUDA_COMPILER")
    else()
      message(STATUS "portable_gemm: Not building CUDA kernels: no CUDA compiler found "
                     "(set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
    endif()
  endif()
endmacro()
