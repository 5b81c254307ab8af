// A small MPI program that drives the Communicator through the stage command line, for the
// watchdog tests (test_flight_recorder.cc): ten all-reduces of 256 ones, then an all-gather of
// each rank's number plus one into a buffer of −1s, then a check that each sum is the number of
// ranks and the gather holds 1, 2, ... With --fault-skip-collective RANK:SEQ that rank skips one
// op, the others wait for it forever, and the watchdog must abort the job with a diagnosis. A
// probe that gets to its end with a fault flag prints what became of it, as a stage does
// (CommMonitor::fault_report), and exits 1.
#include <mpi.h>

#include <cstdio>

#include <fmt/format.h>

#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/comm/watchdog.h"
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
    tpx::CommOptions o = cli.options->comm;
    o.monitor = tpx::make_comm_monitor(o);  // the stages' way: one monitor, asked at the end
    auto comm = tpx::make_communicator(o, tpx::Device::cpu);
    const tpx::Stream stream;
    const tpx::Tensor t = tpx::Tensor::empty({256});
    int wrong = 0;
    constexpr int kOps = 10;
    for (int i = 0; i < kOps; ++i) {
      tpx::ops::fill(t, 1.0f);
      comm->all_reduce(t, stream);
      for (float v : t.f32()) wrong += v != float(world) ? 1 : 0;
    }
    const tpx::Tensor mine = tpx::Tensor::empty({1}), all = tpx::Tensor::empty({world});
    tpx::ops::fill(mine, float(rank + 1));
    tpx::ops::fill(all, -1.0f);
    comm->all_gather(mine, all, stream);
    for (int r = 0; r < world; ++r) wrong += all.f32()[std::size_t(r)] != float(r + 1) ? 1 : 0;
    o.monitor->barrier();  // no rank leaves while another may still ask for its records
    rc = wrong == 0 ? 0 : 1;
    fmt::print("comm_fault_probe: rank {}: {} all-reduces and an all-gather, {} wrong values\n",
               rank, kOps, wrong);
    if (const std::string faults = o.monitor->fault_report(); !faults.empty()) {
      fmt::print(stderr, "comm_fault_probe: rank {}: {}\n", rank, faults);
      rc = 1;
    }
  } else {
    fmt::print(stderr, "comm_fault_probe: {}\n", cli.message);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Finalize();
  return rc;
}
