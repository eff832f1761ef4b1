# Checks that the engine's folders keep their dependency rules (issue: one engine core):
#   kernels/core   includes neither backend, nor BLAS or CUDA headers, nor the registry's headers
#   kernels/cpu    includes nothing from kernels/cuda (nor CUDA headers)
#   kernels/cuda   includes nothing from kernels/cpu (its internal or public headers)
# The backend registry (kernels/registry.cc) is the one file that includes both.
# Usage: cmake -DKERNELS_DIR=<dir> [-DEXPECT_VIOLATIONS=N] -P layering_test.cmake
# Without EXPECT_VIOLATIONS the check fails on any violation; with it, it fails unless exactly N
# are found (the fixture under layering_fixture/ proves that every rule can fail).
if(NOT KERNELS_DIR)
  message(FATAL_ERROR "KERNELS_DIR is not set")
endif()

# folder;regex of forbidden #include targets
set(rules
  "core|^\"(cpu|cuda)/|^\"kvc/(selection|attention|backend|gpu_memory)\\.h\"|^<(cblas|cuda|cuda_runtime|cuda_runtime_api|cublas_v2|nccl)\\.h>"
  "cpu|^\"cuda/|^<(cuda|cuda_runtime|cuda_runtime_api|cublas_v2|nccl)\\.h>|^\"kvc/(backend|gpu_memory)\\.h\""
  "cuda|^\"cpu/|^\"kvc/(selection|attention|backend|gpu_memory)\\.h\"|^<cblas\\.h>")

set(violations 0)
foreach(rule IN LISTS rules)
  string(FIND "${rule}" "|" bar)
  string(SUBSTRING "${rule}" 0 ${bar} folder)
  math(EXPR start "${bar} + 1")
  string(SUBSTRING "${rule}" ${start} -1 forbidden)
  file(GLOB_RECURSE sources "${KERNELS_DIR}/${folder}/*.cc" "${KERNELS_DIR}/${folder}/*.h"
       "${KERNELS_DIR}/${folder}/*.cu" "${KERNELS_DIR}/${folder}/*.cuh")
  foreach(source IN LISTS sources)
    file(STRINGS "${source}" includes REGEX "^[ \t]*#[ \t]*include[ \t]")
    foreach(line IN LISTS includes)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]+" "" target "${line}")
      if(target MATCHES "${forbidden}")
        file(RELATIVE_PATH rel "${KERNELS_DIR}" "${source}")
        message(STATUS "layering: ${rel} includes ${target} (not allowed in kernels/${folder})")
        math(EXPR violations "${violations} + 1")
      endif()
    endforeach()
  endforeach()
endforeach()

if(DEFINED EXPECT_VIOLATIONS)
  if(NOT violations EQUAL EXPECT_VIOLATIONS)
    message(FATAL_ERROR "layering: ${violations} violations, expected ${EXPECT_VIOLATIONS}")
  endif()
  message(STATUS "layering: ${violations} violations, as expected")
elseif(violations GREATER 0)
  message(FATAL_ERROR "layering: ${violations} forbidden includes in ${KERNELS_DIR}")
else()
  message(STATUS "layering: kernels/core, cpu and cuda include only what they may")
endif()
