# tpx_python_with(VAR MODULE): sets VAR to the first Python interpreter that can import MODULE:
# the one CMake found (Python3_EXECUTABLE), else Debian's /usr/bin/python3, whose site-packages
# hold the Debian python3-* packages (matplotlib, selenium) that scripts/setup.sh installs. When
# none can, VAR is the one CMake found, and the test that runs it skips or fails saying why.
function(tpx_python_with var module)
  set(chosen ${Python3_EXECUTABLE})
  foreach(py ${Python3_EXECUTABLE} /usr/bin/python3)
    execute_process(COMMAND ${py} -c "import ${module}" RESULT_VARIABLE missing
      OUTPUT_QUIET ERROR_QUIET)
    if(missing EQUAL 0)
      set(chosen ${py})
      break()
    endif()
  endforeach()
  set(${var} ${chosen} PARENT_SCOPE)
endfunction()
