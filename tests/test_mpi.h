// MPI for a test program that runs under mpirun: initialised once for the whole program (gtest_main
// does not know about MPI), and the caller's place in MPI_COMM_WORLD. Include it from exactly one
// file of a test executable.
//
// defines: tpx::test::MpiEnvironment, tpx::test::world_rank(), tpx::test::world_size()
#pragma once

#include <mpi.h>

#include <gtest/gtest.h>

namespace tpx::test {

class MpiEnvironment : public testing::Environment {
 public:
  void SetUp() override {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  }
  void TearDown() override { MPI_Finalize(); }
};
[[maybe_unused]] inline testing::Environment* const kMpi =
    testing::AddGlobalTestEnvironment(new MpiEnvironment);

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace tpx::test
