# The single switch for the CUDA backend. TPX_CUDA=AUTO (default) builds it when a CUDA compiler
# is found; ON requires it; OFF never builds it. The CPU build never needs CUDA.
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
message(STATUS "tpx: CUDA backend ${TPX_WITH_CUDA}")
