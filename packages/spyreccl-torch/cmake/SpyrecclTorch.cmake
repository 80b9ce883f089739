# Locates the torch of the building Python (headers and the few libraries the extensions link)
# WITHOUT torch's own find_package(Torch).
#
# Why not find_package(Torch): on a CUDA build of torch (every Linux x86_64 wheel on PyPI) it
# goes through Caffe2's CUDA checks and stops with "Your installed Caffe2 version uses CUDA but
# I cannot find the CUDA libraries" unless a CUDA toolkit is installed. Our extensions use no
# CUDA: they need torch's headers, libc10, libtorch_cpu and (for the Python module)
# libtorch_python, plus the compile definitions libtorch_cpu was built with. This module reads
# those from the torch package itself, the same way for CPU and CUDA wheels.
#
# Requires Python3_EXECUTABLE. Defines:
#   spyreccl::torch          INTERFACE target: include dirs, definitions, libc10 + libtorch_cpu
#   spyreccl::torch_python   INTERFACE target: spyreccl::torch + libtorch_python
#   SPYRECCL_TORCH_VERSION   torch.__version__ of the torch built against, e.g. 2.10.0+cu128
#   SPYRECCL_TORCH_PREFIX    the torch package directory (holds include/ and lib/)

if(TARGET spyreccl::torch)
  return()
endif()

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _spyreccl_torch_info
  ERROR_VARIABLE _spyreccl_torch_err
  RESULT_VARIABLE _spyreccl_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _spyreccl_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "spyreccl-torch: could not import torch with ${Python3_EXECUTABLE}:\n${_spyreccl_torch_err}\n"
    "Install torch (>=2.10,<2.16) into this Python first and build with "
    "`pip install --no-build-isolation`.")
endif()
string(REPLACE "\n" ";" _spyreccl_torch_info "${_spyreccl_torch_info}")
list(GET _spyreccl_torch_info 0 SPYRECCL_TORCH_VERSION)
list(GET _spyreccl_torch_info 1 SPYRECCL_TORCH_PREFIX)
list(GET _spyreccl_torch_info 2 _spyreccl_torch_cxx11_abi)

foreach(_lib c10 torch_cpu torch_python)
  # Not cached: a reused build tree must follow the torch now installed.
  unset(SPYRECCL_TORCH_${_lib}_LIBRARY CACHE)
  find_library(SPYRECCL_TORCH_${_lib}_LIBRARY ${_lib}
    PATHS "${SPYRECCL_TORCH_PREFIX}/lib" NO_DEFAULT_PATH)
  if(NOT SPYRECCL_TORCH_${_lib}_LIBRARY)
    message(FATAL_ERROR "spyreccl-torch: lib${_lib}.so not found in ${SPYRECCL_TORCH_PREFIX}/lib")
  endif()
endforeach()

# libtorch_cpu's interface definitions (USE_DISTRIBUTED, USE_C10D_GLOO, ...) change which
# members the c10d headers declare: they must match the build of torch. Read them from the
# targets file torch ships (it only declares targets; including it is what triggers the CUDA
# checks, reading it is harmless).
set(_spyreccl_torch_defs USE_DISTRIBUTED USE_C10D_GLOO)
set(_spyreccl_targets "${SPYRECCL_TORCH_PREFIX}/share/cmake/Caffe2/Caffe2Targets.cmake")
if(EXISTS "${_spyreccl_targets}")
  file(READ "${_spyreccl_targets}" _spyreccl_targets_text)
  if(_spyreccl_targets_text MATCHES
     "set_target_properties\\(torch_cpu PROPERTIES[^)]*INTERFACE_COMPILE_DEFINITIONS \"([^\"]*)\"")
    set(_spyreccl_torch_defs "${CMAKE_MATCH_1}")
  endif()
endif()

# torch 2.x wheels use the C++11 ABI, the compiler's default; an old-ABI build needs it said.
if(_spyreccl_torch_cxx11_abi STREQUAL "0")
  list(APPEND _spyreccl_torch_defs _GLIBCXX_USE_CXX11_ABI=0)
endif()

# The C++ standard torch's headers need (ATen.h says it in its #error): C++17 up to torch
# 2.13, C++20 from 2.14 on. A compile feature raises our targets' CXX_STANDARD to it.
set(_spyreccl_torch_cxx_std 17)
file(STRINGS "${SPYRECCL_TORCH_PREFIX}/include/ATen/ATen.h" _spyreccl_aten_std
  REGEX "C\\+\\+[0-9]+ or later")
if(_spyreccl_aten_std MATCHES "C\\+\\+([0-9]+) or later")
  set(_spyreccl_torch_cxx_std "${CMAKE_MATCH_1}")
endif()

add_library(spyreccl::torch INTERFACE IMPORTED)
set_target_properties(spyreccl::torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES
    "${SPYRECCL_TORCH_PREFIX}/include;${SPYRECCL_TORCH_PREFIX}/include/torch/csrc/api/include"
  INTERFACE_COMPILE_DEFINITIONS "${_spyreccl_torch_defs}"
  INTERFACE_COMPILE_FEATURES "cxx_std_${_spyreccl_torch_cxx_std}"
  INTERFACE_LINK_LIBRARIES
    "${SPYRECCL_TORCH_c10_LIBRARY};${SPYRECCL_TORCH_torch_cpu_LIBRARY}")

add_library(spyreccl::torch_python INTERFACE IMPORTED)
set_target_properties(spyreccl::torch_python PROPERTIES
  INTERFACE_LINK_LIBRARIES "spyreccl::torch;${SPYRECCL_TORCH_torch_python_LIBRARY}")

message(STATUS "spyreccl-torch: building against torch ${SPYRECCL_TORCH_VERSION} "
  "(${SPYRECCL_TORCH_PREFIX}; C++${_spyreccl_torch_cxx_std}; definitions: ${_spyreccl_torch_defs})")
