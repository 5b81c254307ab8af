// A small MPI program that drives the Communicator through the stage command line, for the
// watchdog tests (test_flight_recorder.cc): ten all-reduces of 256 ones, then a check that each
// summed to the number of ranks. With --fault-skip-collective RANK:SEQ that rank skips one op,
// the others wait for it forever, and the watchdog must abort the job with a diagnosis.
#include <mpi.h>

#include <cstdio>

#include <fmt/format.h>

#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/ops.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const tpx::StageInfo info{"comm_fault_probe", "all-reduces for the comm watchdog tests", false};
  const tpx::CliOutcome cli = tpx::parse_stage_cli(info, argc, argv);
  int rc = cli.exit_code;
  if (cli.options) {
    auto comm = tpx::make_communicator(cli.options->comm, tpx::Device::cpu);
    const tpx::Stream stream;
    const tpx::Tensor t = tpx::Tensor::empty({256});
    int wrong = 0;
    constexpr int kOps = 10;
    for (int i = 0; i < kOps; ++i) {
      tpx::ops::fill(t, 1.0f);
      comm->all_reduce(t, stream);
      for (float v : t.f32()) wrong += v != float(world) ? 1 : 0;
    }
    rc = wrong == 0 ? 0 : 1;
    fmt::print("comm_fault_probe: rank {}: {} all-reduces, {} wrong values\n", rank, kOps, wrong);
  } else {
    fmt::print(stderr, "comm_fault_probe: {}\n", cli.message);
  }
  std::fflush(stdout);
  MPI_Finalize();
  return rc;
}
