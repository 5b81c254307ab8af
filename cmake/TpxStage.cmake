# tpx_add_stage(<dir> SOURCES <main.cc ...> [LIBS <libs>])
#
# Builds the stage executable build/bin/<dir> from its sources, links tpx_common, and registers the
# stage's smoke test: the default-sized run is too slow for CI, so the test runs a small config with
# --check under mpirun for every rank count in TPX_STAGE_RANKS (default 1).
function(tpx_add_stage name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;RANKS;TEST_ARGS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE tpx_common ${ARG_LIBS})
  tpx_warnings(${name})
  if(NOT ARG_RANKS)
    set(ARG_RANKS 1)
  endif()
  string(SUBSTRING "${name}" 0 2 stage_number)
  set(stage_label "stage${stage_number}")  # ctest -L stage04: this stage's tests
  if(TPX_BUILD_TESTS)
    foreach(np IN LISTS ARG_RANKS)
      add_test(NAME ${name}.check.np${np}
        COMMAND ${MPIEXEC_EXECUTABLE} ${TPX_MPIEXEC_FLAGS} ${MPIEXEC_NUMPROC_FLAG} ${np}
                $<TARGET_FILE:${name}> --check ${ARG_TEST_ARGS})
      set_tests_properties(${name}.check.np${np} PROPERTIES
        ENVIRONMENT "${TPX_TEST_ENV}" PROCESSORS ${np} TIMEOUT 300 LABELS "stage;mpi;${stage_label}")
    endforeach()
  endif()
endfunction()

# Open MPI refuses root without these; CI machines have 2 cores, so allow oversubscription. The
# tests run on one node: ob1 over shared memory starts faster than UCX, and a job whose ranks
# exited with an error ends without mpirun's one-second waits (scripts/env.sh says the same).
set(TPX_MPIEXEC_FLAGS --oversubscribe --bind-to none)
set(TPX_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
  OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
  OMPI_MCA_pml=ob1 OMPI_MCA_odls_base_sigkill_timeout=0)
