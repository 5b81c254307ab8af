# Warnings applied to every tpx target through tpx_warnings(). With TPX_WERROR=ON (what the test
# command configures, so CI keeps the C++ and CUDA sources warning-free) they are errors.
option(TPX_WERROR "Treat compiler warnings (g++ and nvcc) as errors" OFF)

function(tpx_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>)
  if(TPX_WERROR)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Werror>
      "$<$<COMPILE_LANGUAGE:CUDA>:SHELL:--Werror all-warnings>"
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>)
  endif()
endfunction()
