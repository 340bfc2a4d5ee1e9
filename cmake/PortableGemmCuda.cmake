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

# pg_find_cutlass(<out_include_dir> <out_version>)
#
# CUTLASS headers for the sm_90a (TMA + wgmma) dense GEMM. PORTABLE_GEMM_CUTLASS_DIR names
# an include directory holding cutlass/cutlass.h; otherwise the headers of the
# `nvidia-cutlass` package of the building Python are used (pip install --no-deps
# nvidia-cutlass; the package is only read, never imported). Empty when neither is there
# or PORTABLE_GEMM_CUTLASS is OFF.
set(PORTABLE_GEMM_CUTLASS "AUTO" CACHE STRING
    "Build the sm_90a CUTLASS GEMM: AUTO (when CUTLASS headers are found), ON or OFF")
set_property(CACHE PORTABLE_GEMM_CUTLASS PROPERTY STRINGS AUTO ON OFF)
set(PORTABLE_GEMM_CUTLASS_DIR "" CACHE PATH "CUTLASS include directory (holds cutlass/cutlass.h)")

function(pg_find_cutlass out_dir out_version)
  set(${out_dir} "" PARENT_SCOPE)
  set(${out_version} "" PARENT_SCOPE)
  if(PORTABLE_GEMM_CUTLASS STREQUAL "OFF")
    message(STATUS "portable_gemm: Not building the sm_90a CUTLASS GEMM: PORTABLE_GEMM_CUTLASS=OFF")
    return()
  endif()
  set(dir "${PORTABLE_GEMM_CUTLASS_DIR}")
  if(NOT dir)
    find_package(Python COMPONENTS Interpreter QUIET)
    if(Python_EXECUTABLE)
      execute_process(
        COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')"
        OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  if(NOT dir OR NOT EXISTS "${dir}/cutlass/cutlass.h" OR NOT EXISTS "${dir}/cutlass/version.h")
    set(why "no CUTLASS headers (pip install --no-deps nvidia-cutlass, or set PORTABLE_GEMM_CUTLASS_DIR)")
    if(PORTABLE_GEMM_CUTLASS STREQUAL "ON")
      message(FATAL_ERROR "portable_gemm: PORTABLE_GEMM_CUTLASS=ON but ${why}")
    endif()
    message(STATUS "portable_gemm: Not building the sm_90a CUTLASS GEMM: ${why}")
    return()
  endif()
  file(STRINGS "${dir}/cutlass/version.h" lines REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  set(version "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^#define CUTLASS_[A-Z]+ ([0-9]+).*" "\\1" v "${line}")
    list(APPEND version ${v})
  endforeach()
  list(JOIN version "." version)
  if(version VERSION_LESS 3.5)
    message(FATAL_ERROR "portable_gemm: CUTLASS ${version} at ${dir} is too old (need >= 3.5)")
  endif()
  set(${out_dir} "${dir}" PARENT_SCOPE)
  set(${out_version} "${version}" PARENT_SCOPE)
endfunction()
