# Helpers for the thin per-target torch bindings. Every ABI knob lives here, once:
# TORCH_TARGET_VERSION, -Wundef, hidden visibility, USE_CUDA, what is linked and how.

# pg_find_torch()
#
# Locates the torch whose headers every target is compiled against (the newest one
# installed in the build environment; older targets are only a define) without importing
# torch (or at PORTABLE_GEMM_TORCH_ROOT). Sets in the caller: TORCH_ROOT, TORCH_INCLUDE_DIR, TORCH_LIB_DIR, TORCH_BUILD_VERSION.
# torch's headers and libraries are Python-independent: one torch can serve every Python.
set(PORTABLE_GEMM_TORCH_ROOT "" CACHE PATH
    "torch package folder to build against (default: the build interpreter's torch)")

function(pg_find_torch)
  set(root ${PORTABLE_GEMM_TORCH_ROOT})
  if(NOT root)
    find_package(Python REQUIRED COMPONENTS Interpreter)
    execute_process(
      COMMAND ${Python_EXECUTABLE} -c
        "import importlib.util as u, os; s = u.find_spec('torch'); print(os.path.dirname(s.origin) if s else '')"
      OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  endif()
  if(NOT root)
    message(FATAL_ERROR "portable_gemm: torch is not installed for ${Python_EXECUTABLE}. "
      "Install the torch whose headers to build against (e.g. pip install torch==2.13.0) "
      "and build without build isolation, or set -DPORTABLE_GEMM_TORCH=OFF.")
  endif()
  file(STRINGS ${root}/version.py line REGEX "^__version__")
  string(REGEX REPLACE ".*['\"](.*)['\"].*" "\\1" version "${line}")
  if(NOT EXISTS ${root}/include/torch/csrc/stable/library.h)
    message(FATAL_ERROR "portable_gemm: torch ${version} at ${root} has no stable ABI "
      "headers; build against torch >= 2.13 (its headers serve every target)")
  endif()
  message(STATUS "portable_gemm: building bindings against torch ${version} headers")
  set(TORCH_ROOT ${root} PARENT_SCOPE)
  set(TORCH_INCLUDE_DIR ${root}/include PARENT_SCOPE)
  set(TORCH_LIB_DIR ${root}/lib PARENT_SCOPE)
  set(TORCH_BUILD_VERSION ${version} PARENT_SCOPE)
endfunction()

# pg_torch_cuda_link_library(<out_var>)
#
# A CUDA binding must carry DT_NEEDED libtorch_cuda.so (torch loads its libraries
# RTLD_LOCAL, so an unlinked binding cannot see aoti_torch_get_current_cuda_stream).
# Link against the real library when the build torch is a CUDA build; otherwise
# against a link-time stub that only carries the SONAME (like CUDA's own libcuda stub).
# Which symbols each binary may use is proven separately by ci/symbol_audit.py against
# the export lists of every runtime release.
function(pg_torch_cuda_link_library out_var)
  if(EXISTS ${TORCH_LIB_DIR}/libtorch_cuda.so)
    set(${out_var} ${TORCH_LIB_DIR}/libtorch_cuda.so PARENT_SCOPE)
    return()
  endif()
  if(NOT TARGET pg_torch_cuda_link_stub)
    # CONFIGURE rewrites the file only when its content changes (no relink on every configure)
    file(CONFIGURE OUTPUT ${CMAKE_BINARY_DIR}/link_stub/stub.cpp CONTENT "// SONAME carrier, never installed\n")
    add_library(pg_torch_cuda_link_stub SHARED ${CMAKE_BINARY_DIR}/link_stub/stub.cpp)
    set_target_properties(pg_torch_cuda_link_stub PROPERTIES
      OUTPUT_NAME torch_cuda LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/link_stub
      NO_SONAME OFF)
    message(STATUS "portable_gemm: build torch has no libtorch_cuda.so; CUDA bindings "
                   "link a SONAME stub (the runtime resolves the real one)")
  endif()
  set(${out_var} pg_torch_cuda_link_stub PARENT_SCOPE)
endfunction()

# pg_add_torch_binding(VERSION <major.minor> DEVICE <cpu|cuda> SOURCES <files...>)
#
#   VERSION  torch target, e.g. 2.9; compiled with -DTORCH_TARGET_VERSION=<hex>
#   DEVICE   cpu: links libtorch_cpu + libc10; cuda: also libtorch_cuda, -DUSE_CUDA
#   SOURCES  binding sources (they may include only stable torch headers)
#
# Produces portable_gemm_<device>_t<major>_<minor>.so in portable_gemm/lib with RPATH
# $ORIGIN (to find the kernel library) and no path into the build environment, and
# records it for the build manifest.
function(pg_add_torch_binding)
  cmake_parse_arguments(PARSE_ARGV 0 ARG "" "VERSION;DEVICE" "SOURCES")
  if(NOT ARG_VERSION OR NOT ARG_DEVICE OR NOT ARG_SOURCES)
    message(FATAL_ERROR "pg_add_torch_binding needs VERSION, DEVICE and SOURCES")
  endif()
  pg_target_hex(${ARG_VERSION} hex)
  string(REPLACE "." "_" tag ${ARG_VERSION})
  set(name portable_gemm_${ARG_DEVICE}_t${tag})

  add_library(${name} SHARED ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src/torch)
  # Torch headers as SYSTEM: -Wundef then speaks about our #if's (the trap: there is no
  # TORCH_VERSION_2_9_0 macro, so '#if X >= TORCH_VERSION_2_9_0' silently reads 0).
  target_include_directories(${name} SYSTEM PRIVATE ${TORCH_INCLUDE_DIR})
  target_compile_definitions(${name} PRIVATE
    TORCH_TARGET_VERSION=${hex}
    PG_TARGET_VERSION="${ARG_VERSION}")
  target_compile_options(${name} PRIVATE -Wall -Wextra -Werror=undef -Wno-unused-parameter
    -ffile-prefix-map=${TORCH_INCLUDE_DIR}/=torch/include/)
  set(links portable_gemm_kernels ${TORCH_LIB_DIR}/libtorch_cpu.so ${TORCH_LIB_DIR}/libc10.so)
  if(ARG_DEVICE STREQUAL "cuda")
    pg_torch_cuda_link_library(torch_cuda)
    list(APPEND links ${torch_cuda})
    # aoti_torch_get_current_cuda_stream is declared only under USE_CUDA.
    target_compile_definitions(${name} PRIVATE USE_CUDA PG_WITH_CUDA)
    target_include_directories(${name} SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  # --no-as-needed: keep DT_NEEDED on torch's libraries even when a binding references
  # nothing from one directly; they are what makes its symbols resolvable under RTLD_LOCAL.
  target_link_libraries(${name} PRIVATE -Wl,--no-as-needed ${links} -Wl,--as-needed)
  if(NOT TARGET pg_torch_cuda_link_stub OR ARG_DEVICE STREQUAL "cpu")
    # Every symbol must resolve against the libraries linked (torch's own, at link time).
    target_link_options(${name} PRIVATE -Wl,-z,defs)
  endif()
  set_target_properties(${name} PROPERTIES
    PREFIX ""
    INSTALL_RPATH "$ORIGIN"
    BUILD_WITH_INSTALL_RPATH ON   # never an rpath into the build environment
    SKIP_BUILD_RPATH OFF)
  install(TARGETS ${name} LIBRARY DESTINATION ${PG_LIB_DIR})

  string(JSON features GET "${PG_MATRIX_JSON}" targets ${PG_TARGET_INDEX_${ARG_VERSION}} features)
  if(ARG_DEVICE STREQUAL "cuda")
    string(JSON stream GET "${features}" stream_api)
    string(JSON check GET "${features}" cuda_error_check)
    set(detail "stream via ${stream}, errors via ${check}")
  else()
    string(JSON threading GET "${features}" threading)
    set(detail "threads via ${threading}")
  endif()
  message(STATUS "portable_gemm: binding ${name}.so: target ${ARG_VERSION} "
                 "(TORCH_TARGET_VERSION=${hex}); ${detail}")
  set_property(GLOBAL APPEND PROPERTY PG_BINARIES
    "{\"file\":\"${name}.so\",\"kind\":\"binding\",\"device\":\"${ARG_DEVICE}\",\"target\":\"${ARG_VERSION}\",\"target_hex\":\"${hex}\",\"features\":${features}}")
endfunction()
