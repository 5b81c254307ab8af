// The communicator a test program's ranks share: MPI over the whole job, on the cpu.
//
// defines: tpx::test::job_communicator()
#pragma once

#include <memory>

#include "common/comm/communicator.h"

namespace tpx::test {

/// An MPI communicator over every rank of the job, on the cpu, with a 60 s watchdog: a bug that
/// hangs becomes an abort with a diagnosis.
inline std::unique_ptr<Communicator> job_communicator() {
  CommOptions o;
  o.kind = CommKind::mpi;
  o.timeout_s = 60;
  return make_communicator(o, Device::cpu);
}

}  // namespace tpx::test
