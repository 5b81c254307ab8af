// How the ranks of a job agree before they start, so that no rank is left waiting in a collective
// that another rank will never enter.
//
// A rank that stops on its own (a bad flag on its command line, a device it cannot use, a path
// it cannot write) would leave the others blocked in their first collective forever: the
// watchdog only watches the communicator, which does not exist yet. So every start-up check ends
// in agree_to_start(), one all-reduce that every rank enters whatever its own verdict: if any
// rank must stop, all stop, and all print the first such rank's message.
//
// Ranks started with different flags (MPMD `mpirun -np 1 a --hidden 64 : -np 1 a --hidden 128`,
// or a per-rank `--seed`) would compute a wrong result or crash inside MPI on mismatched buffer
// sizes. config_disagreement() compares the flags that shape the computation with one
// all-reduce of a hash and, only when the hashes differ, gathers the flags to name the first one
// that differs.
//
// defines: tpx::StartVerdict, tpx::agree_to_start(), tpx::ConfigFields,
//          tpx::config_disagreement()
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tpx {

/// What the ranks agreed: run, or stop with the first stopping rank's exit code and message.
struct StartVerdict {
  bool stop = false;
  int exit_code = 0;
  int rank = -1;  ///< the first (lowest) rank that asked to stop
  std::string message;
  /// Every rank asked to stop, with the same message: it is said once, without naming a rank.
  bool unanimous = false;
};

/// Collective over MPI_COMM_WORLD; every rank must call it, stopping or not. Returns the same
/// verdict on every rank, so that one rank (rank 0) can print it for all.
StartVerdict agree_to_start(bool stop, int exit_code, const std::string& message);

/// Flags that shape the computation, as (name, value) pairs in a fixed order.
using ConfigFields = std::vector<std::pair<std::string, std::string>>;

/// Collective over MPI_COMM_WORLD. Empty when every rank has the same fields; otherwise one
/// sentence, the same on every rank, naming the first differing field and its values on rank 0
/// and on the first rank that differs from it.
std::string config_disagreement(const ConfigFields& fields);

}  // namespace tpx
