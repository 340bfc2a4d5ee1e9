# pg_install_manifest()
#
# Writes portable_gemm/lib/manifest.json at install time: every binary (file, kind,
# device, target, features from version_matrix, sha256), the torch whose headers built
# the bindings, the toolchain, and the source: the git commit the tree was at when CMake
# configured it and whether tracked files differed from it (null outside a git checkout,
# e.g. from an sdist). The loader trusts this file, never file names alone.
function(pg_install_manifest)
  get_property(binaries GLOBAL PROPERTY PG_BINARIES)
  set(kernel "{\"file\":\"libportable_gemm_kernels.so\",\"kind\":\"kernels\",\"device\":\"$<IF:$<BOOL:${PG_WITH_CUDA}>,cpu+cuda,cpu>\"}")
  list(PREPEND binaries "${kernel}")
  list(JOIN binaries ",\n    " binaries_json)
  if(PG_WITH_CUDA)
    set(cuda_json "{\"compiler\": \"nvcc ${CMAKE_CUDA_COMPILER_VERSION}\", \"archs\": \"${PG_CUDA_ARCH_LIST}\", \"cudart\": \"static\", \"sm90_gemm\": \"${PG_SM90_GEMM}\"}")
  else()
    set(cuda_json "null")
  endif()
  set(source_json "null")
  find_package(Git QUIET)
  if(GIT_FOUND AND EXISTS "${PROJECT_SOURCE_DIR}/.git")
    execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${PROJECT_SOURCE_DIR}" rev-parse --short HEAD
                    OUTPUT_VARIABLE commit RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${PROJECT_SOURCE_DIR}" status --porcelain --untracked-files=no
                    OUTPUT_VARIABLE changes RESULT_VARIABLE rc2 ERROR_QUIET)
    if(rc EQUAL 0 AND rc2 EQUAL 0 AND commit MATCHES "^[0-9a-f]+$")
      if(changes STREQUAL "")
        set(dirty false)
      else()
        set(dirty true)
      endif()
      set(source_json "{\"commit\": \"${commit}\", \"dirty\": ${dirty}}")
    endif()
  endif()
  message(STATUS "portable_gemm: source ${source_json}")
  string(JSON targets_json GET "${PG_MATRIX_JSON}" targets)
  string(JSON minimum GET "${PG_MATRIX_JSON}" minimum_torch)
  file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/manifest.in.json CONTENT "{
  \"project_version\": \"${PROJECT_VERSION}\",
  \"build_torch\": \"${TORCH_BUILD_VERSION}\",
  \"minimum_torch\": \"${minimum}\",
  \"source\": ${source_json},
  \"toolchain\": {\"cxx\": \"${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}\", \"cuda\": ${cuda_json}, \"system\": \"${CMAKE_SYSTEM_NAME}-${CMAKE_SYSTEM_PROCESSOR}\"},
  \"matrix_targets\": ${targets_json},
  \"binaries\": [
    ${binaries_json}
  ]
}
")
  find_package(Python REQUIRED COMPONENTS Interpreter)
  install(CODE "execute_process(COMMAND \"${Python_EXECUTABLE}\"
      \"${PROJECT_SOURCE_DIR}/cmake/write_manifest.py\"
      \"${CMAKE_BINARY_DIR}/manifest.in.json\"
      \"\${CMAKE_INSTALL_PREFIX}/${PG_LIB_DIR}\"
      COMMAND_ERROR_IS_FATAL ANY)")
endfunction()
