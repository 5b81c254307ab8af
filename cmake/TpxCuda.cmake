# The single switch for the CUDA backend. TPX_CUDA=AUTO (default) builds it when a CUDA compiler
# is found; ON requires it; OFF never builds it. The CPU build never needs CUDA.
#
# When the backend is built: the CUDA language is enabled for sm_80 and sm_90 unless
# CMAKE_CUDA_ARCHITECTURES says otherwise, CUDAToolkit provides CUDA::cudart, CUDA::cublas and
# CUDA::cublasLt, and NCCL (optional) becomes the imported target tpx::nccl with TPX_WITH_NCCL ON.
set(TPX_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO, ON or OFF")
set_property(CACHE TPX_CUDA PROPERTY STRINGS AUTO ON OFF)

set(TPX_WITH_CUDA OFF)
if(NOT TPX_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(TPX_WITH_CUDA ON)
  elseif(TPX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TPX_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

if(TPX_WITH_CUDA)
  # A100 and H100/H200 by default; override with -DCMAKE_CUDA_ARCHITECTURES=... (e.g. native).
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING "CUDA architectures to build for")
  endif()
  enable_language(CUDA)
  # The .cu files hold only kernels and their launchers (C++17 is all they use); CMake 3.25 does
  # not know nvcc's C++20 flag, so they build as C++17.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(CMAKE_CUDA_EXTENSIONS OFF)
  find_package(CUDAToolkit REQUIRED)

  # NCCL ships with the toolkit here (or in /usr/local); it is optional for the backend itself.
  option(TPX_USE_NCCL "Use NCCL for cuda tensors when it is found" ON)
  set(TPX_WITH_NCCL OFF)
  find_path(TPX_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/include)
  find_library(TPX_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
               /usr/local/cuda/lib /usr/local/lib)
  if(TPX_USE_NCCL AND TPX_NCCL_INCLUDE_DIR AND TPX_NCCL_LIBRARY AND NOT TARGET tpx::nccl)
    add_library(tpx::nccl UNKNOWN IMPORTED GLOBAL)
    set_target_properties(tpx::nccl PROPERTIES
      IMPORTED_LOCATION ${TPX_NCCL_LIBRARY}
      INTERFACE_INCLUDE_DIRECTORIES ${TPX_NCCL_INCLUDE_DIR})
    set(TPX_WITH_NCCL ON)
  endif()
  message(STATUS "tpx: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${TPX_WITH_NCCL}")
endif()
message(STATUS "tpx: CUDA backend ${TPX_WITH_CUDA}")
